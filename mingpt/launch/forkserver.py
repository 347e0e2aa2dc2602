"""Warm workers: mingpt-torchrun's agent forks each worker from a server that has imported torch and the trainer,
instead of starting a Python that imports them again (at every restart, and while a joining node keeps others waiting).

`mingpt-torchrun` forks the server before any thread starts (`Server.fork`), joined by a socket pair no other process
can reach; it imports while the agent meets the others (`Server.serve`). For each worker (`Server.start`) it forks a
child that forks the worker and exits, so the agent (subreaper for that moment) adopts it as its own child. A worker
starts as a new Python wherever a fork would differ from one (CUDA initialized, a thread started, the environment
changed, no answer within SERVER_WAIT_S). See docs/launching.md."""

from __future__ import annotations

import builtins
import gc
import importlib
import importlib.machinery
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Callable

from mingpt.jobenv import WARM_WORKERS
from mingpt.processes import PR_SET_CHILD_SUBREAPER, PR_SET_NAME, prctl, signal_when_parent_dies

log = logging.getLogger(__name__)

SERVER_WAIT_S = 60.0  # how long the agent waits for the server to fork a worker (it may still be importing)
# torch's compiler is most of a worker's imports (the optimizer and DDP import it).
WARM_MODULES = ("torch", "torch._dynamo", "hydra", "mingpt.training.app", "mingpt.training.trainer")
ADOPT_WAIT_S = 5.0  # how long a forked worker waits to be adopted by the agent (its forking child to exit)
MESSAGE_LIMIT = 1 << 24  # bytes of a request (a worker's arguments and environment)
# What the launcher gives each worker: read as code runs, not as it imports (the worker applies OMP_NUM_THREADS
# itself), so a forked worker may differ from its server in these alone.
PER_WORKER = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                        "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"})
PER_WORKER_PREFIXES = ("TORCHELASTIC_", "MINGPT_")


def per_worker(name: str) -> bool:
    """Whether the environment variable `name` is one the launcher gives each worker (PER_WORKER)."""
    return name in PER_WORKER or name.startswith(PER_WORKER_PREFIXES)


