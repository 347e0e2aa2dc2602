"""Warm workers: mingpt-torchrun's agent starts each worker by forking it from a server that has imported
torch and the trainer already, instead of starting a Python that imports them again.

A worker's imports are seconds of CPU (torch, its compiler's modules, the trainer's), more than the first
steps of a small job. Every worker of every generation paid them: at every restart, on the CPUs the other
nodes train on, and while a node that joins keeps the others waiting. The server (one per agent, started once
the job goes ahead, so that its imports overlap the rendezvous) pays them once.

How a worker starts (`Server.start`, in the agent, where torch's launcher would start a Python):
1. the agent sends the command's arguments, its environment and folder, and its standard streams (their file
   descriptors) over a Unix socket in the agent's own folder;
2. the server forks a child, which forks the worker and exits. The orphaned worker is adopted by the agent,
   its subreaper for that moment: the worker is the agent's child, as a started one would be (the agent waits
   for it, signals it and its session, and reads its exit status; when the agent dies, the worker is told);
3. the worker starts a session of its own, takes the streams, the environment and the folder, and runs the
   script as `python -u SCRIPT ARGS...` would, in the modules the server imported.

Where the server cannot serve (it has ended, it is not ready within SERVER_WAIT_S, the command is not
`python -u SCRIPT`), or under MINGPT_WARM_WORKERS=0, the worker starts as torch starts it. A forked worker
shows the server's command line and environment in /proc (`ps` names it by its local rank:
launcher.name_this_worker). CUDA cannot cross a fork: the server does not serve if importing initialized it.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from mingpt.processes import PR_SET_CHILD_SUBREAPER, prctl, signal_when_parent_dies

log = logging.getLogger(__name__)

SWITCH = "MINGPT_WARM_WORKERS"  # 0: every worker starts as a new Python, as under plain torchrun
SERVER_WAIT_S = 60.0  # how long the agent waits for the server to fork a worker (it may still be importing)
# What a worker of the trainer imports: torch's compiler is most of it (the optimizer and DDP import it).
WARM_MODULES = ("torch", "torch._dynamo", "hydra", "mingpt.training.app", "mingpt.training.trainer")
ADOPT_WAIT_S = 5.0  # how long a forked worker waits to be adopted by the agent (its forking child to exit)


# -- the agent's side ----------------------------------------------------------------------------------------


class Server:
    """The server an agent starts its workers from; `start` forks one, or says None (start it as torch would)."""

    def __init__(self, folder: Path, script: str):
        self.folder, self.path = folder, str(folder / "socket")
        self.process = subprocess.Popen([sys.executable, "-m", __name__, self.path, script],
                                        stdin=subprocess.DEVNULL)
        self.failed = False

    def start(self, args: tuple, env: dict[str, str], stdout, stderr) -> Forked | None:
        """Fork the worker `args` (torch's command: python -u SCRIPT ARGS) with `env` and the streams (open
        files, or None: the agent's own), adopted by this process; None where the server cannot."""
        if self.failed or len(args) < 3 or args[0] != sys.executable or args[1] != "-u" or args[2].startswith("-"):
            return None
        streams = [0, stdout.fileno() if stdout else 1, stderr.fileno() if stderr else 2]
        request = json.dumps({"argv": list(args[2:]), "env": env, "cwd": os.getcwd()}).encode()
        if not prctl(PR_SET_CHILD_SUBREAPER, 1):  # not Linux: the worker could not be adopted
            return None
        try:
            with self._connect() as conn:
                socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], streams)
                conn.shutdown(socket.SHUT_WR)
                reply = _read_all(conn)  # the end comes once the forking child has exited: the worker is ours
            pid = int(reply)
        except (OSError, ValueError) as e:
            self.failed = True
            log.warning("mingpt-torchrun: workers start as new Pythons: their server does not answer (%s)", e)
            return None
        finally:
            prctl(PR_SET_CHILD_SUBREAPER, 0)
        return Forked(pid, args)

    def _connect(self) -> socket.socket:
        """A connection to the server, which may still be starting (its socket not there yet)."""
        deadline = time.monotonic() + SERVER_WAIT_S
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(SERVER_WAIT_S)
            try:
                conn.connect(self.path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class Forked:
    """A worker forked by the server and adopted by this process: what torch's launcher uses of a Popen."""

    def __init__(self, pid: int, args: tuple):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(list(self.args), timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


# -- the server's side -----------------------------------------------------------------------------------------


def serve(path: str, script: str) -> dict:
    """Import what a worker of `script` imports, then fork a worker for each request of the agent, for ever.
    Returns only in a worker: its request."""
    agent = os.getppid()
    if not signal_when_parent_dies(signal.SIGKILL):
        sys.exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's: it stops the workers
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # in the agent's own folder (0700)
    listener.listen()
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # where a worker imports from, as `python SCRIPT`
    for module in WARM_MODULES:
        importlib.import_module(module)
    if cuda_touched(Path("/proc/self/maps").read_text()):
        log.warning("mingpt-torchrun: importing the trainer initialized CUDA, which a fork cannot carry: "
                    "workers start as new Pythons")
        sys.exit(0)
    while True:
        conn, _ = listener.accept()
        with conn:
            if _peer(conn)[0] != agent:  # only the agent asks
                continue
            try:
                request, streams = _receive(conn)
            except (OSError, ValueError) as e:  # cut short: the agent died while asking (the server dies with it)
                log.debug("a request that could not be read: %s", e)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            middle = os.fork()
            if middle == 0:
                listener.close()
                middle = os.getpid()
                worker = os.fork()
                if worker == 0:
                    conn.close()
                    return {**request, "streams": streams, "middle": middle}
                conn.sendall(str(worker).encode())
                os._exit(0)
            os.waitpid(middle, 0)
            for fd in streams:
                os.close(fd)


def cuda_touched(maps: str) -> bool:
    """Whether this process has initialized CUDA: torch's own state, or the driver library loaded (which asking
    for the device count does, while torch still calls CUDA uninitialized). `maps`: /proc/self/maps."""
    torch = sys.modules.get("torch")
    return bool(torch and torch.cuda.is_initialized()) or "/libcuda.so" in maps


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    """The pid, uid and gid of the process at the other end of `conn`."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, streams, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(streams) != 3:
        for fd in streams:
            os.close(fd)
        raise ValueError(f"{len(streams)} streams, not 3")
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    return json.loads(data[8:]), streams


def become_the_worker(request: dict) -> None:
    """In the forked worker: wait to be the agent's, then take the request's session, streams, signals,
    environment, folder and arguments, as a Python started with them would have them."""
    deadline = time.monotonic() + ADOPT_WAIT_S
    while os.getppid() == request["middle"] and time.monotonic() < deadline:  # until the forking child exits
        time.sleep(0.001)
    os.setsid()
    for target, fd in enumerate(request["streams"]):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it as the server imported it
        import torch

        torch.set_num_threads(int(threads))
    for name in ("stdout", "stderr"):  # unbuffered, as python -u makes them
        stream = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False), encoding=stream.encoding,
                                            errors=stream.errors, write_through=True))
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))


if __name__ == "__main__":
    job = serve(sys.argv[1], sys.argv[2])
    become_the_worker(job)
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")  # its exit, exceptions and signals are Python's own
