"""Helpers for tests that run the real trainer: in this process, plain python, torchrun, several
agents on 127.0.0.1.

Every process is started in its own session so that a test can end it (and its workers) by
process group, and `Processes` ends whatever is still running when the test finishes, pass or fail.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from mingpt.checkpoint.shm import remove_ended_agents_folders
from mingpt.launch import forkserver
from mingpt.training.app import compose_config
from mingpt.training.config import Config

REPO = Path(__file__).resolve().parents[1]
MAIN = str(REPO / "train" / "main.py")

# Small and quick, but with steps long enough that a test can act between snapshots.
# fp32 on every machine: tests compare runs that split a batch differently, which agree to fp32
# rounding; bf16 autocast (what `auto` picks on CPUs with native bf16) has tests of its own.
SMALL = [  # GPT-2's recipe, which the tests were written for (the small presets' default is today's: test_app)
    "model=gpt-nano", "model.arch=gpt2", "trainer.optimizer=adamw", "data.block_size=32",
    "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
    "trainer.warmup_steps=5", "trainer.lr=3e-3", "trainer.log_every=5", "trainer.eval_every=0",
    "trainer.eval_samples=32", "trainer.dist_timeout_s=30", "trainer.precision=fp32",
]

RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def config(*overrides: str) -> Config:
    """The Config that `python train/main.py OVERRIDES` runs with, composed by Hydra in this process
    from train/conf, and validated as main.py validates it."""
    return compose_config(REPO / "train" / "conf", list(overrides))


def train_here(root: Path, *overrides: str) -> str:
    """Train in this process, as `python train/main.py SMALL OVERRIDES` would with its snapshots in
    root/snap and its data in root/prepared; the log it wrote. Errors are raised."""
    from mingpt.training.trainer import train

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("mingpt")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        train(config(*SMALL, f"snapshot.dir={root / 'snap'}", f"data.prepared_dir={root / 'prepared'}", *overrides))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_and_next() -> int:
    """A port P free with P + 1 (mingpt-rendezvous's default Lighthouse port), both below the ports the kernel hands
    out to connecting sockets (ip_local_port_range), where another test's client could take P + 1 meanwhile."""
    lowest = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(10_000, max(lowest - 1, 20_000))  # (a range from below 10,000: any port)
        try:
            with socket.socket() as s, socket.socket() as t:
                s.bind(("127.0.0.1", port))
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def port_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def env() -> dict:
    """The environment of the processes the tests start."""
    e = dict(os.environ)
    # Launched as users type it: mingpt-torchrun sets what torchrun needs, nothing here does.
    e.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    e.pop("PYTEST_CURRENT_TEST", None)  # the test's phase: not the command's business, and it changes
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    e["CUDA_VISIBLE_DEVICES"] = ""  # the tests are about CPUs and gloo, whatever GPUs this machine has
    return e


def read_as_they_run(name: str) -> bool:
    """The variables the tests set for a command that no module the warm Python imported reads as it imports: a
    worker's own, and the S3 server's and W&B's settings (read as a client is made)."""
    return forkserver.per_worker(name) or name.startswith(("AWS_", "WANDB_"))


class WarmPython:
    """A Python of the test process's own, with torch, the trainer and the launcher imported, serving it as an
    agent's server serves the agent (mingpt.launch.forkserver): the commands the tests start (a console script of
    mingpt's, or `python SCRIPT`, in the tests' environment) are forked from it instead of importing torch again,
    about 2 s of CPU each. They are real processes of their own as mingpt-torchrun's workers are; the tests of what
    a new Python does (the commands' imports, their installation) start theirs with subprocess.

    MINGPT_TEST_WARM=0 starts every command as a new Python."""

    MODULES = (*forkserver.WARM_MODULES, "mingpt.cli.torchrun", "mingpt.cli.rendezvous", "mingpt.launch.node")

    def __init__(self):
        self.environment = env()  # the session's, whatever a test sets before the first use
        self.process: subprocess.Popen | None = None
        self.server: forkserver.Server | None = None

    def start(self, args: list[str], cwd: Path, stdout, stderr) -> forkserver.Forked | None:
        """`args` forked in `cwd`, its output to the open files, in a session of its own; None where it is no
        command of the project's, or the server cannot."""
        script = args[1:] if args[0] == sys.executable and len(args) > 1 and args[1].endswith(".py") else args
        if not (script[0].endswith(".py") or script[0].startswith(str(BIN / "mingpt-"))) or \
                not Path(script[0]).is_file() or os.environ.get("MINGPT_TEST_WARM") == "0":
            return None
        if self.server is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with theirs:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", "import socket, sys; from mingpt.launch import forkserver; "
                     "forkserver.be_the_server(socket.socket(fileno=int(sys.argv[1])), sys.argv[2], "
                     "tuple(sys.argv[3:]))", str(theirs.fileno()), MAIN, *self.MODULES],
                    env=self.environment, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()])
            self.server = forkserver.Server(self.process.pid, ours, self.environment, read_as_they_run)
        forked = self.server.start((sys.executable, "-u", *script), env(), stdout, stderr, cwd=str(cwd))
        if forked is not None:
            forked.args = args  # as a Popen's: the command as given
        return forked

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.process.wait()


