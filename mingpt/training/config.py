"""Typed configuration of a training job, one dataclass per component. Hydra composes these from YAML and the command
line; OmegaConf rejects a wrong type, and `validate` a wrong value, naming the key, before any process group or data
work starts."""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from functools import reduce
from typing import Any, Dict, Iterator, List, Optional, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf

from mingpt.data.prepare import PrepareConfig
from mingpt.data.settings import MIN_BPE_SAMPLE
from mingpt.errors import ConfigError
from mingpt.metrics.hellaswag import PUBLIC_URL
from mingpt.metrics.loggers import check_loggers
from mingpt.shape import ARCHS, PRESETS, GPTConfig, architecture
from mingpt.storage import redact


@dataclass
class ModelConfig:
    name: str = "gpt-micro"  # a preset (see mingpt.shape.PRESETS) giving the sizes not set below
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    dropout: float = 0.0
    bias: bool = False
    # gpt2 (Hugging Face's GPT-2) or modern (mingpt.shape.ARCHS); null: model.init_from's weights', else the preset's
    # (mingpt.shape.architecture). Each part below, where set, replaces the architecture's.
    arch: Optional[str] = None
    rotary: Optional[bool] = None  # rotary positions instead of a learned position table
    norm: Optional[str] = None  # layernorm or rmsnorm
    qk_norm: Optional[bool] = None  # queries and keys normalised before attention
    mlp: Optional[str] = None  # gelu or relu2 (ReLU squared)
    zero_init: Optional[bool] = None  # residual projections (and an untied head) start at zero
    tie_head: Optional[bool] = None  # the output head shares the token embedding's weights
    # Start a new run from these weights: a Hugging Face GPT-2 folder or a mingpt snapshot (local or a URL).
    # Its shape replaces the preset's; a run that has snapshots of its own resumes from them instead.
    init_from: Optional[str] = None
    # The fields above that set the architecture's parts one by one, by GPTConfig's name for each (not a field).
    PART_FIELDS = {"rotary": "rotary", "norm": "norm", "qk_norm": "qk_norm", "mlp": "mlp", "zero_init": "zero_init",
                   "tie_weights": "tie_head"}

    def build(self, vocab_size: int, block_size: int) -> GPTConfig:
        sizes = {k: v for k, v in (("n_layer", self.n_layer), ("n_head", self.n_head), ("n_embd", self.n_embd))
                 if v is not None}  # GPTConfig checks them
        return GPTConfig.from_preset(self.name, vocab_size, block_size, dropout=self.dropout, bias=self.bias,
                                     **sizes, **self.parts())

    def parts(self) -> dict:
        """The architecture's parts, as GPTConfig names (and checks) them: model.arch's, with those set on their own."""
        arch = architecture(self.name, self.arch)
        if arch not in ARCHS:
            raise ConfigError(f"model.arch must be one of {', '.join(ARCHS)}; got {arch!r}")
        chosen = {part: getattr(self, field) for part, field in self.PART_FIELDS.items()}
        return {**ARCHS[arch], **{name: value for name, value in chosen.items() if value is not None}}

    def sets_parts(self) -> bool:
        """Whether model.arch or a part of it was set."""
        return any(getattr(self, field) is not None for field in ("arch", *self.PART_FIELDS.values()))


@dataclass
class DataConfig(PrepareConfig):
    """The corpus and its preparation (data.tokenizer defaults to model.init_from's), and the examples read from it."""

    block_size: int = 128
    # random: a window at an offset drawn from (seed, position); strided: the blocks, in a fresh order each epoch.
    windows: str = "random"


