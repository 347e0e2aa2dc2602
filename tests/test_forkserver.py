"""The server that mingpt-torchrun forks its workers from (mingpt.training.forkserver): a real server process,
serving this test process as it serves an agent, forking real workers that this process adopts; and the server of
a real mingpt-torchrun."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.distributed import run

from launch import BIN, output
from mingpt.cli.torchrun import warm_workers
from mingpt.training.forkserver import Server, cuda_touched

pytestmark = pytest.mark.multiproc

SCRIPT = """\
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "color", os.environ.get("COLOR"), "path0", sys.path[0])
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
    folder = tmp_path / "server"
    folder.mkdir(mode=0o700)
    script = tmp_path / "scripts" / "work.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    serving = subprocess.Popen([sys.executable, "-c", "import sys; from mingpt.training import forkserver; "
                                "forkserver.be_the_server(*sys.argv[1:])", str(folder / "socket"), str(script)],
                               stdin=subprocess.DEVNULL)
    started = Server(serving.pid, folder=folder)
    yield started, script
    started.stop()
    serving.wait()


def start(server, script, how: str, tmp_path: Path, env=None):
    out, err = (open(tmp_path / f"{how}.{name}", "w") for name in ("out", "err"))
    with out, err:
        return server.start((sys.executable, "-u", str(script), how), env or {"COLOR": "green"}, out, err)


def test_a_worker_is_forked_warm_with_its_arguments_streams_and_environment_and_adopted_by_the_agent(
        server, tmp_path, monkeypatch):
    server, script = server
    monkeypatch.chdir(tmp_path)
    worker = start(server, script, "3", tmp_path)
    assert worker is not None
    assert worker.wait(timeout=60) == 3
    out = (tmp_path / "3.out").read_text().split()
    assert out[:out.index("color")] == ["argv", "['3']", "cwd", str(tmp_path)]
    assert out[out.index("color") + 1] == "green" and out[out.index("path0") + 1] == str(script.parent)
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


def test_only_the_agent_may_ask_the_server(server, tmp_path):
    """Another process of this user's reaching the socket gets nothing forked."""
    server, script = server
    assert start(server, script, "0", tmp_path).wait(timeout=60) == 0  # the server is ready
    request = json.dumps({"argv": [str(script), "5"], "env": {}, "cwd": str(tmp_path)}).encode()  # a valid one
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # not the server's parent
        answer = b""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(server.path)
                socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
                conn.shutdown(socket.SHUT_WR)
                answer = conn.recv(100)
        except OSError:  # closed with the request unread (a reset, a broken pipe)
            pass
        finally:
            os.write(writer, answer or b"nothing")
            os._exit(0)
    os.close(writer)
    assert os.read(reader, 100) == b"nothing"
    os.waitpid(child, 0)
    assert start(server, script, "4", tmp_path).wait(timeout=60) == 4  # and the server goes on


class Unforked:
    """What warm_workers asks of a server, recorded; the folder it is given removed, as a server's stop removes it."""

    def __init__(self):
        self.scripts = []

    def serve(self, folder: Path, script: str) -> None:
        self.scripts.append(script)
        shutil.rmtree(folder)


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

def cmdline(pid):
    return Path(f"/proc/{pid}/cmdline").read_text()

def parent(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

agent = os.getppid()
servers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent(p.name) == agent
           and (p / "comm").read_text().strip() == "mingpt-server"]
print("who", json.dumps({"agent": agent, "same_command": cmdline("self") == cmdline(agent), "servers": servers,
                         "torch": "torch" in sys.modules}))
"""


def test_mingpt_torchrun_forks_its_workers_from_a_copy_of_itself_which_ends_with_it(procs, tmp_path):
    """The server is a copy of the agent as it started (torch imported, no new Python run): a worker has the agent's
    command line and torch before its script imports it, and is the agent's child. The server ends with the agent,
    and its folder goes."""
    script = tmp_path / "who.py"
    script.write_text(WHO)
    job = procs.start([str(BIN / "mingpt-torchrun"), "--standalone", "--nproc-per-node=1", "--max-restarts=0",
                       str(script)], "job")
    assert job.wait(timeout=120) == 0, output(job)
    [line] = [line for line in output(job).splitlines() if line.startswith("who ")]
    who = json.loads(line[4:])
    assert who["agent"] == job.pid and who["same_command"] and who["torch"]
    [server] = who["servers"]
    assert not Path(f"/proc/{server}").exists()
    assert not list(Path("/tmp").glob(f"mingpt-forkserver-{job.pid}-*"))


def test_a_server_whose_imports_touched_cuda_is_told_by_the_driver_library_in_its_memory():
    """A fork cannot carry CUDA: asking for the device count loads the driver while torch still calls CUDA
    uninitialized, so the server looks for the library among its mappings too."""
    untouched = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libtorch_cuda.so\n7f20-7f30 r-xp 0 08:01 2 /usr/lib/libcudart.so.12\n"
    assert not cuda_touched(untouched)
    assert cuda_touched(untouched + "7f40-7f50 r-xp 0 08:01 3 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert not cuda_touched(Path("/proc/self/maps").read_text())  # this process: torch imported, no GPU used
