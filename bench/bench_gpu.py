"""The GPU benchmark behind bench/gpu.sh: the trainer on every GPU of one machine, one table.

    bash bench/gpu.sh                     # gpt2 (124M), compiled, in the precision `auto` picks (bf16)
    python bench/bench_gpu.py --cpu       # the same jobs on a small model with gloo, to check the script

Three jobs, each `mingpt-torchrun --standalone --nproc-per-node=<GPUs> train/main.py` on the
built-in corpus with its BPE vocabulary (data=python-docs-bpe, trained offline), so nothing is
downloaded:
1. train: the model compiled, with precision left at auto (bf16 on such GPUs), on NCCL, --steps
   steps, a snapshot every 50. From metrics.jsonl: median tokens/s, MFU and peak memory; the time
   to the first progress line (start-up and compiling); the async snapshot stall, as the extra time
   of the 10-step windows that hold a snapshot over the median of the others.
2. eager: the same with trainer.compile=false, for the compile speed-up.
   fsdp: the first job with trainer.parallelism=fsdp: its tokens/s and peak memory against ddp's.
3. modern + Muon: the first job with model.arch=modern trainer.optimizer=muon (recipe=gpt2-muon-fineweb-edu's
   model and optimizer): its tokens/s and its train loss at the last step against GPT-2 with AdamW's.
4. kill -9: an endless run with --max-restarts=1; once it has a snapshot of step 40, one worker is
   killed with SIGKILL. Recovery is the time from the kill to the next progress line after the
   workers resumed (the agent restarts them and they load the newest snapshot).
5. live: two live groups (`mingpt-torchrun --live`) around `mingpt-rendezvous`, each on half of the GPUs (both
   on the one GPU where there is one), the model not compiled: their tokens/s against the same two nodes in the
   restart mode; then, the groups training on, one is SIGKILLed (agent and workers): the time from the kill to
   the survivor's next committed step; then a new group joins and heals from the survivor, every tensor checked
   against the sha256 the survivor sent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from jobs import free_port, stop_all, wait_until, workers

REPO = Path(__file__).resolve().parents[1]
WINDOW = 10  # steps per progress line (trainer.log_every)
EVERY = 50  # steps per snapshot


def launch(nproc: int, overrides: list[str], log: Path, max_restarts: int = 0) -> subprocess.Popen:
    cmd = ["mingpt-torchrun", "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
           str(REPO / "train" / "main.py"), *overrides]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if "tokens_per_s" in r]


def steady(rows: list[dict]) -> list[dict]:
    """Progress windows without start-up (the first two) and without a snapshot in them."""
    return [r for r in rows[2:] if (r["step"] - WINDOW) % EVERY]


def stall_s(rows: list[dict], tokens_per_step: int) -> float:
    """Median extra seconds of a window that holds a snapshot (taken after its first step)."""
    seconds = lambda r: WINDOW * tokens_per_step / r["tokens_per_s"]
    with_snapshot = [seconds(r) for r in rows[2:] if not (r["step"] - WINDOW) % EVERY]
    without = [seconds(r) for r in steady(rows)]
    return statistics.median(with_snapshot) - statistics.median(without) if with_snapshot and without else float("nan")


def train(nproc: int, common: list[str], work: Path, name: str, extra: list[str]) -> tuple[list[dict], float, str]:
    log = work / f"{name}.log"
    started = time.perf_counter()
    job = launch(nproc, [*common, f"snapshot.dir={work / name}", *extra], log)
    first = None
    while job.poll() is None:
        if first is None and records(work / name):
            first = time.perf_counter() - started
        time.sleep(0.2)
    text = log.read_text()
    if job.returncode:
        sys.exit(f"{name} exited {job.returncode}:\n{text[-3000:]}")
    return records(work / name), first or float("nan"), text


def latest_snapshot(run: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in run.glob("step-*") if (p / "manifest.json").exists()]
    return max(steps, default=-1)


def kill_and_recover(nproc: int, common: list[str], work: Path) -> float:
    """Seconds from SIGKILL of one worker to the next progress line of the restarted workers."""
    log, run = work / "kill.log", work / "kill"
    job = launch(nproc, [*common, "trainer.max_steps=100000000", "trainer.log_every=1", "snapshot.every=20",
                         f"snapshot.dir={run}"], log, max_restarts=1)
    try:
        deadline = time.time() + 900
        while latest_snapshot(run) < 40:
            if job.poll() is not None or time.time() > deadline:
                sys.exit(f"kill job: no snapshot of step 40\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        os.kill(workers(job.pid)[0], signal.SIGKILL)
        killed = time.perf_counter()
        while True:
            text = log.read_text()
            resumed = text.find("resumed from", text.find("Worker group") if "Worker group" in text else 0)
            if resumed >= 0 and re.search(r"step \d+/\d+ \|", text[resumed:]):
                return time.perf_counter() - killed
            if job.poll() is not None or time.perf_counter() - killed > 600:
                sys.exit(f"kill job: no step after the restart\n{text[-3000:]}")
            time.sleep(0.05)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait(timeout=120)


def two_groups(nproc: int, common: list[str], work: Path, name: str, nnodes: str, live: bool, port: int,
               micro_batch: int, groups: int = 2) -> list[subprocess.Popen]:
    """`groups` nodes of one job around the mingpt-rendezvous at `port`, each on half of the GPUs (all on GPU 0
    where there is one); the global batch that of two such nodes."""
    per_group = max(1, nproc // 2)
    nodes = []
    for group in range(groups):
        devices = ",".join(str(d % max(nproc, 1)) for d in range(group * per_group, (group + 1) * per_group))
        cmd = ["mingpt-torchrun", "--live" if live else "--no-live", f"--nnodes={nnodes}",
               f"--nproc-per-node={per_group}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id={name}", "--rdzv-conf=is_host=false", str(REPO / "train" / "main.py"), *common,
               f"snapshot.dir={work / name}", f"trainer.global_batch_size={2 * per_group * micro_batch}"]
        log = (work / f"{name}-{len(list(work.glob(f'{name}-*.log')))}.log").open("w")
        nodes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "CUDA_VISIBLE_DEVICES": devices}))
    return nodes


def live_mode(nproc: int, common: list[str], work: Path, steps: int, micro_batch: int) -> list[tuple[str, str]]:
    """5.: the live mode's speed against the restart mode's, a group's death, and a heal."""
    port = free_port()
    started = [subprocess.Popen(["mingpt-rendezvous", f"--port={port}", f"--lighthouse-port={free_port()}"],
                                stdout=(work / "rendezvous.log").open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)]
    common = [*(c for c in common if not c.startswith("trainer.global_batch_size=")), "trainer.compile=false"]
    try:
        rates = {}
        for mode in ("restart", "live"):
            nodes = two_groups(nproc, [*common, f"trainer.max_steps={steps}"], work, mode, "2", mode == "live", port,
                               micro_batch)
            started += nodes
            if any(node.wait(timeout=3600) for node in nodes):
                sys.exit(f"the {mode} mode's job failed:\n{(work / f'{mode}-0.log').read_text()[-3000:]}")
            rates[mode] = statistics.median(r["tokens_per_s"] for r in steady(records(work / mode)))
        endless = [*common, "trainer.max_steps=100000000", "trainer.log_every=1", "snapshot.every=1000"]
        survivor, victim = two_groups(nproc, endless, work, "churn", "1:3", True, port, micro_batch)
        started += [survivor, victim]
        after = lambda moment: [r for r in records(work / "churn") if r["time"] > moment]
        wait_until(lambda: len(records(work / "churn")) >= 40, 900, "step 40 of the live job", [survivor, victim])
        killed = time.time()
        for pid in [victim.pid, *workers(victim.pid)]:  # a machine dies: its agent and workers at once
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: after(killed), 120, "the survivor's next step", [survivor])
        next_step = after(killed)[0]["time"] - killed
        newcomer = two_groups(nproc, endless, work, "churn", "1:3", True, port, micro_batch, groups=1)[0]
        started.append(newcomer)
        newcomer_log = work / "churn-2.log"
        wait_until(lambda: "healed from a live peer" in newcomer_log.read_text(), 300, "the newcomer's heal",
                   [survivor, newcomer])
        refused = "refused the state" in newcomer_log.read_text()
    finally:
        stop_all(started)
    return [("live against restart mode (2 groups, eager)", f"{rates['live'] / rates['restart']:.3f}x "
             f"({rates['live']:,.0f} against {rates['restart']:,.0f} tokens/s)"),
            ("live: SIGKILL of a group to the survivor's next step", f"{next_step:.1f} s"),
            ("live: a new group heals", "a damaged state was refused" if refused else "every tensor's sha256 checked")]


