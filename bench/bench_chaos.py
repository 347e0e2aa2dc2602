"""Chaos: SIGKILL a random worker (the leader among them), or a whole node, again and again, and count
the work lost.

    python bench/bench_chaos.py                       # 20 kills, 2 workers, gpt-micro (~6 min)
    python bench/bench_chaos.py --kills 5 --memory off
    python bench/bench_chaos.py --node-deaths 10      # two agents; a random one dies, a new one joins (~6 min)

One `mingpt-torchrun --standalone --nproc-per-node=2 --max-restarts=<kills>` job, snapshot.every=100,
endless. Each time the job has trained a random 3 to 12 steps past its last resume, one of its two
workers, picked at random, is killed with SIGKILL. Then an uninterrupted job of the same settings runs
to the same step. Printed: per kill, who was killed, the step reached, the step resumed from and how
(snapshot or memory tier) and the seconds from the kill to the next step; then the steps trained again
in all, on average per kill, and whether the weights at the final snapshot are bitwise equal.

--node-deaths: two `mingpt-torchrun --nnodes=1:2` agents (one worker each) around `mingpt-rendezvous`.
Each time, a random agent is killed with its worker (SIGKILL, as when a machine dies); the survivor goes
on alone, then a new agent joins in its place. Steps lost are what the trainer records (`steps_lost`
in metrics.jsonl) at the resume after each death. The world size changes, so the final weights are
compared by their largest difference, not bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RUN = [str(Path(sys.executable).parent / "mingpt-torchrun"), "--standalone", "--nproc-per-node=2"]
SETTINGS = ["model=gpt-micro", "data.block_size=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
            "trainer.log_every=1", "trainer.eval_every=0", "trainer.precision=fp32", "trainer.max_steps=100000000",
            "snapshot.every=100", "snapshot.keep=1000"]
RESUMED = re.compile(r"resumed from (.+?): step (\d+),")


def start(work: Path, name: str, restarts: int, memory: str) -> subprocess.Popen:
    log = open(work / f"{name}.log", "wb")
    return subprocess.Popen([*RUN, f"--max-restarts={restarts}", str(REPO / "train" / "main.py"), *SETTINGS,
                             f"snapshot.dir={work / name}", f"data.prepared_dir={work / 'data'}",
                             f"snapshot.memory={memory}"],
                            cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def records(snap: Path) -> list[dict]:
    try:
        lines = (snap / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines[:-1] if '"train_loss"' in line]  # the last may be half-written


def last_step(snap: Path) -> int:
    found = records(snap)
    return found[-1]["step"] if found else 0


def workers(agent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the agent's workers."""
    found = {}
    for pid in map(int, Path(f"/proc/{agent}/task/{agent}/children").read_text().split()):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((int(v.split(b"=")[1]) for v in environ if v.startswith(b"LOCAL_RANK=")), None)
        if rank is not None:
            found[rank] = pid
    return found


