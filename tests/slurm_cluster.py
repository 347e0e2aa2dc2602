"""A real Slurm of two nodes on this machine, for tests/test_slurm.py: munge, slurmctld and one slurmd per node,
all on 127.0.0.1 with free ports and a configuration in a folder of their own (../shared/DESIGN.md, "Slurm on one
machine"). Debian's packages are installed where they are missing (root, apt-get).

Every process the cluster starts, and every process Slurm starts for its jobs (found by the SLURM_CONF in their
environment), is ended by PID when it stops, pass or fail.

    python tests/slurm_cluster.py FOLDER    # brings one up for trying things by hand, until Ctrl-C
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import free_port

log = logging.getLogger(__name__)

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "mungekey")
NODES = ("mingpt-slurm-a", "mingpt-slurm-b")
HOSTS_LINE = "127.0.0.1 " + " ".join(NODES) + "  # tests/slurm_cluster.py: the test cluster's nodes\n"
KILL_WAIT_S = 15  # Slurm's notice between SIGTERM and SIGKILL at a job's end (scancel, requeue); its default is 30
SLURMD_TIMEOUT_S = 10  # how soon a silent slurmd's node is set DOWN

CONFIG = """\
ClusterName=mingpt-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge}/socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
KillWait={kill_wait}
InactiveLimit=0
MinJobAge=300
JobRequeue=1
SchedulerParameters=sched_interval=1
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
NODE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=1000 State=UNKNOWN"


class SlurmUnavailable(Exception):
    """Slurm cannot be run here (not root, no apt-get): the reason, in one line."""


def install() -> None:
    """Install Debian's Slurm and munge where a command of theirs is missing."""
    if all(shutil.which(command) for command in COMMANDS):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root: "
                               f"apt-get install {' '.join(PACKAGES)}")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable(f"Slurm is not installed and there is no apt-get to install {' '.join(PACKAGES)}")
    quiet = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(command, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, check=False, **quiet)
        if done.returncode:
            raise SlurmUnavailable(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}")


def name_the_nodes(hosts: Path = Path("/etc/hosts")) -> None:
    """The node names resolve to 127.0.0.1: the batch script reaches the first node by its name. The line stays
    (another session's cluster may use it)."""
    try:
        if all(socket.gethostbyname(name) == "127.0.0.1" for name in NODES):
            return
    except OSError:
        pass
    with open(hosts, "a") as f:
        f.write(HOSTS_LINE)


class Cluster:
    """Slurm on this machine, configured in `folder`: `start()`, then `sbatch`, `scontrol`..., then `stop()`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        # munged wants every folder above its socket open to all, which pytest's temporary folders are not
        self.munge = Path(tempfile.mkdtemp(prefix="mingpt-munge-"))
        self.munge.chmod(0o755)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of Slurm's commands, which jobs inherit (sbatch's --export=ALL)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def start(self) -> None:
        """Write the configuration, start the daemons, and wait until both nodes are idle."""
        install()
        name_the_nodes()
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._start("munged", ["munged", "-F", f"--socket={self.munge}/socket",
                               f"--key-file={self._munge_key()}", f"--pid-file={self.folder}/munged.pid",
                               f"--log-file={self.folder}/munged.log", f"--seed-file={self.folder}/munged.seed"])
        self._wait(lambda: (self.munge / "socket").exists(), 20, "munged's socket")
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for name in NODES:
            self.start_node(name)
        self._wait(lambda: self.idle_nodes() == set(NODES), 60, "both nodes idle")

    def start_node(self, name: str) -> None:
        (self.folder / "spool" / name).mkdir(parents=True, exist_ok=True)
        self._start(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])

    def stop(self) -> None:
        """End every job, every process of theirs, and the daemons, by PID. slurmctld first: its slurmscriptd has the
        cluster's environment too, and where that was killed first, slurmctld's own stop waits 10 s for it."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user=root"], check=False)
        self._stop_daemon("slurmctld")
        for pid in self.job_processes():
            _kill(pid)
        for name in reversed(list(self.daemons)):
            self._stop_daemon(name)
        for pid in self.job_processes():  # started while the daemons stopped
            _kill(pid)
        shutil.rmtree(self.munge, ignore_errors=True)

    def _stop_daemon(self, name: str) -> None:
        proc = self.daemons.get(name)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def kill_node(self, name: str) -> None:
        """The node fails: its slurmd and every process of its jobs are SIGKILLed."""
        self.daemons[f"slurmd-{name}"].kill()
        self.daemons[f"slurmd-{name}"].wait(timeout=10)
        for pid in self.job_processes(node=name):
            _kill(pid)

    def job_processes(self, node: str | None = None) -> list[int]:
        """The PIDs of the processes Slurm started for this cluster's jobs (on `node` only, where given)."""
        wanted = [f"SLURM_CONF={self.conf}".encode()] + ([f"SLURMD_NODENAME={node}".encode()] if node else [])
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if all(item in environ for item in wanted) and int(entry.name) not in self._daemon_pids():
                found.append(int(entry.name))
        return found

    def run(self, args: list[str], check: bool = True, timeout: float = 60, environment: dict | None = None) -> str:
        """A Slurm command's output; its failure, with what it said, is an AssertionError where `check`."""
        done = subprocess.run(args, env=environment or self.env(), capture_output=True, text=True, timeout=timeout,
                              check=False)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def idle_nodes(self) -> set[str]:
        lines = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False).split()
        return {name for name, state in zip(lines[::2], lines[1::2]) if state == "idle"}

    def node_state(self, name: str) -> str:
        return self.run(["sinfo", "--noheader", "--Node", f"--nodes={name}", "--format=%t"]).strip()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, RestartCnt, ExitCode...)."""
        fields = {}
        for item in self.run(["scontrol", "--oneliner", "show", "job", job_id]).split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def _daemon_pids(self) -> set[int]:
        return {proc.pid for proc in self.daemons.values()}

    def _start(self, name: str, args: list[str]) -> None:
        with open(self.folder / f"{name}.out", "ab") as out:
            self.daemons[name] = subprocess.Popen(args, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True)

    def _munge_key(self) -> Path:
        key = self.folder / "munge.key"  # the system's own is the munge user's: munged run by root refuses it
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        return key

    def _write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(NODE.format(name=name, host=host, port=free_port()) for name in NODES)
        self.conf.write_text(CONFIG.format(host=host, munge=self.munge, ctld_port=free_port(), folder=self.folder,
                                           nodes=nodes, kill_wait=KILL_WAIT_S, slurmd_timeout=SLURMD_TIMEOUT_S))

    def _wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited {proc.returncode} while waiting for {what}:\n"
                                         f"{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        """The daemons' logs, the end of each."""
        parts = []
        for path in sorted(self.folder.glob("*.log")) + sorted(self.folder.glob("*.out")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through `finally`, as Ctrl-C
    cluster = Cluster(Path(sys.argv[1]).resolve())
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}  # Ctrl-C stops the cluster")
        signal.pause()
    finally:
        cluster.stop()
