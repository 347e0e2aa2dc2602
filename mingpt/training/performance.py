"""How fast training runs against what the hardware can do: throughput, model FLOPs, MFU, memory. MFU = model FLOPs
per token x tokens per second / peak FLOP/s, the FLOPs counted as in the PaLM paper and nanoGPT; the peak comes from
NVIDIA's data sheets for known GPUs, else from a matmul probe in the training precision."""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from contextlib import contextmanager
from typing import Iterator
from pathlib import Path

import torch
from fsspec.implementations.local import LocalFileSystem

from mingpt.model import GPTConfig
from mingpt.storage import parse_json, replace_atomically

# Dense tensor-core TFLOP/s for bf16 and fp16, by a fragment of the device's name; the first match wins.
GPU_PEAK_TFLOPS = [
    ("H100 PCIe", 756), ("H100", 989), ("H200", 989), ("GH200", 989), ("B200", 2250),
    ("A100", 312), ("L40S", 362), ("L4", 121), ("A10", 125),
]


def flops_per_token(config: GPTConfig, params: int) -> int:
    """Training FLOPs per token: 6 per parameter, plus 12 x layers x width x sequence length for attention."""
    return 6 * params + 12 * config.n_layer * config.n_embd * config.block_size


def mfu(flops_per_token: int, tokens_per_s: float, peak_flops: float) -> float:
    """The share of `peak_flops` that `tokens_per_s` puts to model use."""
    return flops_per_token * tokens_per_s / peak_flops


def cpu_flags() -> set[str]:
    """The feature flags of this CPU (empty where unknown)."""
    return set(cpuinfo("flags").split())


def cpuinfo(field: str) -> str:
    """The first value of `field` in Linux's /proc/cpuinfo ("" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def peak_flops(device: torch.device, dtype: torch.dtype, measure: bool = False) -> tuple[float, str]:
    """Peak FLOP/s of one process on `device` in `dtype`, and where the figure comes from. `measure` probes again
    even where a figure is cached (a probe on a busy machine reads low); the cache keeps the highest."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for fragment, tflops in GPU_PEAK_TFLOPS:
            if fragment in name:
                return tflops * 1e12, f"{name}'s data sheet, dense {str(dtype).replace('torch.', '')}"
    key = f"{_device_name(device)} | {str(dtype).replace('torch.', '')} | {torch.get_num_threads()} threads | " \
          f"torch {torch.__version__}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mingpt" / "peak_flops.json"
    try:
        cached = parse_json(cache.read_text())
    except (OSError, ValueError):
        cached = {}
    cached = cached if isinstance(cached, dict) else {}
    known = cached.get(key) if isinstance(cached.get(key), (int, float)) else 0.0
    if known and not measure:
        return float(known), f"a matmul probe on {key}, cached in {cache}"
    measured = max(_probe(device, dtype), known)
    _remember(cache, {**cached, key: measured})
    return measured, f"a matmul probe on {key}, measured now"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpuinfo("model name") or platform.processor() or platform.machine()


def _probe(device: torch.device, dtype: torch.dtype, bursts: int = 5, seconds: float = 0.06, n: int = 1024) -> float:
    """FLOP/s of n x n matmuls: the best of several bursts, so that a moment of load elsewhere does not lower it."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):  # warm-up: kernels chosen, caches filled
        a @ b
    _sync(device)
    best = 0.0
    for _ in range(bursts):
        repeats, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            a @ b
            repeats += 1
            _sync(device)
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - started))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _remember(cache: Path, entries: dict) -> None:
    """A cache that cannot be written only means probing again next time."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(LocalFileSystem(), str(cache), json.dumps(entries, indent=1).encode())
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has used: allocated CUDA memory on a GPU, resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Throughput:
    """Tokens per second and seconds per step since the last reading; time spent `excluding()` is left out."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.started, self.steps, self.excluded = time.perf_counter(), 0, 0.0

    def step(self) -> None:
        self.steps += 1

    @contextmanager
    def excluding(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - started

    def read(self) -> tuple[float, float, float]:
        """(tokens/s, seconds/step, seconds left out); starts the next window."""
        excluded = self.excluded
        elapsed = max(1e-9, time.perf_counter() - self.started - excluded)
        rate = self.steps * self.tokens_per_step / elapsed
        seconds_per_step = elapsed / max(1, self.steps)
        self.started, self.steps, self.excluded = time.perf_counter(), 0, 0.0
        return rate, seconds_per_step, excluded