OPTIMIZERS = ("adamw", "muon")  # trainer.optimizer's values (mingpt.training.optimizer builds them)


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    global_batch_size: int = 32  # examples per optimizer step, whatever the world size
    micro_batch_size: int = 32  # examples per forward pass in one process
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # adamw; muon: Muon for the blocks' matrices, AdamW for the rest (mingpt.training.optimizer), ddp only; null: muon
    # for a modern model trained from scratch under ddp or auto, else adamw. A run resumes with the one it started with.
    optimizer: Optional[str] = None
    muon_lr: float = 0.02  # Muon's peak learning rate, on the same warm-up and decay as trainer.lr
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_weight_decay: float = 0.0  # Muon's decoupled weight decay (each step shrinks weights by lr * it)
    precision: str = "auto"  # auto (bf16 where the GPU or CPU computes it natively, else fp32), fp32, bf16, fp16
    compile: Optional[bool] = None  # torch.compile the model; null (auto): on GPUs only
    # Keep torch.compile's caches in snapshot.dir, so that a worker on a new machine starts warm (code: snapshots.md).
    compile_cache: bool = True
    # ddp (every process holds the whole state), fsdp (sharded over all), hsdp (sharded within a node,
    # replicated across nodes), auto (ddp while it fits comfortably); see mingpt.training.parallel.
    parallelism: str = "auto"
    eval_every: int = 100  # steps; 0 disables periodic evaluation
    eval_samples: int = 128  # validation examples per evaluation, shared among the processes
    # HellaSwag accuracy every this many steps and at the end; 0 disables it. Its data: HellaSwag's validation JSONL,
    # a path or a URL (fetched once into ~/.cache/mingpt/hellaswag, the public file checked against its sha256).
    hellaswag_every: int = 0
    hellaswag_data: str = PUBLIC_URL
    log_every: int = 10
    # Where metrics go, from jsonl (metrics.jsonl beside the snapshots), tensorboard, wandb (see mingpt.metrics).
    loggers: List[str] = field(default_factory=lambda: ["jsonl"])
    dist_timeout_s: int = 300  # a collective that waits longer fails, and torchrun restarts the workers
    # Under mingpt-torchrun, a worker that makes no progress this long is named, its stack logged, and the
    # workers restarted (mingpt.launch.watchdog); 0: 20 median steps, at least 20 s, once steps are timed.
    hang_timeout_s: float = 0.0


@dataclass
class SnapshotConfig:
    dir: str = "snapshots/run"  # local folder or fsspec URL (s3://bucket/prefix)
    every: int = 100  # steps; a snapshot is also written at the end and on SIGTERM/Ctrl-C
    keep: int = 3  # committed snapshots kept, newest first
    async_save: bool = True  # serialise and upload in the background while training goes on
    max_failures: int = 3  # consecutive failed saves after which the job stops
    # Another job may take the folder over once the writer's claim (renewed every lease_timeout_s / 4) is this old.
    lease_timeout_s: float = 60.0
    # The memory tier (mingpt.checkpoint.memory): a copy of the state in this node's shared memory, which a restart
    # resumes from when it is newer than the last snapshot. auto: on where /dev/shm has room for two copies; on; off.
    memory: str = "auto"
    memory_every: int = 0  # steps between copies; 0: as often as costs at most 3% of the step time
    memory_dir: str = "/dev/shm"  # where the tier lives: memory that outlives the workers, on this node only
    # Passed to fsspec, e.g. {client_kwargs: {endpoint_url: "http://minio:9000"}} for S3. Prefer the AWS credential
    # chain to keys here; these options are never logged or stored.
    storage_options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    seed: int = 1337

    def __post_init__(self) -> None:
        """trainer.optimizer's null, decided once: muon for a modern model trained from scratch under ddp or auto."""
        if self.trainer.optimizer is None:
            modern = self.model.init_from is None and architecture(self.model.name, self.model.arch) == "modern"
            self.trainer.optimizer = "muon" if modern and self.trainer.parallelism in ("auto", "ddp") else "adamw"

    def to_dict(self) -> dict:
        """The configuration as plain data, without storage options (they may hold credentials)."""
        data = asdict(self)
        data["snapshot"]["storage_options"] = sorted(self.snapshot.storage_options)  # keys only
        data["snapshot"]["dir"] = redact(self.snapshot.dir)
        corpus = self.data.corpus
        data["data"]["corpus"] = [redact(c) for c in corpus] if isinstance(corpus, (list, tuple)) else redact(corpus)
        return data


# Seeds go to torch.manual_seed and numpy's generators, and into JSON manifests: a non-negative int64.
MAX_SEED = 2**63 - 1

# The longest wait a timeout may set: torch's timedelta and the C++ clocks of its stores overflow past far less
# than int64 seconds, and no collective, hang or lease is worth more than a week.
LONGEST_WAIT_S = 7 * 24 * 3600