class Processes:
    """Starts commands in new sessions, logging each to a file; ends them all on close."""

    def __init__(self, workdir: Path, warm: WarmPython | None = None):
        self.workdir, self.warm = workdir, warm
        self.started: list[subprocess.Popen | forkserver.Forked] = []

    def start(self, args: list[str], name: str, cwd: Path | None = None, environment: dict | None = None,
              errors: Path | None = None) -> subprocess.Popen | forkserver.Forked:
        """`args`, its output logged to NAME.log (its standard error too, or to `errors`), forked from the warm
        Python where it can be and `environment` is the tests' own."""
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log, open(errors or os.devnull, "ab") as error_log:
            stderr = error_log if errors else log
            proc = None
            if self.warm is not None and environment is None:
                proc = self.warm.start(args, cwd or self.workdir, log, stderr)
            if proc is None:
                proc = subprocess.Popen(args, cwd=cwd or self.workdir, env=environment or env(), stdout=log,
                                        stderr=stderr, start_new_session=True)
        proc.log_path = log_path
        self.started.append(proc)
        return proc

    def run(self, args: list[str], name: str, cwd: Path | None = None, timeout: float = 120,
            environment: dict | None = None) -> subprocess.CompletedProcess:
        """`args` run to its end, as subprocess.run(..., capture_output=True, text=True) runs it."""
        name = f"{name}-{len(self.started)}"  # its own logs, however often a test runs it
        errors = self.workdir / f"{name}.err"
        proc = self.start(args, name, cwd, environment, errors=errors)
        returncode = proc.wait(timeout=timeout)
        return subprocess.CompletedProcess(args, returncode, output(proc), errors.read_text(errors="replace"))

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                kill_node(proc)
            proc.wait(timeout=30)
        remove_memory_tiers({proc.pid for proc in self.started})
        remove_ended_agents_folders()  # what killed agents left in /tmp, which the next job would remove


