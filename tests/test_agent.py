"""mingpt-torchrun's agent under churn: which endings of a generation are membership changes, the bounded
wait for ranks, and a rendezvous that only a finished job closes. Unit tests over torch's own classes and a
real TCPStore; the whole behaviour, with real agents and workers, is in test_trainer.py (nodes dying,
joining and leaving under --max-restarts=0) and test_elastic_launch.py (a node that comes too late)."""

import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mingpt.training import agent as agent_module
from mingpt.training.agent import Agent, Rendezvous
from mingpt.training.distributed import lost_a_peer
from mingpt.training.launcher import PEER_LOST, PEER_STOPPED


class Handler:
    """A rendezvous handler that records what is asked of it (torch's needs a store and other nodes)."""

    def __init__(self):
        self.calls = []

    def shutdown(self):
        self.calls.append("shutdown")
        return True

    def get_run_id(self):
        return "job"


class Members(Rendezvous):
    def __init__(self, members):
        super().__init__(Handler())
        self.current = members

    def members(self):
        return self.current


HOST = socket.gethostname()


def bare_agent(members=None, restarts=0) -> Agent:
    """An Agent without torch's start-up (no rendezvous, no workers): its policy alone."""
    agent = object.__new__(Agent)
    agent.rdzv = Members(members)
    agent._members, agent._cause, agent._noticed, agent._remaining_restarts = set(members or ()), None, 0.0, restarts
    agent._hung, agent._free_hangs = set(), 3
    agent.watchdog = SimpleNamespace(check=lambda pids: [], finding="hung: host pid 1000 (stopped)")
    agent._pcontext = SimpleNamespace(pids=lambda: {0: 1000, 1: 1001})
    return agent


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
def test_workers_ended_by_another_node_use_up_no_restart(monkeypatch, codes, free, cause):
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: failed(*codes))
    agent = bare_agent()
    assert agent._monitor_workers(None).state == WorkerState.FAILED  # torch's loop restarts, taking one back
    assert agent._remaining_restarts == (1 if free else 0)
    assert agent._cause == cause


def test_a_restart_after_the_watchdog_ended_a_hung_worker_is_free_three_times(monkeypatch):
    """torch ends the other workers when one fails: their exits (SIGTERM) come with the hung one's."""
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: failed(-9, -15))
    agent = bare_agent()
    agent._hung = {1000}
    for left in (2, 1, 0):
        assert agent._monitor_workers(None).state == WorkerState.FAILED
        assert agent._free_hangs == left and agent._cause == "hung: host pid 1000 (stopped)"
        agent._cause = None
    assert agent._remaining_restarts == 3
    agent._monitor_workers(None)  # a fourth: a hang that comes back every time is a failure
    assert agent._remaining_restarts == 3 and agent._cause.startswith("failed: ")


def test_a_node_gone_from_the_round_restarts_healthy_workers_for_free(monkeypatch):
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(WorkerState.HEALTHY))
    agent = bare_agent({"a_1_0", "b_2_0"})
    assert agent._monitor_workers(None).state == WorkerState.HEALTHY
    agent.rdzv.current = {"a_1_0"}  # b's heartbeats stopped: torch took it out of the round
    assert agent._monitor_workers(None).state == WorkerState.UNHEALTHY
    assert (agent._remaining_restarts, agent._cause) == (1, "gone from the rendezvous")
    agent.rdzv.current = None  # the members cannot be read: no opinion, no restart
    agent._members = {"a_1_0", "b_2_0"}
    assert agent._monitor_workers(None).state == WorkerState.HEALTHY


def test_only_a_finished_job_closes_the_rendezvous(monkeypatch):
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(WorkerState.SUCCEEDED))
    left = []
    rendezvous = Rendezvous(Handler())
    monkeypatch.setattr(rendezvous, "leave", lambda: left.append(True))
    assert rendezvous.shutdown() is False and rendezvous.handler.calls == [] and left == [True]
    assert rendezvous.get_run_id() == "job"  # the rest is torch's handler's
    agent = bare_agent()
    agent.rdzv = rendezvous
    agent._monitor_workers(None)  # every worker ended well: the job is done
    assert rendezvous.shutdown() is True and rendezvous.handler.calls == ["shutdown"]
    assert Rendezvous(Handler()).members() is None  # not torch's dynamic handler: nothing to read


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield dist.PrefixStore("round/", server)


def test_ranks_are_awaited_while_the_round_lives_and_given_up_once_a_node_is_gone(monkeypatch, store):
    """The second agent of a round of two waits for the ranks the first one writes: as long as both are
    in the round, up to RANKS_WAIT_S; not a slice longer once the first is gone."""
    monkeypatch.setattr(agent_module, "RANKS_SLICE_S", 0.3)
    spec = SimpleNamespace(role="default", local_world_size=1)  # what torch's rank assignment reads of it
    agent = bare_agent({"a_1_0", "b_2_0"})
    writer = threading.Timer(1.0, lambda: store.set("torchelastic/assigned_ranks/1", "[1, 2, 1, 2]"))
    writer.start()  # the first agent, slower than a slice
    workers = agent._assign_worker_ranks(store, 1, 2, spec)
    assert [(w.global_rank, w.world_size) for w in workers] == [(1, 2)]
    assert store.timeout == timedelta(seconds=30)  # the store's own timeout, back

    store.delete_key("torchelastic/assigned_ranks/1")
    agent.rdzv.current = {"b_2_0"}  # the first agent died before writing the ranks
    started = time.monotonic()
    with pytest.raises(dist.DistError):
        agent._assign_worker_ranks(store, 1, 2, spec)
    assert time.monotonic() - started < 2.0  # one slice, not RANKS_WAIT_S (10 s) nor the store's 30 s
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
    agent_module.install()
    assert api.LocalElasticAgent is Agent
    started = time.monotonic()
    dynamic_rendezvous._delay(seconds=1)  # what a waiting agent sleeps between two looks at the round
    assert time.monotonic() - started < 0.5