class Server:
    """The server an agent forks its workers from; `may_differ`: the variables no import reads."""

    def __init__(self, pid: int, channel: socket.socket, environment: dict[str, str] | None = None,
                 may_differ: Callable[[str], bool] = per_worker):
        self.pid, self._channel, self.failed, self.may_differ = pid, channel, False, may_differ
        channel.settimeout(SERVER_WAIT_S)  # the server may still be importing when the first worker is asked for
        self.environment = environment  # what the server imported under; None until told to serve
        self.imports_set: dict[str, str | None] | None = None  # what its imports set there, once it said so
        self._ended = self._told = False
        self._asking = threading.Lock()  # one request at a time on the channel

    @classmethod
    def fork(cls) -> Server | None:
        """A copy of this process that waits for `serve`; None under MINGPT_WARM_WORKERS=0, and where threads run (their
        locks would stay held in the copy). The copy never returns, but in a worker it forked, whose script's SystemExit
        or exception leaves through the caller's frames: nothing there may catch it."""
        if os.environ.get(WARM_WORKERS) == "0" or threading.active_count() > 1 or not hasattr(os, "fork"):
            return None
        agent_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            agent_end.close()
            _wait_for_orders(server_end)  # returns only in a worker, once its script has run
            sys.exit(0)  # the script ran to its end: Python's exit (threads joined, exit functions run)
        server_end.close()
        return cls(pid, agent_end)

    def serve(self, script: str) -> None:
        """Have the server import what a worker of `script` imports, under this process's environment as it is now."""
        self.environment = dict(os.environ)
        try:
            _send(self._channel, {"script": script, "env": self.environment})
        except OSError as e:  # it has ended
            self._give_up(f"their server has ended ({e})")

    def start(self, args: tuple, env: dict[str, str], stdout, stderr, cwd: str | None = None) -> Forked | None:
        """Fork the worker `args` (python -u SCRIPT ARGS), adopted by this process; None where the server cannot."""
        if self.failed or self.environment is None or len(args) < 3 or args[0] != sys.executable \
                or args[1] != "-u" or args[2].startswith("-"):
            return None
        streams = [0, stdout.fileno() if stdout else 1, stderr.fileno() if stderr else 2]
        request = {"argv": list(args[2:]), "env": env, "cwd": cwd or os.getcwd()}
        with self._asking:
            if not self._serves() or not self._imported_under(env) or not prctl(PR_SET_CHILD_SUBREAPER, 1):
                return None  # (no prctl: not Linux, where the worker could not be adopted)
            try:
                _send(self._channel, request, streams)
                pid = int.from_bytes(_read_exactly(self._channel, 8), "big")  # once the forking child has exited
                if pid <= 0:
                    raise ConnectionError("it could not fork")
            except OSError as e:  # ended, or silent for SERVER_WAIT_S (TimeoutError)
                self._give_up(f"their server does not answer ({e})")
                return None
            finally:
                prctl(PR_SET_CHILD_SUBREAPER, 0)
        return Forked(pid, args)

    def _serves(self) -> bool:
        """Whether the server serves: what it said once its imports were done (read at the first worker's start)."""
        if self.imports_set is None and not self.failed:
            try:
                said = _receive(self._channel)
            except (OSError, ValueError) as e:  # ended, or silent for SERVER_WAIT_S (TimeoutError)
                said = ({"cannot": f"their server does not answer ({e})"}, [])
            said = said[0] if said is not None else {"cannot": "their server has ended"}
            if "cannot" in said:
                self._give_up(said["cannot"])
            self.imports_set = said.get("imports_set")
        return not self.failed

    def _imported_under(self, env: dict[str, str]) -> bool:
        """Whether `env` differs from what the server imported under only where `may_differ` allows or the imports set
        the worker's value. Else one warning names the variables (not their values: they may be secret)."""
        imported = {**self.environment, **self.imports_set}
        changed = sorted(name for name in imported.keys() | env.keys()
                         if env.get(name) not in (self.environment.get(name), imported.get(name))
                         and not self.may_differ(name))
        if changed and not self._told:
            log.warning("mingpt-torchrun: a worker starts as a new Python: its environment is not the one its server "
                        "imported under (%s)", ", ".join(changed))
            self._told = True
        return not changed

    def _give_up(self, why: str) -> None:
        self.failed = True
        log.warning("mingpt-torchrun: workers start as new Pythons: %s", why)

    def has_ended(self) -> bool:
        if not self._ended:
            try:
                self._ended = os.waitpid(self.pid, os.WNOHANG)[0] != 0
            except ChildProcessError:  # reaped already, or not this process's child
                self._ended = True
        return self._ended

    def stop(self) -> None:
        self._channel.close()  # a server never told to serve ends as it reads nothing
        if not self.has_ended():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._ended = True


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


# -- messages on the channel: a length, a JSON object, and file descriptors with the length --------------------


