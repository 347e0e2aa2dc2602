"""What the benches that start whole jobs share: a free port, an agent's workers, the steps a job's metrics.jsonl
records, and waiting for a condition while the job's processes live, and ending them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workers(agent: int) -> list[int]:
    """The pids of the agent's workers (named mingpt-workerN: mingpt.jobenv.worker_name), not its warm-worker server,
    a child of it too."""
    try:
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    except OSError:
        return []
    found = []
    for pid in children:
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("mingpt-worker"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def records(metrics: Path) -> list[dict]:
    """The step records of a metrics.jsonl; the last line is left out: it may be half-written."""
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines[:-1] if '"train_loss"' in line]


def wait_until(condition, timeout: float, what: str, procs: list[subprocess.Popen]):
    """What `condition()` returns once it is true; SystemExit when a process ends or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a node exited while waiting for {what}")
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def stop_all(procs: list[subprocess.Popen]) -> None:
    """End each process's session (SIGTERM, then SIGKILL after 60 s) and wait for it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
