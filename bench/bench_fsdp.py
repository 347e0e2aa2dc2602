"""What sharding buys: peak memory per worker and tokens/s of trainer.parallelism=fsdp against ddp.

    python bench/bench_fsdp.py                    # the three comparisons below (~10 min on 2 cores)
    python bench/bench_fsdp.py --only speed       # one of: gpt2, medium, speed

Every job is `mingpt-torchrun --standalone --nproc-per-node=N train/main.py` on the built-in corpus
(char-level, so the embedding is small: the parameter counts are printed), fp32, no snapshots.
1. gpt2: ddp and fsdp at 2 workers, 3 steps of AdamW (its state exists from the first step).
2. medium: gpt2-medium, fsdp at 4 workers, against ddp at 1 process: a DDP worker holds the whole
   state whatever the world size (4 of them would need 4 x 5.6 GB here), so one process is its figure.
3. speed: gpt-mini at 2 workers, 40 steps each way, twice, interleaved; median tokens/s.

Memory is the progress line's figure, `peak_memory_mb` (the leader's peak RSS on a CPU, allocated
memory on a GPU), and the summed PSS of the whole job (bench/pss.py) divided by its workers, which
counts the libraries that RSS repeats in every process once; it is sampled over the whole job, the
copy of the final snapshot included. The ratios to read are fsdp / ddp.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pss import run_measured

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "mingpt-torchrun")


def job(work: Path, name: str, nproc: int, mode: str, model: str, steps: int, block: int, batch: int) -> dict:
    """One job; its peak memory (leader's, and PSS per worker), median tokens/s and parameter count."""
    snap = work / name
    overrides = [f"model={model}", "model.arch=gpt2", "trainer.optimizer=adamw",
                 f"trainer.parallelism={mode}", f"trainer.max_steps={steps}",
                 f"data.block_size={block}", f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={batch}",
                 "trainer.precision=fp32", "trainer.compile=false", "trainer.log_every=1", "trainer.eval_every=0",
                 "trainer.eval_samples=8", f"snapshot.every={10 * steps}", f"snapshot.dir={snap}",
                 f"data.prepared_dir={work / 'data'}", "snapshot.memory=off"]
    launcher = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    log = work / f"{name}.log"
    with open(log, "w") as out:
        rc, _, pss = run_measured([*launcher, str(REPO / "train" / "main.py"), *overrides], cwd=work, stdout=out,
                                  stderr=subprocess.STDOUT)
    text = log.read_text()
    if rc != 0:
        raise SystemExit(f"{name} failed:\n{text[-3000:]}")
    rows = [json.loads(line) for line in (snap / "metrics.jsonl").read_text().splitlines() if "tokens_per_s" in line]
    params = re.search(r"training \S+ \(([\d.]+M) parameters\)", text)[1]
    return {"peak_mb": max(r["peak_memory_mb"] for r in rows), "pss_mb": pss / 1e6 / nproc,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[2:] or rows), "params": params}


def memory_row(label: str, ddp: dict, fsdp: dict) -> str:
    return (f"| {label} ({fsdp['params']} parameters) | {ddp['peak_mb']:,.0f} MB | {fsdp['peak_mb']:,.0f} MB | "
            f"{fsdp['peak_mb'] / ddp['peak_mb']:.2f}x | {ddp['pss_mb']:,.0f} MB | {fsdp['pss_mb']:,.0f} MB | "
            f"{fsdp['pss_mb'] / ddp['pss_mb']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["gpt2", "medium", "speed"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        work = Path(tmp)
        if args.only in (None, "gpt2"):
            ddp = job(work, "gpt2-ddp", 2, "ddp", "gpt2", 3, 64, 4)
            fsdp = job(work, "gpt2-fsdp", 2, "fsdp", "gpt2", 3, 64, 4)
            rows.append(memory_row("gpt2, 2 workers", ddp, fsdp))
        if args.only in (None, "medium"):
            ddp = job(work, "medium-ddp", 1, "ddp", "gpt2-medium", 3, 64, 4)
            fsdp = job(work, "medium-fsdp", 4, "fsdp", "gpt2-medium", 3, 64, 4)
            rows.append(memory_row("gpt2-medium, 4 fsdp workers against 1 ddp process", ddp, fsdp))
        speed = {"ddp": [], "fsdp": []}
        if args.only in (None, "speed"):
            for i in range(2):
                for mode in ("ddp", "fsdp"):
                    result = job(work, f"mini-{mode}-{i}", 2, mode, "gpt-mini", 40, 128, 16)
                    speed[mode].append(result["tokens_per_s"])
    if rows:
        print("| job | ddp peak (progress line) | fsdp peak | fsdp / ddp | ddp PSS per worker | fsdp PSS per worker "
              "| fsdp / ddp |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(rows))
    if speed["ddp"]:
        ddp, fsdp = statistics.median(speed["ddp"]), statistics.median(speed["fsdp"])
        print(f"\ngpt-mini, 2 workers, block 128, 16 examples/step: ddp {ddp:,.0f} tokens/s, fsdp {fsdp:,.0f} "
              f"tokens/s, fsdp / ddp {fsdp / ddp:.2f}x (rounds: ddp {_rates(speed['ddp'])}; fsdp {_rates(speed['fsdp'])})")


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{rate:,.0f}" for rate in rates)


if __name__ == "__main__":
    main()
