"""Chaos: SIGKILL a random worker (the leader among them) again and again, or run a job through churn
(whole nodes dying, leaving and joining), and count the work lost and the time it costs.

    python bench/bench_chaos.py                       # 20 kills, 2 workers, gpt-micro (~6 min)
    python bench/bench_chaos.py --kills 5 --memory off
    python bench/bench_chaos.py --churn 5             # 5 seeds of 20 node deaths each (~4 min a seed)
    python bench/bench_chaos.py --churn 2 --parallelism fsdp   # the same, the model sharded over the nodes

Kills: one `mingpt-torchrun --standalone --nproc-per-node=2 --max-restarts=<kills>` job, snapshot.every=100,
endless. Each time the job has trained a random 3 to 12 steps past its last resume, one of its two
workers, picked at random, is killed with SIGKILL. Then an uninterrupted job of the same settings runs
to the same step. Printed: per kill, who was killed, the step reached, the step resumed from and how
(snapshot or memory tier) and the seconds from the kill to the next step; then the steps trained again
in all, on average per kill, and whether the weights at the final snapshot are bitwise equal.

--churn: per seed, one job of `mingpt-torchrun --nnodes=1:4 --max-restarts=3` agents (one worker each,
the launcher's own rendezvous settings, each node its own snapshot.memory_dir) around `mingpt-rendezvous`,
to trainer.max_steps. Every 4-10 s a random node dies: SIGKILL (agent and workers at once, as when a
machine dies) or SIGTERM (a preemption: the node leaves), and its memory folder is deleted, as a lost
machine takes its memory with it. Half of the
deaths are aimed at a rendezvous: a new node is started, and the death comes 0-2.5 s after it entered
the rendezvous (the victim may be the newcomer). Otherwise a new node replaces the dead one. Printed per
seed: whether the job completed (final snapshot, every agent left exited 0), the steps trained again
(`steps_lost` in metrics.jsonl), the time from each death to the next step (recovery), the time from a new
node's entering the rendezvous to the round that lets it in (its agent's log), and to the first step it
takes part in (the leader's `membership` record; deaths of its peers meanwhile delay it), and the final
val loss and greedy text against an uninterrupted 2-worker run.

--churn runs the same churn (same seeds, so the same deaths, joins and signals) in both modes, one after
the other: restart (torchrun's agents restart every worker at every change) and live (`mingpt-torchrun
--live`: each node a torchft replica group; the survivors keep their processes). Per mode it prints the
survivors' stall (the longest wait for a new step from a death to the next death), whether the nodes that
lived through a death kept their workers' pids, a new node's time from its start to its first step, the
goodput (the share of the run in which new steps kept coming: a gap of more than 1 s between two new steps
counts as lost), and the ledger check (every step's samples, as metrics.jsonl records them, are those of
the uninterrupted run).
--modes restart or --modes live runs one of them.

--peacetime ROUNDS: no death; the two modes alternated ROUNDS times on two jobs, 2 nodes of 1 worker (gpt-micro)
and 2 nodes of 2 workers (gpt-mini), each to --max-steps around mingpt-rendezvous. Printed per job: each run's
seconds per step from a fifth of the way in to the end (start-up left out), and the live mode's speed against the
restart mode's (the ratio of their mean seconds per step).

--parallelism fsdp shards the model over the workers (over the nodes, under --churn, restart mode only):
each process then keeps its shard in memory, and under --churn sends a copy to the next node.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from jobs import free_port
from mingpt.checkpoint.shm import remove_ended_agents_folders

REPO = Path(__file__).resolve().parents[1]
RUN = [str(Path(sys.executable).parent / "mingpt-torchrun"), "--standalone", "--nproc-per-node=2"]
SETTINGS = ["model=gpt-micro", "model.arch=gpt2", "trainer.optimizer=adamw",
            "data.block_size=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
            "trainer.log_every=1", "trainer.eval_every=0", "trainer.precision=fp32", "snapshot.every=100",
            "snapshot.keep=1000"]
ENDLESS = 100_000_000
RESUMED = re.compile(r"resumed from (.+?): step (\d+),")


def start(work: Path, name: str, restarts: int, memory: str, max_steps: int = ENDLESS) -> subprocess.Popen:
    log = open(work / f"{name}.log", "wb")
    return subprocess.Popen([*RUN, f"--max-restarts={restarts}", str(REPO / "train" / "main.py"), *SETTINGS,
                             f"trainer.max_steps={max_steps}", f"snapshot.dir={work / name}", f"data.prepared_dir={work / 'data'}",
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
    try:
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    except OSError:  # the agent has ended
        return found
    for pid in map(int, children):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()  # mingpt-workerN (mingpt.jobenv.worker_name)
        except OSError:  # the worker has just ended
            continue
        if name.startswith("mingpt-worker") and name[len("mingpt-worker"):].isdigit():
            found[int(name[len("mingpt-worker"):])] = pid
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
    from mingpt.checkpoint.load import open_snapshot, read_weights

    return read_weights(open_snapshot(str(snap / f"step-{step:09d}")))


def all_records(snap: Path) -> list[dict]:
    try:
        lines = (snap / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:  # the last may be half-written
            pass
    return found


JOINING = "; joining the job"  # what mingpt-torchrun logs once this node's data is ready, before its agent starts
ENTERED = "mingpt-torchrun: entering the rendezvous"  # what a node's agent logs as it comes to join
LET_IN = "; starting its workers"  # ... and once a round let it in


TAKES_PART = "live: this group takes part from step"  # what a live node's first worker logs at its first step


@dataclass
class Node:
    """One mingpt-torchrun agent with one worker: a machine of the churn."""

    proc: subprocess.Popen
    log: Path
    memory: Path  # its snapshot.memory_dir
    started: float  # time.time() at its start
    joining: float | None = None  # when it said it was joining the job (its data ready)
    entered: float | None = None  # when its agent entered the rendezvous (time.time())
    let_in: float | None = None  # when a round first took it in
    took_part: float | None = None  # live: when it first took part in a committed step
    killed: float | None = None
    pids: list[tuple[float, frozenset[int]]] = field(default_factory=list)  # (when, its workers' pids) at each change

    def pids_at(self, moment: float) -> frozenset[int] | None:
        """Its workers' pids as last seen at or before `moment`."""
        seen = [pids for at, pids in self.pids if at <= moment]
        return seen[-1] if seen else None

    def alive(self) -> bool:
        return self.killed is None and self.proc.poll() is None


