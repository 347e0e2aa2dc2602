"""`model.init_from`: start a new run from existing weights instead of random ones.

The weights come from a Hugging Face GPT-2 folder (see mingpt.interop.hf) or from a mingpt snapshot (a
snapshot folder, or a run folder: its newest snapshot). Either gives the model's shape, overriding
the preset, and a tokenizer that `data.tokenizer` uses when left at its default. Only the weights
are taken: the optimizer starts fresh at step 0, in the run's own snapshot.dir. Once that run has
a snapshot of its own, every restart resumes from it and never reads init_from again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from mingpt.checkpoint.load import open_snapshot
from mingpt.checkpoint.store import SnapshotError
from mingpt.errors import ConfigError
from mingpt.interop import hf
from mingpt.model import GPTConfig


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
        return Pretrained(url, config, url, lambda: hf.load_hf_weights(url, config))
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

    def load() -> dict[str, torch.Tensor]:
        state = snapshot.load_tensors("model.pt")
        state["wpe.weight"] = state["wpe.weight"][:block_size]
        return state

    return Pretrained(snapshot.url, config, snapshot.url, load)
