"""The server that mingpt-torchrun forks its workers from (mingpt.launch.forkserver): a real server process,
serving this test process as it serves an agent, forking real workers that this process adopts; and the server of
a real mingpt-torchrun."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import launch
import pytest
from launch import BIN, env, output
from torch.distributed import run

from mingpt.launch.forkserver import Server, cannot_fork, other_threads
from mingpt.launch.node import warm_workers

pytestmark = pytest.mark.multiproc

SCRIPT = """\
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "rank", os.environ.get("RANK"), "path0", sys.path[0])
print("parent", os.getppid(), "session", os.getsid(0), "own", os.getpid(), "torch", "torch" in sys.modules)
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise RuntimeError("the script failed")
if how == "wait":
    import time
    time.sleep(60)
sys.exit(int(how))
"""


@pytest.fixture
def server(tmp_path):
    script = tmp_path / "scripts" / "work.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    environment = {k: v for k, v in env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # which its imports set
    with theirs:
        serving = subprocess.Popen([sys.executable, "-c", "import socket, sys; from mingpt.launch import forkserver; "
                                    "forkserver.be_the_server(socket.socket(fileno=int(sys.argv[1])), sys.argv[2])",
                                    str(theirs.fileno()), str(script)], env=environment, stdin=subprocess.DEVNULL,
                                   pass_fds=[theirs.fileno()])
    started = Server(serving.pid, ours, environment)
    yield started, script
    started.stop()
    serving.wait()


def start(server, script, how: str, tmp_path: Path, env=None):
    out, err = (open(tmp_path / f"{how}.{name}", "w") for name in ("out", "err"))
    with out, err:
        return server.start((sys.executable, "-u", str(script), how), env or {**launch.env(), "RANK": "3"}, out, err)


def test_a_worker_is_forked_warm_with_its_arguments_streams_and_environment_and_adopted_by_the_agent(
        server, tmp_path, monkeypatch):
    server, script = server
    monkeypatch.chdir(tmp_path)
    worker = start(server, script, "3", tmp_path)
    assert worker is not None
    assert worker.wait(timeout=60) == 3
    out = (tmp_path / "3.out").read_text().split()
    assert out[:out.index("rank")] == ["argv", "['3']", "cwd", str(tmp_path)]
    assert out[out.index("rank") + 1] == "3" and out[out.index("path0") + 1] == str(script.parent)
    fields = dict(zip(out[out.index("parent")::2], out[out.index("parent") + 1::2]))
    assert fields["parent"] == str(os.getpid())  # adopted: this process waits for it, as for a started one
    assert fields["session"] == fields["own"] == str(worker.pid)  # a session of its own, as torch starts one
    assert fields["torch"] == "True"  # imported in the server, before the fork
    assert (tmp_path / "3.err").read_text() == "to stderr\n"


def test_exits_exceptions_and_signals_end_a_forked_worker_as_they_end_a_python(server, tmp_path):
    server, script = server
    assert start(server, script, "0", tmp_path).wait(timeout=60) == 0
    failed = start(server, script, "raise", tmp_path)
    assert failed.wait(timeout=60) == 1
    assert (tmp_path / "raise.err").read_text().splitlines()[-1] == "RuntimeError: the script failed"
    waiting = start(server, script, "wait", tmp_path)
    with pytest.raises(Exception) as timed_out:
        waiting.wait(timeout=0.5)
    assert type(timed_out.value).__name__ == "TimeoutExpired"
    os.killpg(waiting.pid, signal.SIGTERM)  # as torch's launcher stops a worker: its session
    assert waiting.wait(timeout=60) == -signal.SIGTERM


def test_a_server_that_has_ended_leaves_workers_to_be_started_as_usual(server, tmp_path, caplog):
    server, script = server
    server.stop()
    assert start(server, script, "0", tmp_path) is None
    assert start(server, script, "0", tmp_path) is None
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith(
        "mingpt-torchrun: workers start as new Pythons: their server does not answer ("), said


def test_other_commands_are_left_to_torch(server, tmp_path):
    server, script = server
    assert server.start(("/bin/true",), {}, None, None) is None
    assert server.start((sys.executable, "-u", "-m", "json.tool"), {}, None, None) is None
    assert not server.failed


def test_a_worker_whose_environment_is_not_the_one_the_server_imported_under_starts_as_a_new_python(
        server, tmp_path, caplog):
    """What the server's imports read from the environment (torch's, Inductor's, Hugging Face's settings) would not
    be what a new Python's imports read: only torchrun's own variables for each worker may differ, and those the
    imports set, to the value they set."""
    server, script = server
    assert start(server, script, "0", tmp_path, {**launch.env(), "TORCH_LOGS": "dynamo"}) is None
    assert start(server, script, "0", tmp_path, {k: v for k, v in launch.env().items() if k != "HOME"}) is None
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == ["mingpt-torchrun: a worker starts as a new Python: its environment is not the one its server "
                    "imported under (TORCH_LOGS)"]  # once, naming the variables, never their values
    assert start(server, script, "4", tmp_path).wait(timeout=60) == 4  # and the others are forked
    inductor = server.imports_set["TORCHINDUCTOR_CACHE_DIR"]  # Inductor names its cache folder as it is imported
    assert start(server, script, "5", tmp_path, {**launch.env(), "TORCHINDUCTOR_CACHE_DIR": inductor}).wait(60) == 5
    assert start(server, script, "6", tmp_path, {**launch.env(), "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}) is None


def test_the_server_listens_on_no_path_that_another_process_could_reach(server, tmp_path):
    """The agent and its server talk over a socket pair made before the fork: no other process of any user can
    connect to the server, or pose as it, through the file system."""
    server, script = server
    assert start(server, script, "0", tmp_path).wait(timeout=60) == 0  # the server serves
    sockets = {os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")}
    inodes = {link[len("socket:["):-1] for link in sockets if link.startswith("socket:[")}
    assert inodes  # its end of the pair
    with open("/proc/net/unix") as table:
        named = [line.split() for line in table.read().splitlines()[1:] if len(line.split()) > 7]
    assert [fields[7] for fields in named if fields[6] in inodes] == []


class Unforked:
    """What warm_workers asks of a server, recorded."""

    def __init__(self):
        self.scripts = []

    def serve(self, script: str) -> None:
        self.scripts.append(script)


def test_no_server_under_mingpt_warm_workers_0_nor_for_commands_that_are_no_python_script(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    unforked = Unforked()
    for argv in (["--no-python", "true"], ["-m", "json.tool"], [str(tmp_path / "missing.py")]):
        assert warm_workers(run.parse_args(argv), unforked) is None
    assert warm_workers(run.parse_args([str(script)]), unforked) is unforked and unforked.scripts == [str(script)]
    monkeypatch.setenv("MINGPT_WARM_WORKERS", "0")
    assert fork_stopped() is None


def test_no_server_is_forked_while_another_thread_runs():
    """A fork holds only the thread that forked: a lock another thread held would stay locked in the copy."""
    waiting = threading.Event()
    thread = threading.Thread(target=waiting.wait)
    thread.start()
    try:
        assert fork_stopped() is None
    finally:
        waiting.set()
        thread.join()


def fork_stopped() -> Server | None:
    """Server.fork(), stopped at once where it forked."""
    server = Server.fork()
    if server is not None:
        server.stop()
    return server


WHO = """\
import json, os, sys
from pathlib import Path

