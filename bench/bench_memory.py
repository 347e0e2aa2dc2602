"""What the memory tier costs: training tokens/s with snapshot.memory=on against off, side by side.

    python bench/bench_memory.py                         # gpt-mini, 2 rounds of 60 steps each way (~4 min)
    python bench/bench_memory.py --model gpt-micro --steps 100 --rounds 3 --every 1

Each job is `python train/main.py` on the built-in corpus, one process, the rounds interleaved (off,
on, off, on, ...) so that the machine's load falls on both alike. Printed per side: the median of the
jobs' median tokens/s (metrics.jsonl, the first 10 steps left out), and for `on` what the trainer
logged of the tier (copy time, step time, the interval it chose). The ratio to read is on / off.
--every 1 forces a copy after every step (snapshot.memory_every=1) instead of the interval chosen
to keep the tier under 3% of the step time.
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

REPO = Path(__file__).resolve().parents[1]


def job(workdir: Path, model: str, steps: int, memory: str, every: int) -> tuple[float, str]:
    """Median tokens/s of one job, and its memory-tier log line."""
    snap = workdir / f"snap-{memory}"
    result = subprocess.run(
        [sys.executable, str(REPO / "train" / "main.py"), f"model={model}", f"trainer.max_steps={steps}",
         "trainer.log_every=1", "trainer.eval_every=0", f"snapshot.every={steps}", f"snapshot.dir={snap}",
         f"data.prepared_dir={workdir / 'data'}", f"snapshot.memory={memory}", f"snapshot.memory_every={every}"],
        cwd=workdir, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the job failed:\n{result.stderr[-3000:]}")
    rates = [json.loads(line)["tokens_per_s"] for line in (snap / "metrics.jsonl").read_text().splitlines()
             if '"tokens_per_s"' in line][10:]
    tier = re.search(r"memory tier: .*", result.stderr)
    return statistics.median(rates), tier[0] if tier else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--every", type=int, default=0, help="snapshot.memory_every (0: chosen by the trainer)")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    notes = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for _ in range(args.rounds):
            for memory in ("off", "on"):
                workdir = Path(tmp) / f"{memory}-{len(rates[memory])}"
                workdir.mkdir()
                rate, note = job(workdir, args.model, args.steps, memory, args.every)
                rates[memory].append(rate)
                if note:
                    notes.append(note)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"{args.model}, {args.steps} steps, {args.rounds} rounds, snapshot.memory_every={args.every}")
    print(f"  memory off: {off:,.0f} tokens/s   (rounds: {', '.join(f'{r:,.0f}' for r in rates['off'])})")
    print(f"  memory on:  {on:,.0f} tokens/s   (rounds: {', '.join(f'{r:,.0f}' for r in rates['on'])})")
    print(f"  on / off: {on / off:.3f}")
    for note in notes:
        print(f"  {note}")


if __name__ == "__main__":
    main()
