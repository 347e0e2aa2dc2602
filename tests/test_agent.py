"""mingpt-torchrun's agent under churn: which endings of a generation are membership changes, the bounded
wait for ranks, and a rendezvous that only a finished job closes. Unit tests of a real agent, over torch's
rendezvous handler and a real TCPStore, with torch's own steps (monitoring, assigning ranks) replaced where
a test needs their outcome; the whole behaviour, with real agents and workers, is in test_trainer.py (nodes
dying, joining and leaving under --max-restarts=0) and test_elastic_launch.py (a node that comes too late)."""

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from launch import (BIN, ENDLESS_STEPS, env, kill_node, latest_step, output, overrides, standalone, train_here,
                    wait_for, worker)
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from mingpt.claim import start_time
from mingpt.jobenv import PEER_LOST, PEER_STOPPED
from mingpt.launch import agent as agent_module
from mingpt.launch.agent import Agent, Rendezvous
from mingpt.storage import others_may_replace_in
from mingpt.torch_internals import ElasticAgent
from mingpt.training.distributed import lost_a_peer
from mingpt.jobenv import PROGRESS_DIR, RECORD


class Handler:
    """A rendezvous handler that records what is asked of it (torch's needs a store and other nodes)."""

    def __init__(self):
        self.calls = []

    def shutdown(self):
        self.calls.append("shutdown")
        return True

    def get_run_id(self):
        return "job"


HOST = socket.gethostname()


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield dist.PrefixStore("round/", server)


@pytest.fixture
def make_agent(store, tmp_path, monkeypatch):
    """A real Agent of a job of at most two nodes, on torch's dynamic rendezvous over `store`, whose round's
    members a test sets (`agent.rdzv.current`; None: the store does not answer); no workers started."""
    monkeypatch.setenv(PROGRESS_DIR, "")  # the agent sets it for its workers
    made = []

    def make(members=None, restarts=0) -> Agent:
        handler = DynamicRendezvousHandler.from_backend("job", store, C10dRendezvousBackend(store, "job"), 1, 2)
        spec = WorkerSpec(role="default", local_world_size=2, rdzv_handler=handler, entrypoint="true",
                          max_restarts=restarts)
        agent = Agent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
        agent.rdzv.current = members
        monkeypatch.setattr(agent.rdzv, "members", lambda: agent.rdzv.current)
        agent._members = set(members or ())  # the round its workers run in, as rendezvous() leaves it
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.watchdog.close()


def failed(*codes) -> RunResult:
    return RunResult(state=WorkerState.FAILED, failures={
        rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="") for rank, code in
        enumerate(codes)})


@pytest.mark.parametrize("codes, free, cause", [
    ((PEER_STOPPED,), True, "asked to stop (SIGTERM)"),
    ((PEER_LOST, PEER_LOST), True, "lost (its processes died or were cut off)"),
    ((PEER_LOST, 1), False, f"failed: {HOST} pid 1000 (exit 76); {HOST} pid 1001 (exit 1)"),
    ((-9,), False, f"failed: {HOST} pid 1000 (SIGKILL)"),
])
def test_workers_ended_by_another_node_use_up_no_restart(monkeypatch, make_agent, codes, free, cause):
    monkeypatch.setattr(ElasticAgent, "monitor", lambda self, group: failed(*codes))  # torch's view of them
    agent = make_agent()
    assert agent.monitor(None).state == WorkerState.FAILED  # torch's loop restarts, taking one back
    assert agent.restarts_left == (1 if free else 0)
    assert agent._cause == cause


def test_a_membership_exit_after_no_step_is_free_only_when_the_next_round_has_other_nodes(monkeypatch, make_agent):
    """Workers that exit 75 or 76 without a step: free where a node left or joined (the next round shows it), else
    one of --max-restarts, and with none left the job ends with their status. After a step, free at once."""
    monkeypatch.setattr(ElasticAgent, "monitor", lambda self, group: failed(PEER_STOPPED))

    def ends_then_rounds(agent, before, after):  # torch's loop: take a restart, then the next round
        agent.monitor(None)
        agent._remaining_restarts -= 1
        agent._members = after
        agent._charge_an_unproven_restart(before)

    two, one = {"a_1_0", "b_2_0"}, {"a_1_0"}
    agent = make_agent(two, restarts=1)
    ends_then_rounds(agent, two, one)  # b left
    assert agent.restarts_left == 1
    ends_then_rounds(agent, one, one)  # nothing changed: a failure
    assert agent.restarts_left == 0
    with pytest.raises(agent_module.RestartsUsedUp, match="exited 75, which says another process was asked to "
                                                          "stop, but they did no step and no node left or joined"
                       ) as ended:
        ends_then_rounds(agent, one, one)
    assert ended.value.status == PEER_STOPPED
    (agent.watchdog.folder / "1000").write_bytes(RECORD.pack(41, 3, time.monotonic(), 0.0, 40, 300.0))
    ends_then_rounds(agent, one, one)  # step 40 done, then saving: a membership change, whatever the round
    assert agent.restarts_left == 0 and agent._unproven is None