def from_hydra(raw: DictConfig) -> Config:
    """Hydra's `+key=value` adds keys the schema lacks, which would be silently ignored: each is an error here."""
    check_known(OmegaConf.to_container(raw, resolve=False))
    return OmegaConf.to_object(raw)


def check_known(data: dict) -> None:
    """ConfigError naming the first key of `data` that Config lacks, and the closest known one."""
    unknown = unknown_keys(data, Config)
    if unknown:
        key, close = unknown[0]
        hint = f" (did you mean {close}?)" if close else ""
        raise ConfigError(f"unknown setting {key}{hint}: `mingpt-train --cfg job` lists every setting")


def unknown_keys(data: dict, schema: type, prefix: str = "") -> list[tuple[str, str | None]]:
    """(dotted key, the closest known key or None) for every key of `data` that the dataclass `schema` lacks."""
    hints = get_type_hints(schema)
    known = {f.name for f in fields(schema)}
    found = []
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            found.append((f"{prefix}{key}", f"{prefix}{close[0]}" if close else None))
        elif is_dataclass(hints[key]) and isinstance(value, dict):
            found += unknown_keys(value, hints[key], f"{prefix}{key}.")
        elif isinstance(value, dict) and value and get_origin(hints[key]) not in (dict, Dict):  # trainer.lr.x
            found.append((f"{prefix}{key}.{next(iter(value))}", None))
    return found


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first key whose value is out of range."""
    t, d, m, s = cfg.trainer, cfg.data, cfg.model, cfg.snapshot
    for key, value in _settings(cfg, float):  # inf and nan pass many range checks (inf > 0)
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number; got {value!r}")
    checks = [
        ("seed", 0 <= cfg.seed <= MAX_SEED, f"an integer in [0, {MAX_SEED}] (2**63 - 1)"),
        ("model.name", m.name in PRESETS, f"one of {', '.join(PRESETS)}"),
        ("data.tokenizer", bool(d.tokenizer), "char, bpe or a tiktoken encoding name"),
        ("data.vocab_size", d.tokenizer != "bpe" or (d.vocab_size or 0) > 256,
         "an integer above 256 when data.tokenizer=bpe (e.g. 4096)"),
        ("data.corpus", _is_corpus(d.corpus), "a path, URL, glob or python-docs, or a list of them"),
        ("data.text_field", bool(d.text_field), "the name of the JSONL field holding the text"),
        ("data.bpe_sample_bytes", d.bpe_sample_bytes >= MIN_BPE_SAMPLE, f"at least {MIN_BPE_SAMPLE} (1 MB)"),
        ("data.num_workers", d.num_workers >= 0, ">= 0 (0: one per CPU core)"),
        ("data.windows", d.windows in ("random", "strided"), "random or strided"),
        ("data.block_size", d.block_size > 0, "a positive integer"),
        ("data.val_fraction", 0.0 < d.val_fraction < 1.0, "in (0, 1)"),
        ("trainer.max_steps", t.max_steps > 0, "a positive integer"),
        ("trainer.global_batch_size", t.global_batch_size > 0, "a positive integer"),
        ("trainer.micro_batch_size", t.micro_batch_size > 0, "a positive integer"),
        ("trainer.lr", t.lr > 0, "positive"),
        ("trainer.min_lr_ratio", 0.0 <= t.min_lr_ratio <= 1.0, "in [0, 1]"),
        ("trainer.warmup_steps", t.warmup_steps >= 0, ">= 0"),
        ("trainer.weight_decay", t.weight_decay >= 0, ">= 0"),
        ("trainer.beta1", 0.0 <= t.beta1 < 1.0, "in [0, 1)"),
        ("trainer.beta2", 0.0 <= t.beta2 < 1.0, "in [0, 1)"),
        ("trainer.grad_clip", t.grad_clip >= 0, ">= 0 (0 disables clipping)"),
        ("trainer.precision", t.precision in ("auto", "fp32", "bf16", "fp16"), "auto, fp32, bf16 or fp16"),
        ("trainer.parallelism", t.parallelism in ("auto", "ddp", "fsdp", "hsdp"), "auto, ddp, fsdp or hsdp"),
        ("trainer.eval_every", t.eval_every >= 0, ">= 0 (0 disables evaluation)"),
        ("trainer.eval_samples", t.eval_samples > 0, "a positive integer"),
        ("trainer.hellaswag_every", t.hellaswag_every >= 0, ">= 0 (0 disables it)"),
        ("trainer.hellaswag_data", bool(t.hellaswag_data), "a path or URL of HellaSwag's validation JSONL"),
        ("trainer.log_every", t.log_every > 0, "a positive integer"),
        ("trainer.dist_timeout_s", 0 < t.dist_timeout_s <= LONGEST_WAIT_S,
         f"a positive number of seconds, at most {LONGEST_WAIT_S} (a week)"),
        ("trainer.hang_timeout_s", t.hang_timeout_s == 0 or 5 <= t.hang_timeout_s < t.dist_timeout_s,
         f"0 (chosen from the step time) or at least 5 s and below trainer.dist_timeout_s={t.dist_timeout_s} (a "
         "collective that times out first restarts the workers without naming the hung one)"),
        ("snapshot.dir", bool(s.dir), "a folder path or URL"),
        ("snapshot.every", s.every > 0, "a positive number of steps"),
        ("snapshot.keep", s.keep >= 2, "at least 2, so that a damaged newest snapshot has a fallback"),
        ("snapshot.max_failures", s.max_failures >= 1, "a positive integer"),
        ("snapshot.lease_timeout_s", 1 <= s.lease_timeout_s <= LONGEST_WAIT_S,
         f"a number of seconds, at least 1 and at most {LONGEST_WAIT_S} (a week)"),
        ("snapshot.memory", s.memory in ("auto", "on", "off"), "auto, on or off"),
        ("snapshot.memory_every", s.memory_every >= 0, ">= 0 (0 chooses it)"),
        ("snapshot.memory_dir", os.path.isabs(s.memory_dir), "an absolute path of a local folder (/dev/shm)"),
    ] + _optimizer_checks(t)
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{key} must be {expected}; got {reduce(getattr, key.split('.'), cfg)!r}")
    for key, value in _settings(cfg, int):  # they reach torch and numpy as int64
        if abs(value) > MAX_SEED:
            raise ConfigError(f"{key} must be at most {MAX_SEED} (2**63 - 1); got {value}")
    check_loggers(t.loggers)  # known names, their packages installed
    # The model's own checks (sizes, dropout, n_embd divisible by n_head) on the resolved preset sizes.
    m.build(vocab_size=1, block_size=d.block_size)


def _optimizer_checks(t: TrainerConfig) -> list[tuple[str, bool, str]]:
    """(key, whether its value is good, what it must be) for trainer.optimizer and Muon's settings."""
    return [
        ("trainer.optimizer", t.optimizer in OPTIMIZERS, "adamw or muon"),
        ("trainer.muon_lr", t.muon_lr > 0, "positive"),
        ("trainer.muon_momentum", 0.0 <= t.muon_momentum < 1.0, "in [0, 1)"),
        ("trainer.muon_weight_decay", t.muon_weight_decay >= 0, ">= 0"),
        # Sharded, each process would orthogonalise its slice of a matrix: another update, varying with the world size.
        ("trainer.parallelism", t.optimizer != "muon" or t.parallelism in ("auto", "ddp"),
         "auto or ddp with trainer.optimizer=muon: Muon orthogonalises whole matrices, which fsdp and hsdp shard "
         "(use trainer.optimizer=adamw to shard the model)"),
    ]


def _settings(cfg: Config, kind: type) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every setting whose value is a `kind` (a bool is no int here)."""
    for section in fields(cfg):
        part = getattr(cfg, section.name)
        for key, value in ([(f.name, getattr(part, f.name)) for f in fields(part)] if is_dataclass(part) else
                           [("", part)]):
            if isinstance(value, kind) and not isinstance(value, bool):
                yield f"{section.name}.{key}".rstrip("."), value


def _is_corpus(corpus: Any) -> bool:
    sources = list(corpus) if isinstance(corpus, (list, tuple)) else [corpus]
    return bool(sources) and all(isinstance(source, str) and source for source in sources)