def parent_and_name(pid):
    try:  # one read: the process may end while the others are looked at
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None, None
    return int(stat.rsplit(")", 1)[1].split()[1]), stat[stat.index("(") + 1:stat.rindex(")")]

agent = os.getppid()
servers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
           and parent_and_name(p.name) == (agent, "mingpt-server")]
command = lambda pid: Path(f"/proc/{pid}/cmdline").read_text()
print("who", json.dumps({"agent": agent, "servers": servers, "torch": "torch" in sys.modules,
                         "same_command": command("self") == command(agent)}))
"""


def test_mingpt_torchrun_forks_its_workers_from_a_copy_of_itself_which_ends_with_it(procs, tmp_path):
    """The server is a copy of the agent as it started (torch imported, no new Python run): a worker has the agent's
    command line and torch before its script imports it, and is the agent's child. The server ends with the agent.
    mingpt-torchrun starts here as users start it, a new Python (not forked from the tests' warm one): the product's
    own start-up path, its server's imports included."""
    script = tmp_path / "who.py"
    script.write_text(WHO)
    job = procs.start([str(BIN / "mingpt-torchrun"), "--standalone", "--nproc-per-node=1", "--max-restarts=0",
                       str(script)], "job", environment=env())
    assert job.wait(timeout=120) == 0, output(job)
    [line] = [line for line in output(job).splitlines() if line.startswith("who ")]
    who = json.loads(line[4:])
    assert who["agent"] == job.pid and who["same_command"] and who["torch"]
    [server] = who["servers"]
    assert not Path(f"/proc/{server}").exists()


def test_a_server_whose_imports_touched_cuda_or_started_a_thread_does_not_fork():
    """A fork cannot carry CUDA: asking for the device count loads the driver while torch still calls CUDA
    uninitialized, so the server looks for the library among its mappings too. A fork holds one thread: another's
    locks would stay held in the worker."""
    untouched = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libtorch_cuda.so\n7f20-7f30 r-xp 0 08:01 2 /usr/lib/libcudart.so.12\n"
    assert cannot_fork(untouched, threads=[]) is None
    assert cannot_fork(untouched + "7f40-7f50 r-xp 0 08:01 3 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n", []) == \
        "initialized CUDA, which a fork cannot carry"
    assert cannot_fork(untouched, threads=["OpenBLAS", "telemetry"]) == "started 2 thread(s) (OpenBLAS, telemetry), " \
        "whose locks a fork would copy held"
    assert cannot_fork(Path("/proc/self/maps").read_text(), []) is None  # this process: torch imported, no GPU used


def test_the_threads_of_a_process_are_named_by_python_or_else_by_the_kernel():
    waiting = threading.Event()
    thread = threading.Thread(target=waiting.wait, name="an-import's")
    thread.start()
    try:
        assert "an-import's" in other_threads()
    finally:
        waiting.set()
        thread.join()
