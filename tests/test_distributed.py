"""Joining the process group: device placement by LOCAL_RANK, the launch's checks, and a generation
that cannot form."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from launch import free_port, train_here

from mingpt.errors import ConfigError, PeerLeft
from mingpt.jobenv import PEER_LOST, JobEnv, LiveEndpoints
from mingpt.training import generation


def test_more_workers_than_gpus_is_a_clear_error(monkeypatch):
    # Two GPUs, and a third worker: it must not silently share GPU 0 with the first.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) called"))
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but this node has 2 visible GPU\(s\).*"
                                          r"--nproc-per-node=gpu or at most 2.*CUDA_VISIBLE_DEVICES"):
        generation.start(JobEnv(local_rank=2, local_world_size=3), timeout_s=5)


def test_each_worker_takes_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    world = generation.start(JobEnv(local_rank=1, local_world_size=2), timeout_s=5)
    assert world.device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]


@pytest.mark.parametrize("variables, words", [
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 with WORLD_SIZE=1: a rank must be below the world size"),
    ({"RANK": "-1"}, "RANK=-1 must be at least 0"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE=2 but MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "WORLD_SIZE=2 but MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000 is not a TCP port"),
])
def test_inconsistent_launcher_variables_are_one_line_each(variables, words):
    with pytest.raises(ConfigError) as refused:
        JobEnv.from_environ(variables)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_worker_whose_peers_never_come_says_what_it_waits_for_and_stops(caplog):
    """WORLD_SIZE=2 and no second process: one line says what this process waits for, then one error."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        with caplog.at_level("INFO", logger="mingpt"), pytest.raises(ConfigError) as refused:
            generation.start(JobEnv.from_environ(), timeout_s=2)
    assert f"rank 0 of 2: joining the process group at 127.0.0.1:{env['MASTER_PORT']}, waiting up to 2 s" in caplog.text
    assert "rank 0 of 2 could not meet its peers" in str(refused.value) and "rank(s) 1 never started" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_launch_is_checked_before_the_lease_or_any_data_work(tmp_path, monkeypatch):
    """RANK=1 WORLD_SIZE=1 used to train on and end in a false "loss is nan"."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="RANK=1 with WORLD_SIZE=1"):
        train_here(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no snapshot folder, no claim, no prepared data


def test_sigterm_ends_a_process_blocked_in_torch_connecting_to_a_store_that_never_comes(closed_port):
    """Under a Python SIGTERM handler (the trainer's, which cleans up), a process waiting in torch's C++ for
    its generation's store would only see the signal after trainer.dist_timeout_s; torchrun's agent,
    restarting it for a membership change, waited its 30 s shutdown timeout, then killed it."""
    code = ("import signal; from mingpt.errors import raise_stopped; from mingpt.jobenv import JobEnv; "
            "from mingpt.training import generation; signal.signal(signal.SIGTERM, raise_stopped); "
            "print('connecting', flush=True); generation.meet(JobEnv.from_environ(), 600)")
    environment = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(closed_port), "TORCHELASTIC_RUN_ID": "job"}
    worker = subprocess.Popen([sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "connecting\n"
        time.sleep(1)  # inside torch's connect loop (a sleep here only makes the test pass less often if broken)
        worker.send_signal(signal.SIGTERM)
        # torch's own timeout (600 s) is far past this wait: ending at all, by the signal, is SIGTERM's doing.
        assert worker.wait(timeout=60) == -signal.SIGTERM
    finally:
        worker.kill()
        worker.wait()


def test_a_peer_gone_while_a_generation_forms_under_torchrun_ends_the_generation(monkeypatch):
    """torchrun set MASTER_*, so a store that stops answering is a peer gone (exit 76, restarted for free);
    by hand it is a launch to check (one line, exit 2)."""
    meeting = generation.Meeting(JobEnv(rank=1, world_size=2, master=("127.0.0.1", 1), run_id="job"), 300)
    cut = dist.DistNetworkError("Failed to recv, got 0 bytes")
    assert isinstance(meeting._error(cut), PeerLeft) and meeting._error(cut).exit_code == PEER_LOST
    assert isinstance(meeting._error("rank(s) 0 never started"), ConfigError)
    meeting = generation.Meeting(JobEnv(rank=1, world_size=2, master=("127.0.0.1", 1)), 300)
    assert isinstance(meeting._error(cut), ConfigError)


def test_the_job_environment_reads_back_what_it_writes():
    """What an agent hands a worker (JobEnv.to_environ) is what the worker reads (JobEnv.from_environ)."""
    live = LiveEndpoints(lighthouse="http://10.0.0.1:29501", rendezvous="10.0.0.1:29500", host="10.0.0.2", min_nodes=2)
    job = JobEnv(rank=3, world_size=4, local_rank=1, local_world_size=2, master=("10.0.0.1", 29400), run_id="job-7",
                 restart_count=2, nodes=2, max_nodes=2, progress_dir="/tmp/mingpt-progress-1",
                 membership={"left": ["node-a"]}, hellaswag_fetched="cached", live=live)
    again = JobEnv.from_environ(job.to_environ())
    assert again == job and again.membership == job.membership and again.under_torchrun
    assert JobEnv.from_environ({}) == JobEnv() and not JobEnv().under_torchrun  # a process started by hand
