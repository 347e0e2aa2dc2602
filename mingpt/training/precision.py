"""The precision a job trains in (`trainer.precision`) and whether it compiles (`trainer.compile`)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from mingpt.errors import ConfigError
from mingpt.training.performance import cpu_flags

# Below this width bf16 autocast costs more in casts than its matmuls save on a CPU (docs/benchmarks.md).
MIN_BF16_CPU_WIDTH = 128


def choose_precision(requested: str, device: torch.device, n_embd: int) -> tuple[str, str]:
    """The precision to train in and why. `auto` takes bf16 autocast only where the hardware computes it natively
    (emulated, it is slower than fp32); weights and optimizer state stay fp32 either way."""
    if requested != "auto":
        return requested, "as configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return "bf16", f"auto: {name} computes in bf16"
        return "fp32", f"auto: {name} has no bf16"
    native = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in cpu_flags()]
    if not native:
        return "fp32", "auto: this CPU has neither amx_bf16 nor avx512_bf16, and emulated bf16 runs slower than fp32"
    if n_embd < MIN_BF16_CPU_WIDTH:
        return "fp32", f"auto: a model {n_embd} wide, under {MIN_BF16_CPU_WIDTH}, trains faster in fp32 on CPUs"
    return "bf16", "auto: this CPU computes bf16 natively with " + " and ".join(native)


def choose_compile(requested: bool | None, device: torch.device) -> tuple[bool, str]:
    """Whether to torch.compile the model, and why: `auto` on GPUs only (on CPUs it is no faster, and slows starts)."""
    if requested is not None:
        return requested, "as configured"
    if device.type == "cuda":
        return True, "auto: on GPUs"
    return False, "auto: not on CPUs, where it was measured no faster"


def autocast_for(precision: str, device: torch.device):
    """The autocast context of 'fp32', 'bf16' or 'fp16' and, for fp16 only, a GradScaler."""
    if precision == "fp32":
        return nullcontext(), None
    if precision == "fp16":
        if device.type != "cuda":
            raise ConfigError("trainer.precision=fp16 needs a GPU; use fp32 or bf16 on CPUs")
        return torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler("cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16), None


def compute_dtype(autocast) -> torch.dtype:
    """The dtype matmuls run in under `autocast` (an autocast context, or a null one for fp32)."""
    return autocast.fast_dtype if isinstance(autocast, torch.autocast) else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