def _against(fsdp: list[dict], ddp: list[dict]) -> str:
    rate = statistics.median(r["tokens_per_s"] for r in steady(fsdp))
    ddp_rate = statistics.median(r["tokens_per_s"] for r in steady(ddp))
    memory = max(r["peak_memory_mb"] for r in fsdp)
    ddp_memory = max(r["peak_memory_mb"] for r in ddp)
    return (f"{rate:,.0f} tokens/s ({rate / ddp_rate:.2f}x), peak memory per process {memory / 1e3:.1f} GB "
            f"({memory / ddp_memory:.2f}x)")


def _recipe(modern: list[dict], gpt2: list[dict]) -> str:
    speed = statistics.median(r["tokens_per_s"] for r in steady(modern)) / \
        statistics.median(r["tokens_per_s"] for r in steady(gpt2))
    return f"tokens/s {speed:.2f}x, last train loss {modern[-1]['train_loss']:.3f} against {gpt2[-1]['train_loss']:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=16, help="examples per GPU per step")
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--cpu", action="store_true", help="check the script: gpt-nano, block 64, 2 CPU workers")
    args = parser.parse_args()
    if args.cpu:
        args.model, args.block, args.micro_batch, nproc, device = "gpt-nano", 64, 4, 2, "2 CPU workers (gloo)"
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU here; run with --cpu to check the script on CPUs")
        nproc = torch.cuda.device_count()
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        device = f"{nproc} x {torch.cuda.get_device_name(0)}, NCCL {nccl}, torch {torch.__version__}"
    tokens_per_step = nproc * args.micro_batch * args.block
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = Path(tmp)
        common = [f"model={args.model}", "model.arch=gpt2", "trainer.optimizer=adamw", "data=python-docs-bpe",
                  f"data.block_size={args.block}",
                  f"data.prepared_dir={work / 'data'}", f"trainer.micro_batch_size={args.micro_batch}",
                  f"trainer.global_batch_size={nproc * args.micro_batch}", f"trainer.log_every={WINDOW}",
                  "trainer.eval_every=0", f"snapshot.every={EVERY}", "snapshot.keep=2"]
        subprocess.run([sys.executable, "-m", "mingpt.cli.prepare", "--corpus", "python-docs", "--tokenizer", "bpe",
                        "--vocab-size", "2048", "--out", str(work / "data")], check=True, capture_output=True)
        steps = f"trainer.max_steps={args.steps}"
        compiled, first_compiled, text = train(nproc, common, work, "train", [steps, "trainer.compile=true"])
        eager, first_eager, _ = train(nproc, common, work, "eager", [steps, "trainer.compile=false"])
        sharded, _, _ = train(nproc, common, work, "fsdp", [steps, "trainer.compile=true", "trainer.parallelism=fsdp"])
        modern, _, _ = train(nproc, common, work, "modern-muon", [steps, "trainer.compile=true", "model.arch=modern",
                                                                   "trainer.optimizer=muon"])
        recovery = kill_and_recover(nproc, common, work)
        live = live_mode(nproc, common, work, args.steps, args.micro_batch)
    setting = re.search(r"\d+ process\(es\), (\w+ \([^)]*\))", text)
    compile_line = re.search(r"torch.compile (\w+ \([^)]*\))", text)
    rate = statistics.median(r["tokens_per_s"] for r in steady(compiled))
    eager_rate = statistics.median(r["tokens_per_s"] for r in steady(eager))
    rows = [
        ("device", device),
        ("model", f"{args.model}, block {args.block}, {args.micro_batch} examples per process"),
        ("precision", setting[1] if setting else "?"),
        ("torch.compile", compile_line[1] if compile_line else "?"),
        ("tokens/s (all processes)", f"{rate:,.0f}"),
        ("MFU", f"{statistics.median(r['mfu'] for r in steady(compiled)):.1%}"),
        ("peak memory per process", f"{max(r['peak_memory_mb'] for r in compiled) / 1e3:.1f} GB"),
        ("compile speed-up", f"{rate / eager_rate:.2f}x ({eager_rate:,.0f} tokens/s eager)"),
        ("fsdp against ddp (compiled)", _against(sharded, compiled)),
        ("modern + Muon against gpt2 + AdamW", _recipe(modern, compiled)),
        ("time to first progress line", f"{first_compiled:.0f} s compiled, {first_eager:.0f} s eager"),
        ("async snapshot stall", f"{stall_s(compiled, tokens_per_step):.2f} s per snapshot"),
        ("kill -9 to next step", f"{recovery:.1f} s"),
        *live,
    ]
    print("\n| | |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