def test_a_restart_after_the_watchdog_ended_a_hung_worker_is_free_three_times(monkeypatch, make_agent):
    """torch ends the other workers when one fails: their exits (SIGTERM) come with the hung one's."""
    monkeypatch.setattr(ElasticAgent, "monitor", lambda self, group: failed(-9, -15))
    agent = make_agent()
    agent._hung = {1000}
    agent.watchdog.finding = "hung: host pid 1000 (stopped)"
    for left in (2, 1, 0):
        assert agent.monitor(None).state == WorkerState.FAILED
        assert agent._free_hangs == left and agent._cause == "hung: host pid 1000 (stopped)"
        agent._cause = None
    assert agent.restarts_left == 3
    agent.monitor(None)  # a fourth: a hang that comes back every time is a failure
    assert agent.restarts_left == 3 and agent._cause.startswith("failed: ")


def test_a_node_gone_from_the_round_restarts_healthy_workers_for_free(monkeypatch, make_agent):
    monkeypatch.setattr(ElasticAgent, "monitor", lambda self, group: RunResult(WorkerState.HEALTHY))
    agent = make_agent({"a_1_0", "b_2_0"})
    assert agent.monitor(None).state == WorkerState.HEALTHY
    agent.rdzv.current = {"a_1_0"}  # b's heartbeats stopped: torch took it out of the round
    assert agent.monitor(None).state == WorkerState.UNHEALTHY
    assert (agent.restarts_left, agent._cause) == (1, "gone from the rendezvous")
    agent.rdzv.current = None  # the members cannot be read: no opinion, no restart
    agent._members = {"a_1_0", "b_2_0"}
    assert agent.monitor(None).state == WorkerState.HEALTHY


def test_a_waiting_node_restarts_a_generation_once_its_workers_took_a_step_or_after_a_while(monkeypatch, make_agent,
                                                                                            caplog):
    """Nodes arriving one after another would otherwise restart starting workers again and again, no step taken."""
    class Waiting(Handler):
        def num_nodes_waiting(self):
            return 1

    caplog.set_level(logging.INFO, logger=agent_module.__name__)
    agent = make_agent({"a_1_0"})
    agent.rdzv.handler = Waiting()
    monkeypatch.setattr(Agent, "worker_pids", lambda self: [1000])
    agent._started = time.monotonic()  # as rendezvous() leaves it, its workers starting
    mark = agent.watchdog.folder / "1000"
    mark.write_bytes(RECORD.pack(40, 1, time.monotonic(), 0.0, 40, 300.0))  # resumed at step 40, computing it
    assert agent.rdzv.num_nodes_waiting() == 0
    assert caplog.text.count("a node waits to join; it is let in once this generation's workers took a step") == 1
    mark.write_bytes(RECORD.pack(41, 1, time.monotonic(), 0.0, 40, 300.0))  # step 40 done
    assert agent.rdzv.num_nodes_waiting() == 1
    agent._started, agent._stepped = time.monotonic() - agent_module.ADMIT_AFTER_S - 1, False
    mark.unlink()  # no step after ADMIT_AFTER_S (a first step that compiles, say): the node is let in anyway
    assert agent.rdzv.num_nodes_waiting() == 1


def test_only_a_finished_job_closes_the_rendezvous(monkeypatch, make_agent):
    monkeypatch.setattr(ElasticAgent, "monitor", lambda self, group: RunResult(WorkerState.SUCCEEDED))
    left = []
    rendezvous = Rendezvous(Handler())
    monkeypatch.setattr(rendezvous, "leave", lambda: left.append(True))
    assert rendezvous.shutdown() is False and rendezvous.handler.calls == [] and left == [True]
    assert rendezvous.get_run_id() == "job"  # the rest is torch's handler's
    agent = make_agent()
    agent.rdzv = rendezvous
    agent.monitor(None)  # every worker ended well: the job is done
    assert rendezvous.shutdown() is True and rendezvous.handler.calls == ["shutdown"]


def test_the_members_of_a_round_are_read_from_the_store(store):
    """A real round of one node, with torch's handler: its member is this node; a store that stops answering
    gives no opinion (None), which restarts nobody."""
    handler = DynamicRendezvousHandler.from_backend("solo", store, C10dRendezvousBackend(store, "solo"), 1, 1)
    rendezvous = Rendezvous(handler)
    handler.next_rendezvous()
    try:
        (member,) = rendezvous.members()
        assert member.startswith(socket.getfqdn())  # torch's name of this node
        rendezvous.leave()
        assert rendezvous.members() == set()
    finally:
        handler.shutdown()


