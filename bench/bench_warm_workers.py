"""Warm workers: what restarts cost with workers forked from mingpt-torchrun's server (mingpt.launch.forkserver),
against workers started as new Pythons (MINGPT_WARM_WORKERS=0), on the same job in the same run.

    python bench/bench_warm_workers.py                        # 2 workers, 3 kills, 2 rounds of each (~3 min)
    python bench/bench_warm_workers.py --workers 4 --kills 5 --rounds 3

Each round runs one `mingpt-torchrun --standalone --nproc-per-node=N --max-restarts=K` job of gpt-nano on the
default corpus (prepared once, before the rounds) to step 10 * (K + 1), SIGKILLing a worker after every 10 steps
it trains. The modes alternate. Printed per mode: the median time from a kill to the first step trained after
it (the restart), the job's CPU (user + system, every process of it) and wall time, and their ratios, warm over
cold.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs import records, stop_all, wait_until, workers

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
JOB = ["model=gpt-nano", "model.arch=gpt2", "trainer.optimizer=adamw",
       "data.block_size=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
       "trainer.eval_every=0", "trainer.log_every=1", "trainer.precision=fp32", "snapshot.every=5",
       "snapshot.memory=on", "snapshot.memory_every=1"]


def one_job(snap: Path, prepared: Path, n_workers: int, kills: int, warm: bool) -> tuple[list[float], float, float]:
    """(the seconds from each kill to the next step, the job's CPU seconds, its wall seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINGPT_WARM_WORKERS": "1" if warm else "0"}
    steps = 10 * (kills + 1)
    command = [str(BIN / "mingpt-torchrun"), "--standalone", f"--nproc-per-node={n_workers}",
               f"--max-restarts={kills}", str(REPO / "train" / "main.py"), *JOB, f"trainer.max_steps={steps}",
               f"snapshot.dir={snap}", f"data.prepared_dir={prepared}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    log = open(f"{snap}.log", "w")
    job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    restarts = []
    try:
        for kill in range(1, kills + 1):
            step = lambda: max((r["step"] for r in records(snap / "metrics.jsonl")), default=0)
            wait_until(lambda: step() >= 10 * kill and workers(job.pid), 300, f"step {10 * kill}", [job])
            reached = step()
            os.kill(workers(job.pid)[-1], signal.SIGKILL)
            killed_at = time.monotonic()
            # The survivors may log the step they were in (their rescue snapshot's); the one after is the restart's.
            wait_until(lambda: step() > reached + 1, 300, "a step after the restart", [job])
            restarts.append(time.monotonic() - killed_at)
        if job.wait(timeout=600) != 0:
            raise SystemExit(f"the {snap.name} job failed")
    except SystemExit:
        print(Path(log.name).read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        stop_all([job])
        log.close()
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return restarts, cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        folder, prepared = Path(tmp), Path(tmp) / "prepared"
        subprocess.run([str(BIN / "mingpt-prepare"), "--out", str(prepared)], check=True, capture_output=True)
        results = {True: ([], [], []), False: ([], [], [])}
        for round in range(args.rounds):
            for warm in (True, False):
                snap = folder / f"{'warm' if warm else 'cold'}-{round}"
                restarts, cpu, wall = one_job(snap, prepared, args.workers, args.kills, warm)
                results[warm][0].extend(restarts)
                results[warm][1].append(cpu)
                results[warm][2].append(wall)
                print(f"{'warm' if warm else 'cold'}: restarts {' '.join(f'{s:.1f}' for s in restarts)} s, "
                      f"job CPU {cpu:.1f} s, wall {wall:.1f} s", flush=True)
    median = {warm: [statistics.median(values) for values in results[warm]] for warm in results}
    print(f"\n{args.workers} workers, {args.kills} kills a job, {args.rounds} jobs a mode (medians):")
    for name, index in (("restart (kill to next step)", 0), ("job CPU", 1), ("job wall", 2)):
        print(f"  {name}: warm {median[True][index]:.1f} s, cold {median[False][index]:.1f} s, "
              f"warm/cold {median[True][index] / median[False][index]:.2f}")


if __name__ == "__main__":
    main()