def remove_memory_tiers(launchers: set[int]) -> None:
    """Remove the memory tiers (/dev/shm/mingpt-<run>-<launcher pid>-<shard>) of jobs these processes
    launched: a killed job's tier stays until a job starts on this machine after its launcher ended."""
    for folder in Path("/dev/shm").glob("mingpt-*-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and int(pid) in launchers:
            shutil.rmtree(folder, ignore_errors=True)


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers, as when a machine dies. torchrun starts each worker in a
    session of its own, so the agent's process group alone would leave them running."""
    workers = children(proc.pid)
    for group in [proc.pid, *workers]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def output(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text(errors="replace")


BIN = Path(sys.executable).parent  # where pip put the project's console scripts


def torchrun(*args: str) -> list[str]:
    """The trainer under mingpt-torchrun, the launcher the README gives."""
    return [str(BIN / "mingpt-torchrun"), *args, MAIN]


def plain_torchrun(logs: Path, *args: str) -> list[str]:
    """The trainer under torch's own torchrun, as copied from the PyTorch docs, but for --log-dir=`logs`: else
    torch leaves a torchelastic_* folder of its workers' error files in /tmp for each agent."""
    return [sys.executable, "-m", "torch.distributed.run", f"--log-dir={logs}", *args, MAIN]


def rendezvous(procs: "Processes", port: int, lighthouse_port: int | None = None) -> subprocess.Popen:
    """mingpt-rendezvous hosting the rendezvous store on `port` (and the Lighthouse of live jobs on
    `lighthouse_port`, or another free port), once it listens."""
    store = procs.start([str(BIN / "mingpt-rendezvous"), f"--port={port}",
                         f"--lighthouse-port={lighthouse_port or free_port()}"], f"rendezvous-{port}")
    wait_for(lambda: "listening" in output(store), 60, "the rendezvous store", [store])
    return store


def standalone(nproc: int, max_restarts: int = 0) -> list[str]:
    return torchrun("--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}")


def run(procs: Processes, args: list[str], overrides: list[str], name: str, timeout: float = 240) -> str:
    """Run to the end; return the output; fail with it on a non-zero exit."""
    proc = procs.start(args + overrides, name)
    rc = proc.wait(timeout=timeout)
    text = output(proc)
    assert rc == 0, f"{name} exited {rc}:\n{text[-4000:]}"
    return text


def wait_for(condition, timeout: float, what: str, procs: list[subprocess.Popen] = ()) -> None:
    """Poll `condition` until true; fail early if one of `procs` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"process exited ({p.returncode}) while waiting for {what}:\n{output(p)[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def manifests(snapdir: Path) -> list[dict]:
    """Manifests of the committed snapshots, oldest first."""
    found = []
    for path in sorted(snapdir.glob("step-?????????/manifest.json")):  # (not a damaged one set aside)
        try:
            found.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, FileNotFoundError):
            pass  # being written or pruned right now
    return found


def latest_step(snapdir: Path) -> int:
    found = manifests(snapdir)
    return found[-1]["step"] if found else -1


def weights(snapdir: Path, step: int) -> dict:
    return torch.load(snapdir / f"step-{step:09d}" / "model.pt", weights_only=True)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def worker(agent_pid: int, local_rank: int) -> int:
    """The PID of the agent's worker with this LOCAL_RANK: named by it (launcher.name_this_worker), since one
    forked from the agent's server has the server's environment in /proc."""
    for pid in children(agent_pid):
        try:
            if (Path("/proc") / str(pid) / "comm").read_text().strip() == f"mingpt-worker{local_rank}":
                return pid
        except OSError:  # it has just ended
            continue
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank} under {agent_pid}")


def metrics(snapdir: Path) -> list[dict]:
    path = snapdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ledger(snapdir: Path) -> dict[int, set[str]]:
    """step -> the digests of its samples, as metrics.jsonl records them."""
    found: dict[int, set[str]] = {}
    for record in metrics(snapdir):
        if "samples" in record:
            found.setdefault(record["step"], set()).add(record["samples"])
    return found


def slow_corpus(path: Path, megabytes: int = 200) -> Path:
    """JSONL of tiny records: about 80 s of tokenizing on 2 cores, in 2 MB of disk (one gzip member repeated:
    concatenated members are one valid gzip stream). A test stops it within seconds of starting."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    block = "".join(json.dumps({"text": f"{words[i % 12]} {i % 89}"}) + "\n" for i in range(50_000)).encode()
    member = gzip.compress(block)
    with open(path, "wb") as f:
        for _ in range(megabytes * 2**20 // len(block)):
            f.write(member)
    return path


# A model big enough that steps take tens of milliseconds, so a test can act mid-run.
HEAVIER = ["model=gpt-micro", "data.block_size=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8"]


def overrides(tmp_path, name, steps, every=10, extra=()):
    return [*SMALL, f"trainer.max_steps={steps}", f"snapshot.every={every}", f"snapshot.dir={tmp_path / name}",
            f"data.prepared_dir={tmp_path / 'prepared'}", *extra]


def assert_equal_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


# For jobs a test stops itself: they never finish on their own, however fast the machine, and keep
# every snapshot, so that two runs can be compared at any step both reached. Both runs of a
# comparison use the same max_steps: the learning-rate schedule depends on it.
ENDLESS_STEPS = 100_000_000
KEEP_ALL = ["snapshot.keep=1000"]


def run_until(procs, args, name, snap, step, timeout=180):
    """Start a job, wait until it has a snapshot of `step` or later, stop it as SLURM or torchrun
    would (SIGTERM: the workers finish the step, snapshot and exit), and wait for it to end."""
    job = procs.start(args, name)
    wait_for(lambda: latest_step(snap) >= step, timeout, f"{name}: a snapshot of step {step}", [job])
    stop(job)
    return job


def stop(job):
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=90)  # torchrun exits non-zero on SIGTERM (mingpt-torchrun 143); the workers' snapshot counts


def manifest_at(snap, step):
    return next(m for m in manifests(snap) if m["step"] == step)


class Reference:
    """A run of two workers (HEAVIER, every snapshot kept, every 10 steps), which the tests that disturb the same
    job compare with. One is shared by all the test processes of a session, under a lock: a test that needs a step
    it has not reached yet resumes it there (resuming at the same world size is bitwise, which tests of their own
    check), so no step is trained twice."""

    MARGIN = 20  # steps past the one asked for: the next test may need a few more, and each start costs seconds

    def __init__(self, root, procs):
        self.root, self.procs = root, procs

    def at(self, step: int):
        """The snapshot folder of the reference run, with a snapshot of `step`."""
        folder = self.root / "run"
        with open(self.root / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if latest_step(folder) < step:
                args = standalone(2) + overrides(self.root, "run", ENDLESS_STEPS, extra=[*HEAVIER, *KEEP_ALL])
                run_until(self.procs, args, f"run-to-{step}", folder, step + self.MARGIN)
            return folder
