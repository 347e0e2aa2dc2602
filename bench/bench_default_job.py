"""The default job (`python train/main.py`, no overrides) at this checkout against an earlier commit.

    python bench/bench_default_job.py --baseline e78a01d             # 1 round each (~5 min)
    python bench/bench_default_job.py --baseline e78a01d --rounds 2

The baseline commit is checked out with `git worktree` into a scratch folder; both sides run the
default job there and here, one at a time and interleaved (baseline, this, baseline, ...), each
with its own scratch snapshot and prepared-data folders, so a change in the machine's load falls on
both alike. Printed per job: wall seconds from start to exit, and the validation loss the trainer
reports at the end (its own estimate on 128 held-out windows, the same code on both sides since
e78a01d). The ratio to read is the baseline's median wall time over this checkout's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_job(checkout: Path, workdir: Path) -> tuple[float, float]:
    """Wall seconds and final validation loss of the default job run from `checkout`."""
    cmd = [sys.executable, str(checkout / "train" / "main.py"),
           f"snapshot.dir={workdir / 'snap'}", f"data.prepared_dir={workdir / 'data'}"]
    # PYTHONPATH: the checkout's own mingpt package, not the one installed (editable) from this repository
    environment = {**os.environ, "PYTHONPATH": str(checkout)}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, env=environment, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    found = re.findall(r"done: step \d+, train loss [\d.]+, val loss ([\d.]+)", done.stdout + done.stderr)
    return wall, float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a commit of this repository")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-default-") as tmp:
        scratch = Path(tmp)
        baseline = scratch / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), args.baseline],
                       check=True, capture_output=True)
        try:
            results: dict[str, list[tuple[float, float]]] = {"baseline": [], "this checkout": []}
            for r in range(args.rounds):
                for side, checkout in (("baseline", baseline), ("this checkout", REPO)):
                    workdir = scratch / f"{side.replace(' ', '-')}-{r}"
                    workdir.mkdir()
                    wall, val = default_job(checkout, workdir)
                    results[side].append((wall, val))
                    print(f"round {r + 1} {side:<13}  wall {wall:6.1f} s  val loss {val:.4f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
    walls = {side: statistics.median(w for w, _ in jobs) for side, jobs in results.items()}
    vals = {side: statistics.mean(v for _, v in jobs) for side, jobs in results.items()}
    print("\n| | wall (median) | val loss (mean) |\n| --- | --- | --- |")
    for side in results:
        name = f"{side} ({args.baseline})" if side == "baseline" else side
        print(f"| {name} | {walls[side]:.1f} s | {vals[side]:.4f} |")
    print(f"\nthis checkout finishes the default job {walls['baseline'] / walls['this checkout']:.2f}x sooner")


if __name__ == "__main__":
    main()
