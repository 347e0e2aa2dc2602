"""The shape of a GPT (`GPTConfig`) and the named sizes: what configuration, commands and checks need to
know before a model exists, without importing torch (mingpt.model builds the model from it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mingpt.errors import ConfigError

# The architectures by name, each part a field of GPTConfig of its own. gpt2: learned positions, LayerNorm, a GELU
# MLP, GPT-2's initialisation and a head tied to the token embedding. modern (as in the modded-nanogpt speedrun):
# rotary positions, RMSNorm, QK-norm, a ReLU-squared MLP, zero-initialised output projections and an untied head.
ARCHS: dict[str, dict[str, object]] = {
    "gpt2": {"rotary": False, "norm": "layernorm", "qk_norm": False, "mlp": "gelu", "zero_init": False,
             "tie_weights": True},
    "modern": {"rotary": True, "norm": "rmsnorm", "qk_norm": True, "mlp": "relu2", "zero_init": True,
               "tie_weights": False},
}
NORMS, MLPS = ("layernorm", "rmsnorm"), ("gelu", "relu2")

# Layer, head and width of the named model sizes (minGPT's table).
PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt-nano": (3, 3, 48),
    "gpt-micro": (4, 4, 128),
    "gpt-mini": (6, 6, 192),
    "gopher-44m": (8, 16, 512),
    "openai-gpt": (12, 12, 768),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


def architecture(name: str, arch: str | None) -> str:
    """model.arch where set (`arch`), else preset `name`'s: GPT-2's for the published GPTs (their weights load and
    export), the modern one for the small sizes, where it reaches a lower loss in the same time."""
    return arch if arch is not None else ("gpt2" if name == "openai-gpt" or name.startswith("gpt2") else "modern")


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT. `vocab_size` and `block_size` come from the data."""

    vocab_size: int
    block_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm; without them is a little faster and no worse
    tie_weights: bool = True  # share the token embedding with the output projection
    rotary: bool = False  # rotary position embeddings on queries and keys, instead of a learned position table
    norm: str = "layernorm"  # layernorm or rmsnorm
    qk_norm: bool = False  # queries and keys normalised (RMSNorm per head) before attention
    mlp: str = "gelu"  # gelu (GPT-2's tanh form) or relu2 (ReLU squared)
    zero_init: bool = False  # the residual projections (and an untied head) start at zero, not GPT-2's scaled normal

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"choose n_embd as a multiple of n_head (e.g. {self.n_head * max(1, round(self.n_embd / self.n_head))})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        if self.norm not in NORMS or self.mlp not in MLPS:
            raise ConfigError(f"model.norm must be one of {', '.join(NORMS)} and model.mlp one of {', '.join(MLPS)}; "
                              f"got norm={self.norm!r}, mlp={self.mlp!r}")
        if self.rotary and (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"model.rotary needs an even head size; n_embd={self.n_embd} / n_head={self.n_head} is "
                              f"{self.n_embd // self.n_head}: choose n_embd as a multiple of 2 * n_head")

    @property
    def arch(self) -> str:
        """The name of this architecture (ARCHS), or "custom" where its parts are no named one's."""
        parts = {name: getattr(self, name) for name in ARCHS["gpt2"]}
        return next((name for name, named in ARCHS.items() if named == parts), "custom")

    def least_parameters(self) -> int:
        """A lower bound of the parameter count, from the shape alone: token embedding, attention and MLP matrices."""
        return self.vocab_size * self.n_embd + self.n_layer * 12 * self.n_embd**2

    @classmethod
    def from_preset(cls, name: str, vocab_size: int, block_size: int, **overrides) -> "GPTConfig":
        """The config of a named size (see PRESETS), e.g. `GPTConfig.from_preset("gpt-mini", 65, 256)`."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
        n_layer, n_head, n_embd = PRESETS[name]
        sizes = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        return cls(vocab_size=vocab_size, block_size=block_size, **{**sizes, **overrides})

    def to_dict(self) -> dict:
        return asdict(self)