def _send(channel: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(channel, [len(data).to_bytes(8, "big")], list(fds))
    channel.sendall(data)


def _receive(channel: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]] | None:
    """The next message and its descriptors; None where the other end has closed."""
    head, fds, _, _ = socket.recv_fds(channel, 8, max_fds)
    if not head:
        return None
    try:
        size = int.from_bytes(head + _read_exactly(channel, 8 - len(head)), "big")
        if size > MESSAGE_LIMIT:
            raise ValueError(f"a message of {size} bytes")
        return json.loads(_read_exactly(channel, size)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_exactly(channel: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = channel.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"the other end closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def _wait_for_orders(channel: socket.socket) -> None:
    """The forked server: wait for the agent's order, then serve. Returns only in a worker, once its script has run."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's: it stops the workers
        prctl(PR_SET_NAME, b"mingpt-server")
        close_inherited(keep=channel.fileno())  # the agent's own (a worker started by torch has none of them)
        order = _receive(channel)
    except BaseException:  # a Ctrl-C in the moment before it was ignored; a message cut short
        os._exit(1)
    if order is None:
        os._exit(0)
    be_the_server(channel, order[0]["script"], environment=order[0]["env"])


def close_inherited(keep: int) -> None:
    """Close every descriptor above the standard streams but `keep`."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, closed as it ended
                pass


def be_the_server(channel: socket.socket, script: str, modules: tuple[str, ...] = WARM_MODULES,
                  environment: dict[str, str] | None = None) -> None:
    """Import `modules`, then fork a worker per request. Returns only in a worker, once its script has run."""
    try:
        request = serve(channel, script, modules, environment)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if request is None:
        os._exit(0)
    become_the_worker(request)
    run_as_main(os.path.abspath(sys.argv[0]))


def run_as_main(path: str) -> None:
    """Run the script as `python PATH` does, in a new `__main__` (runpy's differs: a package of '' and no loader)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __annotations__={},
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with io.open_code(path) as script:
        code = compile(script.read(), path, "exec")
    exec(code, main.__dict__)


def serve(channel: socket.socket, script: str, modules: tuple[str, ...],
          environment: dict[str, str] | None = None) -> dict | None:
    """Returns only in a worker (its request), or None where it cannot serve, or the other end has closed."""
    if not signal_when_parent_dies(signal.SIGKILL):
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's: it stops the workers
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # where a worker imports from, as `python SCRIPT`
    before = dict(os.environ)
    for module in modules:
        importlib.import_module(module)
    # What the imports set in the environment (Inductor its cache folder), as they would in a worker's environment.
    imports_set = {name: os.environ.get(name) for name in before.keys() | os.environ.keys()
                   if os.environ.get(name) != before.get(name)}
    if why := cannot_fork(Path("/proc/self/maps").read_text(), other_threads()):
        _send(channel, {"cannot": f"importing the trainer {why}"})
        return None
    _send(channel, {"imports_set": imports_set})
    gc.freeze()  # what the imports made is never garbage: a worker's collections skip it, and leave its pages shared
    while True:
        try:
            received = _receive(channel, max_fds=3)
        except (OSError, ValueError) as e:  # cut short: the agent died while asking (the server dies with it)
            log.debug("a request that could not be read: %s", e)
            return None
        if received is None:
            return None
        request, streams = received
        if len(streams) != 3:
            for fd in streams:
                os.close(fd)
            return None
        if _fork_a_worker(channel):
            return {**request, "streams": streams, "imports_set": imports_set}
        for fd in streams:
            os.close(fd)


def _fork_a_worker(channel: socket.socket) -> bool:
    """True in the worker, once the agent has adopted it; False in the server, which tells the agent its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    reader, writer = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(reader)
        middle = os.getpid()
        worker = os.fork()
        if worker == 0:
            os.close(writer)
            channel.close()
            deadline = time.monotonic() + ADOPT_WAIT_S
            while os.getppid() == middle and time.monotonic() < deadline:
                time.sleep(0.001)
            return True
        os.write(writer, str(worker).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        worker = int(pipe.read() or 0)
    os.waitpid(middle, 0)  # once the forking child is gone, its child is the agent's
    channel.sendall(worker.to_bytes(8, "big"))
    return False


def cannot_fork(maps: str, threads: list[str]) -> str | None:
    """Why this process cannot fork a worker (None: it can). A fork cannot carry CUDA (torch's state, or just the driver
    library, which the device count loads); nor other threads, whose locks would stay held in the worker."""
    torch = sys.modules.get("torch")
    if bool(torch and torch.cuda.is_initialized()) or "/libcuda.so" in maps:
        return "initialized CUDA, which a fork cannot carry"
    if threads:
        return f"started {len(threads)} thread(s) ({', '.join(threads)}), whose locks a fork would copy held"
    return None


def other_threads() -> list[str]:
    """The names of this process's threads but this one: Python's name for a thread of its own, else the kernel's."""
    named = {thread.native_id: thread.name for thread in threading.enumerate()}
    names = []
    for task in os.listdir("/proc/self/task"):
        if int(task) != threading.get_native_id():
            try:
                names.append(named.get(int(task)) or Path(f"/proc/self/task/{task}/comm").read_text().strip())
            except OSError:  # it ended meanwhile
                pass
    return names


def become_the_worker(request: dict) -> None:
    """In the forked worker: take what a Python started with the request would have."""
    os.setsid()
    prctl(PR_SET_NAME, os.path.basename(sys.executable)[:15].encode())  # a Python's name, until the script's own
    for target, fd in enumerate(request["streams"]):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, value in request["imports_set"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it as the server imported it
        import torch

        torch.set_num_threads(int(threads))
    draw_new_seeds()
    for name in ("stdout", "stderr"):  # unbuffered, as python -u makes them
        stream = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False), encoding=stream.encoding,
                                            errors=stream.errors, write_through=True))
    sys.argv = request["argv"]
    sys.orig_argv = [sys.executable, "-u", *sys.argv]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))


def draw_new_seeds() -> None:
    """Numpy's and torch's global generators seeded anew, as a new Python's are (`random` does so after a fork)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].random.default_generator.seed()