def test_ranks_are_awaited_while_the_round_lives_and_given_up_once_a_node_is_gone(monkeypatch, store, make_agent):
    """The second agent of a round of two waits for the ranks the first one writes: as long as both are
    in the round, up to RANKS_WAIT_S; not a slice longer once the first is gone."""
    monkeypatch.setattr(agent_module, "RANKS_SLICE_S", 0.3)
    tries = []
    torch_assigns = ElasticAgent.assign_ranks

    def assign(*args):
        tries.append(1)
        if len(tries) == 3:  # the first agent, slower than two slices, writes the ranks
            store.set("torchelastic/assigned_ranks/1", "[1, 4, 2, 4]")
        return torch_assigns(*args)

    monkeypatch.setattr(ElasticAgent, "assign_ranks", assign)
    agent = make_agent({"a_1_0", "b_2_0"})
    spec = agent.get_worker_group().spec
    workers = agent.assign_ranks(store, 1, 2, spec)
    assert len(tries) == 3  # waited in slices while both nodes were in the round
    assert [(w.global_rank, w.world_size) for w in workers] == [(1, 4), (2, 4)]
    assert store.timeout == timedelta(seconds=30)  # the store's own timeout, back

    store.delete_key("torchelastic/assigned_ranks/1")
    agent.rdzv.current = {"b_2_0"}  # the first agent died before writing the ranks
    tries.clear()
    with pytest.raises(dist.DistError):
        agent.assign_ranks(store, 1, 2, spec)
    assert len(tries) == 1  # one slice, not until RANKS_WAIT_S (10 s) nor the store's 30 s
    assert store.timeout == timedelta(seconds=30)


def test_a_collective_cut_by_a_peer_is_told_from_a_failure_of_this_process():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43203: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert lost_a_peer(gloo)
    assert lost_a_peer(dist.DistStoreError("wait timeout after 30000ms"))
    assert not lost_a_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not lost_a_peer(MemoryError())


def test_a_store_that_does_not_answer_leaves_the_workers_training_and_is_said_once(caplog, monkeypatch):
    class Flaky(Handler):
        answers, asked = False, 0

        def num_nodes_waiting(self):
            self.asked += 1
            if not self.answers:
                raise dist.DistStoreError("wait timeout after 60000ms")
            return 1

    monkeypatch.setattr(agent_module, "STORE_RETRY_S", 0.2)
    handler = Flaky()
    rdzv = Rendezvous(handler)
    assert [rdzv.num_nodes_waiting() for _ in range(50)] == [0] * 50  # as often as torch's monitor asks
    assert handler.asked == 1  # the rest within STORE_RETRY_S of the first: not asked again
    assert caplog.text.count("the rendezvous store does not answer (DistStoreError: wait timeout after "
                             "60000ms); training goes on") == 1
    handler.answers = True
    time.sleep(0.25)
    assert rdzv.num_nodes_waiting() == 1 and "the rendezvous store answers again" in caplog.text


def test_installed_the_agent_replaces_torchs_and_its_rendezvous_polls_four_times_a_second(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.launcher import api

    monkeypatch.setattr(api, "LocalElasticAgent", api.LocalElasticAgent)  # restored after the test
    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)  # what torch's delay sleeps in
    agent_module.install()
    assert api.LocalElasticAgent is Agent
    dynamic_rendezvous._delay(seconds=1)  # what a waiting agent sleeps between two looks at the round
    dynamic_rendezvous._delay(seconds=(0.1, 0.3))  # a random pause in a range: torch's own (under 10 ms: none)
    assert slept[0] == agent_module.POLL_S and 0.1 <= slept[1] <= 0.3