@dataclass
class Death:
    at: float
    signal: str
    aimed: bool  # while a newcomer was in the rendezvous


def churn(seed: int, deaths: int, max_steps: int, data: Path, reference: Path, mode: str) -> dict:
    """One churn job of `deaths` node deaths, in `mode` (restart or live); what happened, as numbers."""
    chance = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix=f"bench-churn-{seed}-{mode}-"))
    port = free_port()
    bin_dir = Path(sys.executable).parent
    store = subprocess.Popen([str(bin_dir / "mingpt-rendezvous"), f"--port={port}",
                              f"--lighthouse-port={free_port()}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    snap = work / "churn"
    # mingpt-torchrun's own rendezvous settings; --max-restarts=3: membership changes must not use them up.
    command = [str(bin_dir / "mingpt-torchrun"), *(["--live"] if mode == "live" else ["--no-live"]), "--nnodes=1:4",
               "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=churn-{seed}-{mode}", "--rdzv-conf=is_host=false", str(REPO / "train" / "main.py"),
               *SETTINGS, f"trainer.max_steps={max_steps}", f"snapshot.dir={snap}", f"data.prepared_dir={data}"]
    nodes: list[Node] = []

    def start_node() -> Node:
        log, memory = work / f"node-{len(nodes)}.log", work / f"memory-{len(nodes)}"
        memory.mkdir()
        proc = subprocess.Popen([*command, f"snapshot.memory_dir={memory}"], cwd=work, stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        nodes.append(Node(proc, log, memory, time.time()))
        return nodes[-1]

    def pause(seconds: float, until=lambda: False) -> None:
        """Wait, noting when each node enters the rendezvous, when a round lets it in, when it first takes part
        (live), and whether its workers' pids change."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            for node in nodes:
                if not node.alive():
                    continue
                if node.let_in is None or (mode == "live" and node.took_part is None):
                    text = node.log.read_text(errors="replace")
                    if node.joining is None and JOINING in text:
                        node.joining = time.time()
                    if node.entered is None and ENTERED in text:
                        node.entered = time.time()
                    if node.let_in is None and LET_IN in text:
                        node.let_in = time.time()
                    if node.took_part is None and TAKES_PART in text:
                        node.took_part = time.time()
                pids = frozenset(workers(node.proc.pid).values())
                if pids and (not node.pids or node.pids[-1][1] != pids):
                    node.pids.append((time.time(), pids))
            time.sleep(0.05)

    def kill(node: Node, sig: signal.Signals) -> None:
        groups = [node.proc.pid, *workers(node.proc.pid).values()]
        node.killed = time.time()
        if sig == signal.SIGKILL:  # a machine dies: its agent and workers at once
            for group in groups:
                try:
                    os.killpg(group, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:  # a machine is preempted or leaves: torchrun forwards it to the workers, which snapshot
            node.proc.send_signal(sig)
        shutil.rmtree(node.memory, ignore_errors=True)  # the machine's memory goes with it

    def live() -> list[Node]:
        return [node for node in nodes if node.alive()]

    done = lambda: (snap / f"step-{max_steps:09d}" / "manifest.json").exists()
    rows: list[Death] = []
    try:
        start_node(), start_node()
        pause(300, until=lambda: records(snap))
        for _ in range(deaths):
            pause(chance.uniform(4, 10), until=done)
            if done():
                break
            aimed = chance.random() < 0.5 or len(live()) < 2
            if aimed:  # the death comes while a newcomer is in the rendezvous or its rank assignment
                newcomer = start_node()
                pause(120, until=lambda: newcomer.entered is not None)
                pause(chance.uniform(0, 2.5))
            if done() or not live():  # it finished while the newcomer came (or nothing is left to kill)
                break
            sig = chance.choice([signal.SIGKILL, signal.SIGTERM])
            victim = chance.choice(live())
            rows.append(Death(time.time(), sig.name, aimed))
            kill(victim, sig)
            if not aimed and len(live()) < 2:
                pause(chance.uniform(0, 3))
                start_node()
        pause(900, until=lambda: not live())  # the job finishes on the nodes that are left
    finally:
        for node in nodes:
            stop(node.proc)
        stop(store)
        remove_ended_agents_folders()  # what the SIGKILLed agents left in /tmp, which the next job would remove
    return summarize(seed, mode, snap, nodes, rows, max_steps, reference, work)


def new_steps(found: list[dict]) -> list[tuple[float, int]]:
    """(time, step) of every step that went past all before it, from the ledger records."""
    progress, furthest = [], 0
    for record in sorted((r for r in found if "samples" in r), key=lambda r: r["time"]):
        if record["step"] > furthest:
            furthest = record["step"]
            progress.append((record["time"], furthest))
    return progress


def goodput(progress: list[tuple[float, int]]) -> float:
    """The share of the run in which new steps kept coming: gaps over GAP_S between new steps are lost."""
    if len(progress) < 2:
        return float("nan")
    gaps = [b - a for (a, _), (b, _) in zip(progress, progress[1:])]
    return 1 - sum(gap for gap in gaps if gap > GAP_S) / (progress[-1][0] - progress[0][0])


GAP_S = 1.0


def ledger_check(found: list[dict], reference: list[dict], max_steps: int) -> str:
    """Whether every step's samples are in the ledger, and are the uninterrupted run's."""
    expected = {r["step"]: r["samples"] for r in reference if "samples" in r}
    seen: dict[int, set[str]] = {}
    for r in found:
        if "samples" in r:
            seen.setdefault(r["step"], set()).add(r["samples"])
    missing = [step for step in range(1, max_steps + 1) if step not in seen]
    wrong = [step for step, digests in seen.items() if digests != {expected.get(step)}]
    return "ok" if not missing and not wrong else f"{len(missing)} step(s) missing, {len(wrong)} wrong"


def summarize(seed: int, mode: str, snap: Path, nodes: list, rows: list, max_steps: int, reference: Path,
              work: Path) -> dict:
    found = all_records(snap)
    progress = new_steps(found)
    stall, kept, survivors = [], 0, 0
    for death, following in zip(rows, [*(d.at for d in rows[1:]), float("inf")]):
        # The longest wait for a new step until the next death (a SIGTERMed node may finish a step first, and
        # the others wait after it), or, where none came before it, until the first one after.
        after = [at for at, _ in progress if death.at < at]
        waits = [death.at] + ([at for at in after if at < following] or after[:1])
        stall.append(max(b - a for a, b in zip(waits, waits[1:])) if len(waits) > 1 else float("inf"))
        # The nodes that lived through it: their workers' pids before it and once new steps came again.
        recovered = waits[-1] if len(waits) > 1 else float("inf")
        for node in nodes:
            before, later = node.pids_at(death.at), node.pids_at(recovered)
            if before and later and (node.killed is None or node.killed > recovered):
                survivors += 1
                kept += before == later
    joined_at = {}  # restart: agent pid -> the first step of a generation it took part in
    for r in found:
        for name in (r.get("membership") or {}).get("members", []):
            joined_at.setdefault(name.rsplit("agent ", 1)[-1].rstrip(")"), r["time"])
    admission, from_joining, never = [], [], 0
    for node in nodes[2:]:  # the first two started the job
        at = node.took_part if mode == "live" else joined_at.get(str(node.proc.pid))
        if at is not None:
            admission.append(at - node.started)
            from_joining += [at - node.joining] if node.joining is not None else []
        elif node.killed is None:
            never += 1  # alive, never took part
    lost = [r["steps_lost"] for r in found if "steps_lost" in r]
    completed = (snap / f"step-{max_steps:09d}" / "manifest.json").exists() and \
        all(node.proc.returncode == 0 for node in nodes if node.killed is None)
    val = greedy = None
    if completed:
        ours, theirs = (json.loads((folder / f"step-{max_steps:09d}" / "manifest.json").read_text())
                        for folder in (snap, reference))
        val = abs(ours["metrics"]["val_loss"] - theirs["metrics"]["val_loss"])
        greedy = sample(snap, max_steps) == sample(reference, max_steps)
    row = {"seed": seed, "mode": mode, "completed": completed, "deaths": len(rows), "steps_again": sum(lost),
           "stall": stall, "admission": admission, "from_joining": from_joining, "never_admitted": never,
           "val_diff": val, "greedy": greedy, "goodput": goodput(progress), "kept": (kept, survivors),
           "ledger": ledger_check(found, all_records(reference), max_steps)}
    killed = sum(d.signal == "SIGKILL" for d in rows)
    print(f"{mode} seed {seed}: completed {'yes' if completed else 'NO'}; {len(rows)} deaths ({killed} SIGKILL, "
          f"{len(rows) - killed} SIGTERM, {sum(d.aimed for d in rows)} while a node was joining); survivors' stall "
          f"median {_median(stall)} max {_max(stall)}; survivors' worker pids unchanged through {kept} of {survivors} "
          f"deaths of another node; a new node's start to its first step median {_median(admission)} max "
          f"{_max(admission)} (never: {never}), from its \"joining the job\" median {_median(from_joining)} max "
          f"{_max(from_joining)}; goodput {row['goodput']:.0%}; steps trained again {sum(lost)}; "
          f"ledger {row['ledger']}; "
          f"val loss against an uninterrupted run: difference {val if val is None else f'{val:.1e}'}; greedy text "
          f"equal: {greedy} (logs in {work})", flush=True)
    return row


def sample(snap: Path, step: int) -> str:
    return subprocess.run([str(Path(sys.executable).parent / "mingpt-sample"), str(snap / f"step-{step:09d}"),
                           "--temperature=0", "--max-new-tokens=200"], capture_output=True, text=True,
                          check=True).stdout


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s" if values else "-"


def _max(values: list[float]) -> str:
    return f"{max(values):.1f} s" if values else "-"


def two_nodes(work: Path, mode: str, workers_per_node: int, model: str, max_steps: int) -> float:
    """Seconds per step, from a fifth of the way in to the end, of a job of 2 nodes in `mode`, no death."""
    bin_dir, port = Path(sys.executable).parent, free_port()
    store = subprocess.Popen([str(bin_dir / "mingpt-rendezvous"), f"--port={port}",
                              f"--lighthouse-port={free_port()}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    snap, name = work / f"{mode}-{model}", f"peace-{mode}-{model}-{time.time_ns()}"
    command = [str(bin_dir / "mingpt-torchrun"), *(["--live"] if mode == "live" else ["--no-live"]), "--nnodes=2",
               f"--nproc-per-node={workers_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id={name}", "--rdzv-conf=is_host=false", str(REPO / "train" / "main.py"),
               *[s for s in SETTINGS if not s.startswith(("model=", "snapshot.every="))], f"model={model}",
               f"trainer.max_steps={max_steps}", "snapshot.every=1000000", f"snapshot.dir={snap}",
               f"data.prepared_dir={work / 'data'}"]
    nodes = [subprocess.Popen(command, cwd=work, stdout=open(work / f"{name}-{i}.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in range(2)]
    try:
        for node in nodes:
            if node.wait(timeout=1800) != 0:
                raise SystemExit(f"a {mode} node exited {node.returncode}: see {work / name}-*.log")
    finally:
        for proc in [*nodes, store]:
            stop(proc)
    times = {r["step"]: r["time"] for r in records(snap)}
    first = max_steps // 5
    shutil.rmtree(snap)
    return (times[max_steps - 1] - times[first]) / (max_steps - 1 - first)


def peacetime(rounds: int, max_steps: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-peace-") as tmp:
        for workers_per_node, model in [(1, "gpt-micro"), (2, "gpt-mini")]:
            seconds = {"restart": [], "live": []}
            for _ in range(rounds):
                for mode in seconds:
                    seconds[mode].append(two_nodes(Path(tmp), mode, workers_per_node, model, max_steps))
            print(f"2 nodes of {workers_per_node} worker(s), {model}, {max_steps} steps: s/step restart "
                  f"{', '.join(f'{s:.4f}' for s in seconds['restart'])}; live "
                  f"{', '.join(f'{s:.4f}' for s in seconds['live'])}; live at "
                  f"{statistics.mean(seconds['restart']) / statistics.mean(seconds['live']):.3f}x the restart "
                  "mode's speed", flush=True)


def churn_seeds(seeds: list[int], deaths: int, max_steps: int, modes: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        work = Path(tmp)
        reference = start(work, "reference", 0, "on", max_steps)
        reference.wait()
        rows = [churn(seed, deaths, max_steps, work / "data", work / "reference", mode)
                for seed in seeds for mode in modes]
    for mode in modes:
        ours = [row for row in rows if row["mode"] == mode]
        stall = [s for row in ours for s in row["stall"]]
        admission = [s for row in ours for s in row["admission"]]
        from_joining = [s for row in ours for s in row["from_joining"]]
        kept = [row["kept"] for row in ours]
        goodputs = ", ".join(f"{row['goodput']:.0%}" for row in ours)
        print(f"{mode}, {len(ours)} seeds: completed {sum(r['completed'] for r in ours)}; deaths "
              f"{sum(r['deaths'] for r in ours)}; survivors' stall median {_median(stall)} max {_max(stall)}; "
              f"survivors' worker pids unchanged through {sum(k for k, _ in kept)} of {sum(n for _, n in kept)} deaths "
              f"of another node; a new "
              f"node's start to its first step median {_median(admission)} max {_max(admission)} (never: "
              f"{sum(r['never_admitted'] for r in ours)}), from its \"joining the job\" median {_median(from_joining)} "
              f"max {_max(from_joining)}; goodput {goodputs}; "
              f"steps trained again {sum(r['steps_again'] for r in ours)}; ledger "
              f"{', '.join(r['ledger'] for r in ours)}; greedy text equal in {sum(bool(r['greedy']) for r in ours)}; "
              f"val loss difference at most "
              f"{max((r['val_diff'] for r in ours if r['val_diff'] is not None), default=float('nan')):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--churn", type=int, default=0, metavar="SEEDS", help="run SEEDS churn jobs instead")
    parser.add_argument("--deaths", type=int, default=20, help="node deaths per churn job")
    parser.add_argument("--max-steps", type=int, default=1500, help="trainer.max_steps of a churn job")
    parser.add_argument("--memory", default="on", choices=["on", "off"])
    parser.add_argument("--parallelism", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--peacetime", type=int, default=0, metavar="ROUNDS",
                        help="time both modes with no death instead, alternated ROUNDS times")
    parser.add_argument("--modes", default="restart,live", help="--churn: the modes to run, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    SETTINGS.append(f"trainer.parallelism={args.parallelism}")  # every job of the run, the reference's too
    if args.peacetime:
        peacetime(args.peacetime, args.max_steps)
        return
    if args.churn:
        churn_seeds(list(range(args.seed, args.seed + args.churn)), args.deaths, args.max_steps,
                    args.modes.split(","))
        return
    chance = random.Random(args.seed)
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
