"""Precision and torch.compile at each preset: training-step tokens/s, compile time, and (for one
preset) the validation loss that bf16 autocast reaches against fp32.

    python bench/bench_precision.py                                  # the step table (~5 min on 2 cores)
    python bench/bench_precision.py --presets gpt-mini --val-steps 300   # and the loss check (~8 min)

Step table: for each preset, the model's training step (forward, backward, clipping, fused AdamW)
on random token ids, in fp32 and under bf16 autocast, eager and torch.compile'd. Each variant runs in
a fresh process (compiled code and allocator state do not carry over), interleaved by preset, and
reports the median of --steps timed steps after warm-up. "compile s" is the first steps' time over
the eager ones': what compiling costs a job once (less where inductor's cache already holds the graph).

Loss check (--val-steps N): `train/main.py` on the built-in corpus with the preset at block 256,
batch 32, N steps, once in fp32 and once in bf16; the final validation loss of each.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
VOCAB = 104  # the built-in corpus's character vocabulary
# batch and block per preset: the default job's shape for the small ones, a CPU-sized one for the larger
SHAPES = {"gpt-nano": (32, 128), "gpt-micro": (32, 128), "gpt-mini": (32, 256), "gopher-44m": (8, 256),
          "gpt2": (4, 256)}


def step_rate(preset: str, batch: int, block: int, precision: str, compile: bool, steps: int) -> dict:
    """Run in a child process: {"tokens_per_s": ..., "first_steps_s": ...}."""
    from mingpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(preset, vocab_size=VOCAB, block_size=block))
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, fused=True)
    x, y = torch.randint(0, VOCAB, (batch, block)), torch.randint(0, VOCAB, (batch, block))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    if compile:
        model.compile()

    def step() -> float:
        started = time.perf_counter()
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    first = sum(step() for _ in range(3))
    times = sorted(step() for _ in range(steps))
    return {"tokens_per_s": batch * block / times[len(times) // 2], "first_steps_s": first}


def measure(preset: str, precision: str, compile: bool, steps: int) -> dict:
    batch, block = SHAPES[preset]
    code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'bench')!r}); from bench_precision import step_rate; "
            f"print(json.dumps(step_rate({preset!r}, {batch}, {block}, {precision!r}, {compile}, {steps})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_table(presets: list[str], steps: int) -> None:
    print("| preset | batch x block | fp32 | bf16 | fp32 compiled | bf16 compiled | bf16 / fp32 | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset in presets:
        rates = {(p, c): measure(preset, p, c, steps) for c in (False, True) for p in ("fp32", "bf16")}
        tps = {key: r["tokens_per_s"] for key, r in rates.items()}
        compile_s = rates[("bf16", True)]["first_steps_s"] - rates[("bf16", False)]["first_steps_s"]
        batch, block = SHAPES[preset]
        print(f"| {preset} | {batch} x {block} | {tps['fp32', False]:,.0f} | {tps['bf16', False]:,.0f} | "
              f"{tps['fp32', True]:,.0f} | {tps['bf16', True]:,.0f} | "
              f"{tps['bf16', False] / tps['fp32', False]:.2f}x | {compile_s:.0f} |", flush=True)


def val_loss(preset: str, precision: str, steps: int, workdir: Path) -> tuple[float, float]:
    cmd = [sys.executable, str(REPO / "train" / "main.py"), f"model={preset}", "model.arch=gpt2",
           "trainer.optimizer=adamw", "data.block_size=256",
           f"trainer.max_steps={steps}", f"trainer.precision={precision}", f"snapshot.dir={workdir / precision}",
           f"data.prepared_dir={workdir / 'data'}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=True)
    found = re.findall(r"done: step \d+, train loss [\d.]+, val loss ([\d.]+)", done.stderr)
    return float(found[-1]), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gpt-nano", "gpt-micro", "gpt-mini", "gopher-44m"],
                        choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--val-steps", type=int, default=0, help="also train the first preset this long in both")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    step_table(args.presets, args.steps)
    if args.val_steps:
        with tempfile.TemporaryDirectory(prefix="bench-precision-") as tmp:
            preset = args.presets[0]
            results = {p: val_loss(preset, p, args.val_steps, Path(tmp)) for p in ("fp32", "bf16")}
        print(f"\n{preset}, block 256, batch 32, {args.val_steps} steps of train/main.py:")
        for precision, (loss, wall) in results.items():
            print(f"  {precision}: val loss {loss:.4f}, {wall:.0f} s")
        print(f"  bf16 - fp32: {results['bf16'][0] - results['fp32'][0]:+.4f}; "
              f"bf16 {results['fp32'][1] / results['bf16'][1]:.2f}x sooner")


if __name__ == "__main__":
    main()
