"""GPT-2's recipe (model.arch=gpt2, AdamW) against today's (model.arch=modern, trainer.optimizer=muon), same run.

    python bench/bench_recipe.py                       # nanoGPT's CPU sizes, 2000 steps, A B A B (~10 min here)
    python bench/bench_recipe.py --steps 300 --rounds 1   # a quick look

Both train `train/main.py` with nanoGPT's CPU sizes (4 layers, 4 heads, width 128, context 64, batch 12) on the
same corpus, prepared once, with the project's defaults for everything else, one job at a time and interleaved
(gpt2, modern, gpt2, modern), so a change in the machine's load falls on both. Each evaluates every --eval-every
steps on the same validation examples.

Printed for each job: tokens/s (the median of its progress records, past the warm-up), its final validation loss,
and the step and the seconds from its start at which it first reached the final validation loss of the gpt2 job
of its round; then the ratios of the second recipe to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = "/work/shared/data/tinyshakespeare.txt"
SIZES = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "data.block_size=64",
         "trainer.global_batch_size=12", "trainer.micro_batch_size=12"]
RECIPES = {"gpt2 + AdamW": ["model.arch=gpt2", "trainer.optimizer=adamw"],
           "modern + Muon": ["model.arch=modern", "trainer.optimizer=muon"]}


def train(name: str, recipe: list[str], args: argparse.Namespace, workdir: Path) -> tuple[float, list[dict]]:
    """Run one job; its start time and its metrics records."""
    snap = workdir / name
    cmd = [sys.executable, str(REPO / "train" / "main.py"), *SIZES, *recipe, f"data.corpus={args.corpus}",
           f"data.prepared_dir={workdir / 'prepared'}", f"snapshot.dir={snap}", f"trainer.max_steps={args.steps}",
           f"trainer.eval_every={args.eval_every}"]
    start = time.time()
    with open(workdir / f"{name}.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"{name} failed: see {workdir / name}.log")
    return start, [json.loads(line) for line in (snap / "metrics.jsonl").read_text().splitlines()]


def rate(records: list[dict], steps: int) -> float:
    """Median tokens/s of the progress records past the first fifth of the steps (warm-up, first evaluations)."""
    return statistics.median(r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > steps // 5)


def reached(records: list[dict], start: float, target: float) -> tuple[int, float] | None:
    """(step, seconds from the job's start) of its first validation loss at or below `target`."""
    for r in records:
        if "val_loss" in r and r["val_loss"] <= target:
            return r["step"], r["time"] - start
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=DEFAULT_CORPUS)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-recipe-") as scratch:
        workdir = Path(scratch)
        ratios = []
        for round_ in range(1, args.rounds + 1):
            jobs = {name: train(f"{name.split()[0]}-{round_}", recipe, args, workdir)
                    for name, recipe in RECIPES.items()}
            (base_start, base), (new_start, new) = jobs.values()
            target = [r["val_loss"] for r in base if "val_loss" in r][-1]
            print(f"round {round_}: the gpt2 + AdamW job's final validation loss {target:.4f}")
            for name, (start, records) in jobs.items():
                hit = reached(records, start, target)
                final = [r["val_loss"] for r in records if "val_loss" in r][-1]
                when = f"step {hit[0]}, {hit[1]:.1f} s" if hit else "never"
                print(f"  {name:14s} {rate(records, args.steps):8.0f} tokens/s | final val {final:.4f} | "
                      f"reached {target:.4f} at {when} (of {records[-1]['time'] - start:.1f} s)")
            hit_base, hit_new = reached(base, base_start, target), reached(new, new_start, target)
            if hit_new:
                ratios.append((rate(new, args.steps) / rate(base, args.steps), hit_new[1] / hit_base[1]))
        for speed, time_ratio in ratios:
            print(f"modern + Muon / gpt2 + AdamW: tokens/s {speed:.2f}x, time to gpt2's final loss {time_ratio:.2f}x")


if __name__ == "__main__":
    main()
