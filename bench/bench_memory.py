"""What the memory tier costs: training tokens/s with snapshot.memory=on against off, side by side.

    python bench/bench_memory.py                         # gpt-mini, ddp, 2 rounds of 60 steps each way (~4 min)
    python bench/bench_memory.py --model gpt-micro --steps 100 --rounds 3 --every 1
    python bench/bench_memory.py --parallelism fsdp --nodes 2 --model gpt2 --block-size 128 --steps 20

Each job trains on the built-in corpus, the rounds interleaved (off, on, off, on, ...) so that the
machine's load falls on both alike: one process (`python train/main.py`), or with --nodes N, N agents
of `mingpt-torchrun --nnodes=N --nproc-per-node=1` around `mingpt-rendezvous` on this machine, each
with a memory folder of its own in /dev/shm. Under fsdp over nodes every process also sends its copy to the next
node, so --parallelism fsdp --nodes 2 measures the copies and their replication. Printed per side: the
median of the jobs' median tokens/s (metrics.jsonl, the first 10 steps left out, or a third where
there are fewer than 30), and for `on` what the trainer logged of the tier (the interval it chose, the
wait and the step time). The ratio to read is on / off. --every 1 forces a copy after every step
(snapshot.memory_every=1) instead of the interval chosen to keep the tier under 3% of the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def job(workdir: Path, args: argparse.Namespace, memory: str) -> tuple[float, str]:
    """Median tokens/s of one job, and its memory-tier log line."""
    snap = workdir / f"snap-{memory}"
    settings = [f"model={args.model}", "model.arch=gpt2", "trainer.optimizer=adamw",
                f"data.block_size={args.block_size}", f"trainer.max_steps={args.steps}",
                f"trainer.parallelism={args.parallelism}", "trainer.log_every=1", "trainer.eval_every=0",
                f"snapshot.every={args.steps}", f"snapshot.dir={snap}", f"data.prepared_dir={workdir / 'data'}",
                f"snapshot.memory={memory}", f"snapshot.memory_every={args.every}", *args.overrides]
    if args.nodes == 1:
        logs = [run([sys.executable, str(REPO / "train" / "main.py"), *settings], workdir / "job.log", workdir)]
    else:
        logs = nodes(workdir, args.nodes, settings)
    lines = (snap / "metrics.jsonl").read_text().splitlines()
    rates = [json.loads(line)["tokens_per_s"] for line in lines if '"tokens_per_s"' in line]
    tier = [m[0] for log in logs if (m := re.search(r"memory tier: .*", log.read_text()))]
    return statistics.median(rates[min(10, len(rates) // 3):]), tier[0] if tier else ""


def run(command: list[str], log: Path, cwd: Path) -> Path:
    with open(log, "wb") as out:
        if subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"the job failed:\n{log.read_text()[-3000:]}")
    return log


def nodes(workdir: Path, count: int, settings: list[str]) -> list[Path]:
    """`count` agents of one job on this machine, each its own memory folder; their logs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = subprocess.Popen([str(BIN / "mingpt-rendezvous"), f"--port={port}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    agents, logs = [], []
    shared = Path(tempfile.mkdtemp(prefix="bench-memory-", dir="/dev/shm"))  # as the default memory_dir is
    try:
        for node in range(count):
            memory, log = shared / f"node-{node}", workdir / f"node-{node}.log"
            memory.mkdir()
            agents.append(subprocess.Popen(
                [str(BIN / "mingpt-torchrun"), "--no-live", f"--nnodes={count}", "--nproc-per-node=1",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench-{workdir.name}",
                 "--rdzv-conf=is_host=false", str(REPO / "train" / "main.py"), *settings,
                 f"snapshot.memory_dir={memory}"],
                cwd=workdir, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True))
            logs.append(log)
        if any(agent.wait() != 0 for agent in agents):
            raise SystemExit(f"the job failed:\n{logs[0].read_text()[-3000:]}")
    finally:
        for proc in [*agents, store]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
        shutil.rmtree(shared, ignore_errors=True)
    return logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--every", type=int, default=0, help="snapshot.memory_every (0: chosen by the trainer)")
    parser.add_argument("--parallelism", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--nodes", type=int, default=1, help="agents of one job on this machine (1: one process)")
    parser.add_argument("overrides", nargs="*", help="more settings, as for train/main.py")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    notes = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for _ in range(args.rounds):
            for memory in ("off", "on"):
                workdir = Path(tmp) / f"{memory}-{len(rates[memory])}"
                workdir.mkdir()
                rate, note = job(workdir, args, memory)
                rates[memory].append(rate)
                if note:
                    notes.append(note)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"{args.model}, {args.parallelism}, {args.nodes} node(s), block {args.block_size}, {args.steps} steps, "
          f"{args.rounds} rounds, snapshot.memory_every={args.every} {' '.join(args.overrides)}")
    print(f"  memory off: {off:,.0f} tokens/s   (rounds: {', '.join(f'{r:,.0f}' for r in rates['off'])})")
    print(f"  memory on:  {on:,.0f} tokens/s   (rounds: {', '.join(f'{r:,.0f}' for r in rates['on'])})")
    print(f"  on / off: {on / off:.3f}")
    for note in notes:
        print(f"  {note}")


if __name__ == "__main__":
    main()
