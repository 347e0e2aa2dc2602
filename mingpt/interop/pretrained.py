"""`model.init_from`: start a new run from the weights of a Hugging Face GPT-2 folder (mingpt.interop.hf) or a
mingpt snapshot or run folder. Either gives the model's shape and a default tokenizer. Only the weights are taken
(the optimizer starts at step 0); once the run has a snapshot, restarts resume from it and never read init_from again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from mingpt.checkpoint.load import open_snapshot, read_weights
from mingpt.checkpoint.store import SnapshotError
from mingpt.errors import ConfigError
from mingpt.interop import hf
from mingpt.model import GPT, GPTConfig


@dataclass
class Pretrained:
    url: str
    config: GPTConfig  # the shape of the weights, at this run's block_size
    tokenizer: str  # a folder holding their tokenizer, for data.tokenizer
    load: Callable[[], dict[str, torch.Tensor]]  # the state dict, position table cropped to block_size

    def describe(self) -> str:
        c = self.config
        return f"{c.n_layer} layers, {c.n_head} heads, {c.n_embd} wide, vocab {c.vocab_size}, bias {c.bias}"


def open_pretrained(url: str, block_size: int) -> Pretrained:
    """What `model.init_from=url` names, checked before any data work; the weights are read by `load`."""
    if hf.is_hf_model(url):
        config = hf.hf_model_config(url, block_size)
        return Pretrained(url, config, url, lambda: _fit(url, hf.load_hf_weights(url, config), config))
    try:
        snapshot = open_snapshot(url)
    except (SnapshotError, OSError):
        raise ConfigError(f"model.init_from={url} is neither a Hugging Face GPT-2 folder (no config.json there) "
                          "nor a mingpt snapshot or run folder") from None
    saved = GPTConfig(**snapshot.manifest["model_config"])
    if block_size > saved.block_size:
        raise ConfigError(f"data.block_size={block_size} exceeds the block_size {saved.block_size} of "
                          f"model.init_from={url}; use a block_size up to {saved.block_size}")
    config = replace(saved, block_size=block_size)
    return Pretrained(snapshot.url, config, snapshot.url, lambda: _fit(url, read_weights(snapshot), config))


def _fit(url: str, state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """`state`, position table cropped to `config.block_size`, once it fits `config` (else one line, not a dump)."""
    if "wpe.weight" in state:
        state["wpe.weight"] = state["wpe.weight"][: config.block_size]
    with torch.device("meta"):  # the names and shapes alone, no memory
        expected = {name: tuple(t.shape) for name, t in GPT(config).state_dict().items()}
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    misshapen = [f"{name} {tuple(state[name].shape)}, not {shape}" for name, shape in expected.items()
                 if name in state and tuple(state[name].shape) != shape]
    problems = [f"{what} {_some(names)}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)) if names]
    if problems:
        c = config
        raise ConfigError(f"model.init_from={url}: the weights do not fit its config ({c.n_layer} layers, "
                          f"{c.n_head} heads, {c.n_embd} wide, vocab {c.vocab_size}): {'; '.join(problems)}; "
                          "give a folder whose config and weights belong together")
    return state


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
