"""A node joins a compiled job with an empty local cache: how soon does it take its first step?

    python bench/bench_compile_cache.py               # 2 nodes + a joiner, each case once (about 6 min on 2 cores)
    python bench/bench_compile_cache.py --nodes 1 --repeats 3

Each case starts a job of `--nodes` nodes (mingpt-torchrun, one worker each, under mingpt-rendezvous,
gpt-nano on CPU with Inductor), lets it train 10 steps, then starts one more node and measures that node's
start to the first step of all of them (the joiner's start includes its torch import, its data check, the
rendezvous, the others' restart and every compile). The cases, in the same run:
- compile off: `trainer.compile=false` everywhere (the floor);
- cold: compile on, the joiner's own Inductor cache empty, no caches in the run (`trainer.compile_cache=false`):
  a new machine as it was before the run carried its caches;
- run caches: compile on, the joiner's own Inductor cache empty, the run's caches loaded (the default);
- warm local: compile on, the joiner's own Inductor cache already holds this model (a machine that compiled it
  before), no caches in the run.
The running nodes always start from a warm local cache. Printed: seconds per case (median over `--repeats`),
and the issue's targets: run caches / warm local (<= 1.5) and run caches - compile off (<= 5 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs import free_port, records, stop_all, wait_until

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MAIN = str(REPO / "train" / "main.py")
# Micro-batches of 4 at every world size (24 examples over 2 or 3 processes): the compiled shapes stay the same.
MODEL = ["model=gpt-nano", "model.arch=gpt2", "trainer.optimizer=adamw",
         "data.block_size=32", "trainer.global_batch_size=24", "trainer.micro_batch_size=4",
         "trainer.log_every=1", "trainer.eval_every=0", "trainer.precision=fp32", "trainer.dist_timeout_s=60",
         "snapshot.every=1000", "trainer.max_steps=100000000"]
CASES = {  # name: (trainer.compile, trainer.compile_cache, the joiner's local cache warm)
    "compile off": (False, False, False),
    "cold": (True, False, False),
    "run caches": (True, True, False),
    "warm local": (True, False, True),
}


def environment(cache: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(cache)}


def warm_up(work: Path) -> Path:
    """An Inductor cache that holds this model's compiled code, and the prepared data."""
    cache = work / "warm-cache"
    subprocess.run([sys.executable, MAIN, *MODEL, "trainer.compile=true", "trainer.compile_cache=false",
                    "trainer.max_steps=2", f"snapshot.dir={work / 'warm-up'}", f"data.prepared_dir={work / 'prepared'}"],
                   cwd=work, env=environment(cache), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=True)
    return cache


def join(work: Path, nodes: int, warm: Path, case: str) -> float:
    """Seconds from the joiner's start to the first step of all nodes."""
    compile_on, carried, joiner_warm = CASES[case]
    port = free_port()
    rendezvous = subprocess.Popen([str(BIN / "mingpt-rendezvous"), f"--port={port}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True, env=environment(warm))
    node = [str(BIN / "mingpt-torchrun"), "--no-live", f"--nnodes=1:{nodes + 1}", "--nproc-per-node=1",
            "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench-{port}",
            "--rdzv-conf=last_call_timeout=1,is_host=false", MAIN, f"snapshot.dir={work / 'snap'}", *MODEL,
            f"data.prepared_dir={work / 'prepared'}", f"trainer.compile={str(compile_on).lower()}",
            f"trainer.compile_cache={str(carried).lower()}"]
    metrics = work / "snap" / "metrics.jsonl"
    procs = []
    try:
        for i in range(nodes + 1):
            name = f"node-{i}"
            cache = work / f"cache-{i}"
            joiner = i == nodes
            if not joiner or joiner_warm:
                shutil.copytree(warm, cache)
            if joiner:
                wait_until(lambda: len(records(metrics)) >= 10, 600, "the job's first steps", procs)
                if carried:
                    wait_until(lambda: (work / "snap" / "compile-cache" / "manifest.json").exists(), 60,
                               "the run's compile caches", procs)
            started = time.time()
            with open(work / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(node, cwd=work, env=environment(cache), stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        everyone = wait_until(lambda: [r for r in records(metrics) if r.get("world_size") == nodes + 1], 900,
                              "a step of every node", procs)[0]
        return everyone["time"] - started
    finally:
        stop_all([*procs, rendezvous])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="nodes of the running job (one more joins)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-compile-cache-"))
    try:
        warm = warm_up(root)
        seconds: dict[str, list[float]] = {case: [] for case in CASES}
        for repeat in range(args.repeats):
            for case in CASES:  # interleaved: a drift of the machine's load shows in every case alike
                work = root / f"{case.replace(' ', '-')}-{repeat}"
                work.mkdir()
                os.symlink(root / "prepared", work / "prepared")
                seconds[case].append(join(work, args.nodes, warm, case))
                print(f"{case:>12}: {seconds[case][-1]:6.1f} s", flush=True)
        median = {case: statistics.median(values) for case, values in seconds.items()}
        print(f"\na node joins {args.nodes} node(s), gpt-nano on CPU (Inductor); its start to the first step of all, "
              f"median of {args.repeats}:")
        for case, value in median.items():
            print(f"{case:>12}: {value:6.1f} s")
        print(f"run caches / warm local: {median['run caches'] / median['warm local']:.2f}x (target <= 1.5x); "
              f"run caches - compile off: {median['run caches'] - median['compile off']:+.1f} s (target <= +5 s); "
              f"cold / run caches: {median['cold'] / median['run caches']:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
