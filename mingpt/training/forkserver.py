"""Warm workers: mingpt-torchrun's agent starts each worker by forking it from a server that has imported torch and
the trainer, instead of starting a Python that imports them again.

A worker's imports are seconds of CPU (torch, its compiler's modules, the trainer's), more than the first steps of
a small job. Every worker of every generation paid them: at every restart, on the CPUs the other nodes train on,
and while a node that joins keeps the others waiting. The server, one per agent, pays them once, and only in part:
it is a copy of the agent, which has imported torch already.

How the server comes to be and a worker starts:
1. `mingpt-torchrun` forks the server first thing (`Server.fork`), before it reads its arguments and before it
   starts any thread: a copy of the agent as it started. The copy waits until the job goes ahead (`Server.serve`),
   then imports what a worker imports while the agent meets the others, and listens on a Unix socket in the
   agent's own folder;
2. for each worker (`Server.start`, where torch's launcher would start a Python), the agent sends the command's
   arguments, its environment and folder, and its standard streams (their file descriptors);
3. the server forks a child, which forks the worker and exits. The orphaned worker is adopted by the agent, its
   subreaper for that moment: the worker is the agent's child, as a started one would be (the agent waits for it,
   signals it and its session, and reads its exit status; when the agent dies, the worker is told);
4. the worker starts a session of its own, takes the streams, the environment and the folder, and runs the script
   as `python -u SCRIPT ARGS...` would, in the modules the server imported (`be_the_server`).

Where the server cannot serve (it was not forked: MINGPT_WARM_WORKERS=0, or threads ran already; it has ended; it
is not ready within SERVER_WAIT_S; the command is not `python -u SCRIPT`), the worker starts as torch starts it.
A forked worker shows the agent's command line and the server's environment in /proc (`ps` names it by its local
rank: launcher.name_this_worker). CUDA cannot cross a fork: the server does not serve if importing initialized it.
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import logging
import os
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from mingpt.processes import PR_SET_CHILD_SUBREAPER, PR_SET_NAME, prctl, signal_when_parent_dies

log = logging.getLogger(__name__)

SWITCH = "MINGPT_WARM_WORKERS"  # 0: every worker starts as a new Python, as under plain torchrun
SERVER_WAIT_S = 60.0  # how long the agent waits for the server to fork a worker (it may still be importing)
# What a worker of the trainer imports: torch's compiler is most of it (the optimizer and DDP import it).
WARM_MODULES = ("torch", "torch._dynamo", "hydra", "mingpt.training.app", "mingpt.training.trainer")
ADOPT_WAIT_S = 5.0  # how long a forked worker waits to be adopted by the agent (its forking child to exit)


# -- the agent's side ----------------------------------------------------------------------------------------


class Server:
    """The server an agent starts its workers from; `start` forks one, or says None (start it as torch would)."""

    def __init__(self, pid: int, orders: int | None = None, folder: Path | None = None):
        self.pid, self._orders, self.failed = pid, orders, False
        self.folder, self.path = folder, str(folder / "socket") if folder else None
        self._ended = False

    @classmethod
    def fork(cls) -> Server | None:
        """A copy of this process that waits for `serve`; None under MINGPT_WARM_WORKERS=0, and where threads run
        (a fork holds only this one: a lock another held would stay locked in the copy). The copy never returns:
        it ends when it is stopped, when this process ends, or, in a worker it forked, as the worker's script does
        (its SystemExit or exception leaves through the caller's frames, so nothing there may catch it)."""
        if os.environ.get(SWITCH) == "0" or threading.active_count() > 1 or not hasattr(os, "fork"):
            return None
        orders, agent_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(agent_end)
            _wait_for_orders(orders)  # returns only in a worker, once its script has run
            sys.exit(0)  # the script ran to its end: Python's exit (threads joined, exit functions run)
        os.close(orders)
        return cls(pid, agent_end)

    def serve(self, folder: Path, script: str) -> None:
        """Have the server import what a worker of `script` imports, and listen in `folder` (the agent's own)."""
        self.folder, self.path = folder, str(folder / "socket")
        orders, self._orders = self._orders, None
        try:
            with open(orders, "wb") as pipe:  # the server reads to the end
                pipe.write(json.dumps({"path": self.path, "script": script}).encode())
        except OSError as e:  # it has ended
            self.failed = True
            log.warning("mingpt-torchrun: workers start as new Pythons: their server has ended (%s)", e)

    def start(self, args: tuple, env: dict[str, str], stdout, stderr, cwd: str | None = None) -> Forked | None:
        """Fork the worker `args` (torch's command: python -u SCRIPT ARGS) with `env`, the streams (open files, or
        None: the agent's own) and `cwd` (else this process's folder), adopted by this process; None where the
        server cannot."""
        if self.failed or self.path is None or len(args) < 3 or args[0] != sys.executable or args[1] != "-u" \
                or args[2].startswith("-"):
            return None
        streams = [0, stdout.fileno() if stdout else 1, stderr.fileno() if stderr else 2]
        request = json.dumps({"argv": list(args[2:]), "env": env, "cwd": cwd or os.getcwd()}).encode()
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
                if self.has_ended() or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def has_ended(self) -> bool:
        if not self._ended:
            try:
                self._ended = os.waitpid(self.pid, os.WNOHANG)[0] != 0
            except ChildProcessError:  # reaped already, or not this process's child
                self._ended = True
        return self._ended

    def stop(self) -> None:
        if self._orders is not None:  # never told to serve: it ends as it reads nothing
            os.close(self._orders)
            self._orders = None
        if not self.has_ended():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._ended = True
        if self.folder is not None:
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


def _wait_for_orders(orders: int) -> None:
    """The forked server: wait for the agent's order, then serve (`be_the_server`). Nothing to read: the job did not
    go ahead, or the agent has ended. Returns only in a worker, once its script has run."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's: it stops the workers
        prctl(PR_SET_NAME, b"mingpt-server")
        with open(orders, "rb") as pipe:
            order = pipe.read()
    except BaseException:  # a Ctrl-C in the moment before it was ignored
        os._exit(1)
    if not order:
        os._exit(0)
    order = json.loads(order)
    be_the_server(order["path"], order["script"])


def be_the_server(path: str, script: str, modules: tuple[str, ...] = WARM_MODULES) -> None:
    """Import `modules`, then fork a worker for each request of this process's parent (the agent) on the socket
    `path`, until the parent ends. Returns only in a worker, once its script has run: the script's exit and
    exceptions are Python's own, and leave through the caller's frames."""
    try:
        request = serve(path, script, modules)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if request is None:
        os._exit(0)
    become_the_worker(request)
    runpy.run_path(sys.argv[0], run_name="__main__")


def serve(path: str, script: str, modules: tuple[str, ...]) -> dict | None:
    """Import `modules` as a worker of `script` would, then fork a worker for each request of the agent, for ever.
    Returns only in a worker (its request), or None where it cannot serve."""
    agent = os.getppid()
    if not signal_when_parent_dies(signal.SIGKILL):
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's: it stops the workers
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # in the agent's own folder (0700)
    listener.listen()
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # where a worker imports from, as `python SCRIPT`
    for module in modules:
        importlib.import_module(module)
    if cuda_touched(Path("/proc/self/maps").read_text()):
        log.warning("mingpt-torchrun: importing the trainer initialized CUDA, which a fork cannot carry: "
                    "workers start as new Pythons")
        return None
    gc.freeze()  # what the imports made is never garbage: a worker's collections skip it, and leave its pages shared
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
    prctl(PR_SET_NAME, os.path.basename(sys.executable)[:15].encode())  # a Python's name, until the script's own
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