@pytest.mark.multiproc
def test_what_a_killed_agent_left_in_tmp_goes_when_the_next_agent_starts(tmp_path, procs):
    """An agent SIGKILLed (the OOM killer, a node's death) cleans up nothing: the next agent on the machine removes
    its folders (its watchdog's, its workers' logs), and keeps those of a process that still runs; an agent that
    ends leaves nothing, not even torch's torchelastic_* folder."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    environment = {**env(), "TMPDIR": str(temp)}
    alive = temp / f"mingpt-progress-{os.getpid()}-{start_time(os.getpid())}-running"  # this process's: it runs
    alive.mkdir(mode=0o700)
    agent = [str(BIN / "mingpt-torchrun"), "--standalone", "--nproc-per-node=1", "--no-python"]
    killed = procs.start([*agent, "sleep", "600"], "killed", environment=environment)
    theirs = lambda: sorted(p.name.split("-")[1] for p in temp.glob(f"mingpt-*-{killed.pid}-*"))
    wait_for(lambda: "starting its workers" in output(killed) and theirs() == ["progress", "torchrun"], 60,
             "the agent's folders", [killed])
    kill_node(killed)
    killed.wait(timeout=30)
    assert theirs() == ["progress", "torchrun"]  # nothing removed them
    after = procs.start([*agent, "true"], "after", environment=environment)
    assert after.wait(timeout=120) == 0, output(after)
    assert sorted(p.name for p in temp.iterdir()) == [alive.name]


def test_a_temporary_folder_in_which_others_could_replace_the_agents_files_is_refused_in_one_line(tmp_path, procs):
    """TMPDIR that other users may write in, without the sticky bit /tmp has: one of them could rename the agent's
    folders and put their own in their place. Refused before anything starts, whichever folder above it is so."""
    shared = tmp_path / "shared"
    (shared / "mine").mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)
    for temp in (shared, shared / "mine"):
        result = procs.run([str(BIN / "mingpt-torchrun"), "--standalone", "--nproc-per-node=1", "--no-python", "true"],
                           "refused", environment={**env(), "TMPDIR": str(temp)})
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"error: the temporary folder {temp} (TMPDIR) is not safe: other users may write in {shared}, which has "
            "no sticky bit, so another user could replace mingpt's files there; point TMPDIR at a folder of your "
            "own, or at one with the sticky bit (as /tmp has)"]
        assert list((shared / "mine").iterdir()) == []
    shared.chmod(0o1777)  # as /tmp
    assert others_may_replace_in(shared / "mine") is None
    os.chown(shared / "mine", 65534, 65534)  # nobody's
    assert others_may_replace_in(shared / "mine") == f"{shared / 'mine'} belongs to another user (uid 65534)"


def test_a_job_started_without_torchrun_removes_what_killed_agents_left_too(tmp_path, monkeypatch):
    """The next job on the machine may be one without an agent: it removes an ended agent's folders in /tmp and
    an ended job's memory tier as well, and keeps those of processes that run."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    temp, shm = tmp_path / "tmp", tmp_path / "shm"
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # what TMPDIR would give a new process
    running = f"{os.getpid()}-{start_time(os.getpid())}"
    left = [temp / f"mingpt-{kind}-{pid}-x" for kind in ("progress", "torchrun") for pid in (f"{ended.pid}-1", running)]
    left += [shm / f"mingpt-0123456789abcdef-{pid}-0of1" for pid in (ended.pid, os.getpid())]
    for folder in left:
        folder.mkdir(mode=0o700, parents=True)
    train_here(tmp_path, f"snapshot.memory_dir={shm}", "trainer.max_steps=1")  # no tier: not under torchrun
    assert [folder for folder in left if folder.exists()] == [left[1], left[3], left[5]]  # those of this process


@pytest.mark.multiproc
def test_a_worker_whose_agent_is_killed_saves_its_step_and_ends(tmp_path, procs):
    """The agent alone SIGKILLed (the OOM killer): its worker trained on, alone and holding the run, so that the
    same command started again was refused. It is sent SIGTERM, as when its agent stops it."""
    snap = tmp_path / "snap"
    agent = procs.start([*standalone(1), *overrides(tmp_path, "snap", ENDLESS_STEPS)], "agent")
    wait_for(lambda: "step 5/" in output(agent), 120, "step 5", [agent])
    trainer = worker(agent.pid, local_rank=0)
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(timeout=30)
    wait_for(lambda: not os.path.exists(f"/proc/{trainer}") or "Z" in Path(f"/proc/{trainer}/stat").read_text()
             .rsplit(")", 1)[1].split()[0], 60, "the orphaned worker to end")
    assert "SIGTERM received: stopping after this step with a snapshot" in output(agent)
    assert latest_step(snap) >= 5


@pytest.mark.multiproc
def test_a_script_that_always_exits_75_ends_after_max_restarts_with_its_status(tmp_path, procs):
    """75 says another process was asked to stop; a script that says it at once, alone in its job, is failing."""
    script = tmp_path / "exit75.sh"
    script.write_text('#!/bin/sh\necho run >> "$0.runs"\nexit 75\n')
    script.chmod(0o755)
    job = procs.start([str(BIN / "mingpt-torchrun"), "--standalone", "--nproc-per-node=1", "--max-restarts=2",
                       "--no-python", str(script)], "job", environment={**env(), "TMPDIR": str(tmp_path)})
    assert job.wait(timeout=120) == 75, output(job)
    assert (tmp_path / "exit75.sh.runs").read_text().count("run") == 3
    assert "--max-restarts=2 is used up" in output(job)
