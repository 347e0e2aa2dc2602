"""The learning-rate schedule: linear warm-up, then cosine decay."""

from __future__ import annotations

import math

import torch

from mingpt.training.config import TrainerConfig
from mingpt.training.optimizer import MuonAdamW, is_muon


def lr_at(t: TrainerConfig, step: int) -> float:
    """Linear warm-up to trainer.lr, then cosine decay to lr * min_lr_ratio at max_steps."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer: torch.optim.Optimizer | MuonAdamW, t: TrainerConfig, step: int) -> None:
    """Every group at lr_at's rate; Muon's groups at trainer.muon_lr on the same warm-up and decay."""
    lr = lr_at(t, step)
    for group in optimizer.param_groups:
        group["lr"] = lr * t.muon_lr / t.lr if is_muon(group) else lr