def wait(condition, timeout: float, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise SystemExit(f"the job exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def weights(snap: Path, step: int) -> dict:
    return torch.load(snap / f"step-{step:09d}" / "model.pt", weights_only=True)


def all_records(snap: Path) -> list[dict]:
    try:
        lines = (snap / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines[:-1]]


def node_deaths(count: int, memory: str, chance: random.Random) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-chaos-nodes-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir = Path(sys.executable).parent
    store = subprocess.Popen([str(bin_dir / "mingpt-rendezvous"), f"--port={port}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    snap = work / "chaos"
    command = [str(bin_dir / "mingpt-torchrun"), "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=100",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=chaos",
               "--rdzv-conf=last_call_timeout=1,is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3",
               str(REPO / "train" / "main.py"), *SETTINGS, f"snapshot.dir={snap}", f"data.prepared_dir={work / 'data'}",
               f"snapshot.memory={memory}"]

    def node(name: str) -> subprocess.Popen:
        return subprocess.Popen(command, cwd=work, stdout=open(work / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    both = lambda since: [r for r in records(snap) if r["time"] > since and r["world_size"] == 2]
    nodes, rows = [node("node-0a"), node("node-0b")], []
    try:
        wait(lambda: both(0), 300, store, "a step of both nodes")
        for death in range(count):
            target = last_step(snap) + chance.randint(3, 12)
            wait(lambda: last_step(snap) >= target, 300, store, f"step {target}")
            victim = chance.randint(0, 1)
            for group in [nodes[victim].pid, *workers(nodes[victim].pid).values()]:
                os.killpg(group, signal.SIGKILL)
            nodes[victim].wait()
            killed_at, killed_time = time.monotonic(), time.time()
            wait(lambda: [r for r in records(snap) if r["time"] > killed_time], 300, store, "the survivor's next step")
            seconds = time.monotonic() - killed_at
            lost = [r["steps_lost"] for r in all_records(snap) if r["time"] > killed_time and "steps_lost" in r]
            rows.append((lost[0] if lost else None, seconds))
            print(f"death {death + 1:2d}: node {victim} killed; the survivor's next step {seconds:.1f} s later, "
                  f"steps lost {rows[-1][0]}", flush=True)
            joined = time.time()
            nodes[victim] = node(f"node-{death + 1}{'ab'[victim]}")
            wait(lambda: both(joined), 300, store, "a step of both nodes again")
        final = (last_step(snap) // 100 + 1) * 100
        wait(lambda: (snap / f"step-{final:09d}" / "manifest.json").exists(), 900, store, f"snapshot {final}")
    finally:
        for proc in [*nodes, store]:
            stop(proc)
    reference = start(work, "reference", 0, memory)
    try:
        wait(lambda: (work / "reference" / f"step-{final:09d}" / "manifest.json").exists(), 900, reference,
             f"the reference's snapshot {final}")
    finally:
        stop(reference)
    ours, theirs = weights(snap, final), weights(work / "reference", final)
    diff = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    lost = [n for n, _ in rows if n is not None]
    print(f"snapshot.memory={memory}, {len(rows)} node deaths: steps lost {sum(lost)} in all, "
          f"{statistics.mean(lost) if lost else float('nan'):.2f} per death (at most {max(lost, default=0)}; "
          f"{len(rows) - len(lost)} not recorded); survivor's next step median "
          f"{statistics.median(r[1] for r in rows):.1f} s; weights at step {final}: largest difference to an "
          f"uninterrupted 2-worker run {diff:.2e}")
    print(f"(logs in {work})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--node-deaths", type=int, default=0, help="kill whole nodes instead (two agents)")
    parser.add_argument("--memory", default="on", choices=["on", "off"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chance = random.Random(args.seed)
    if args.node_deaths:
        node_deaths(args.node_deaths, args.memory, chance)
        return
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        work = Path(tmp)
        job, snap, log = start(work, "chaos", args.kills, args.memory), work / "chaos", work / "chaos.log"
        rows, resumes_seen = [], 0
        try:
            for kill in range(args.kills):
                since = last_step(snap) if kill else 0
                target = since + chance.randint(3, 12)
                wait(lambda: last_step(snap) >= target, 300, job, f"step {target}")
                rank = chance.randint(0, 1)
                os.kill(workers(job.pid)[rank], signal.SIGKILL)
                killed_at, killed_time, reached = time.monotonic(), time.time(), last_step(snap)
                found = wait(lambda: RESUMED.findall(log.read_text())[resumes_seen:], 300, job, "the resume")
                resumes_seen += 1
                source, resumed = found[0][0], int(found[0][1])
                wait(lambda: [r for r in records(snap) if r["time"] > killed_time and r["step"] > resumed], 300, job,
                     "the next step")
                rows.append((rank, reached, resumed, "memory" if "memory tier" in source else "snapshot",
                             time.monotonic() - killed_at))
                print(f"kill {kill + 1:2d}: local rank {rank} at step {reached}, resumed from step {resumed} "
                      f"({rows[-1][3]}), next step {rows[-1][4]:.1f} s after the kill", flush=True)
            final = (last_step(snap) // 100 + 1) * 100
            wait(lambda: (snap / f"step-{final:09d}" / "manifest.json").exists(), 600, job, f"snapshot {final}")
        finally:
            stop(job)
        reference = start(work, "reference", 0, args.memory)
        try:
            wait(lambda: (work / "reference" / f"step-{final:09d}" / "manifest.json").exists(), 900, reference,
                 f"the reference's snapshot {final}")
        finally:
            stop(reference)
        lost = [max(0, reached - resumed) for _, reached, resumed, _, _ in rows]
        ours, theirs = weights(snap, final), weights(work / "reference", final)
        equal = all(torch.equal(ours[k], theirs[k]) for k in theirs)
        print(f"snapshot.memory={args.memory}, {len(rows)} kills ({sum(r[0] == 0 for r in rows)} of the leader): "
              f"{sum(lost)} steps trained again, {statistics.mean(lost):.2f} per kill (at most {max(lost)}); "
              f"kill to next step median {statistics.median(r[4] for r in rows):.1f} s; "
              f"weights at step {final} bitwise equal to an uninterrupted run: {equal}")


if __name__ == "__main__":
    main()
