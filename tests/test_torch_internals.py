"""torch's private names in one checked place: the check passes on the torch the tests run on, names each
missing one with torch's version, and stops mingpt-torchrun in one line; the agent's public steps are the
ones torch's loop calls."""

import subprocess

import pytest
import torch
from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.launcher import api as launcher_api
from torch.distributed.tensor import DTensor

from mingpt import torch_internals
from mingpt.torch_internals import ElasticAgent, TorchInternalsError
from tests.launch import BIN, MAIN, env


def test_every_name_is_there_in_the_torch_the_tests_run_on():
    torch_internals.check()
    assert torch.__version__.startswith(torch_internals.TESTED + ".")


@pytest.mark.parametrize("owner, name, said", [
    (dynamic_rendezvous, "_delay", "torch.distributed.elastic.rendezvous.dynamic_rendezvous._delay"),
    (SimpleElasticAgent, "_assign_worker_ranks",
     "LocalElasticAgent._assign_worker_ranks(store, group_rank, group_world_size, spec)"),
    (DynamicRendezvousHandler, "_stop_heartbeats", "DynamicRendezvousHandler._stop_heartbeats"),
    (launcher_api, "LocalElasticAgent", "torch.distributed.launcher.api.LocalElasticAgent"),
    (DTensor, "__create_chunk_list__", "torch.distributed.tensor.DTensor.__create_chunk_list__"),
])
def test_a_missing_name_is_named_with_torchs_version(monkeypatch, owner, name, said):
    monkeypatch.delattr(owner, name)
    with pytest.raises(TorchInternalsError) as error:
        torch_internals.check()
    assert str(error.value) == (f"torch {torch.__version__} lacks what mingpt relies on: {said}. mingpt is tested "
                                f"with torch {torch_internals.TESTED}: {torch_internals.INSTALL}")


def test_a_step_whose_parameters_changed_is_named(monkeypatch):
    monkeypatch.setattr(SimpleElasticAgent, "_rendezvous", lambda self, worker_group, deadline: None)
    with pytest.raises(TorchInternalsError, match=r"LocalElasticAgent\._rendezvous\(worker_group\)"):
        torch_internals.check()


def test_without_dcps_fsspec_classes_a_sharded_run_is_refused_and_their_stand_ins_say_why(monkeypatch):
    from torch.distributed.checkpoint import _fsspec_filesystem

    monkeypatch.delattr(_fsspec_filesystem, "FsspecWriter")
    torch_internals.check(sharded=False)  # the launcher needs no DCP
    with pytest.raises(TorchInternalsError, match=r"_fsspec_filesystem\.FsspecWriter"):
        torch_internals.check(launcher=False)
    _, _, writer = torch_internals.dcp_fsspec_classes()
    with pytest.raises(TorchInternalsError, match=r"_fsspec_filesystem\.FsspecWriter"):
        writer("folder")


def test_without_dynamos_compile_callbacks_watching_compiles_is_refused_in_one_line(monkeypatch):
    from torch._dynamo import callback

    monkeypatch.delattr(callback, "callback_handler")
    lacks = r"lacks what mingpt relies on: torch\._dynamo\.callback\.callback_handler"
    with pytest.raises(TorchInternalsError, match=lacks):
        torch_internals.watch_compiles(lambda: None, lambda: None)


def test_torchs_private_steps_call_the_agents_public_ones(tmp_path):
    """What torch's loop calls (its private names) reaches what mingpt's agent overrides."""
    called = []

    class Recording(ElasticAgent):
        def monitor(self, worker_group):
            called.append("monitor")
            return RunResult(WorkerState.HEALTHY)

        def restart(self, worker_group):
            called.append("restart")

        def rendezvous(self, worker_group):
            called.append("rendezvous")

        def assign_ranks(self, store, group_rank, group_world_size, spec):
            called.append("assign_ranks")
            return []

    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    store = HashStore()
    handler = DynamicRendezvousHandler.from_backend("job", store, C10dRendezvousBackend(store, "job"), 1, 1)
    agent = Recording(WorkerSpec(role="default", local_world_size=1, rdzv_handler=handler, entrypoint="true",
                                 max_restarts=2), DefaultLogsSpecs(log_dir=str(tmp_path)))
    group = agent.get_worker_group()
    assert agent._monitor_workers(group).state == WorkerState.HEALTHY
    agent._restart_workers(group)
    agent._rendezvous(group)
    assert agent._assign_worker_ranks(store, 0, 1, group.spec) == []
    assert called == ["monitor", "restart", "rendezvous", "assign_ranks"]
    agent.give_back_a_restart()
    assert agent.restarts_left == 3 and agent.worker_pids() == []


@pytest.mark.multiproc
def test_mingpt_torchrun_on_a_torch_without_a_name_stops_in_one_line(tmp_path):
    """The names are deleted from torch as it is imported, before mingpt runs: exit 2 and one line, no
    traceback, before any agent or data work."""
    (tmp_path / "sitecustomize.py").write_text(
        "import torch.distributed.elastic.rendezvous.dynamic_rendezvous as rendezvous\ndel rendezvous._delay\n")
    environment = env() | {"PYTHONPATH": str(tmp_path)}
    result = subprocess.run([str(BIN / "mingpt-torchrun"), "--standalone", "--nproc-per-node=1", MAIN,
                             f"data.prepared_dir={tmp_path / 'prepared'}"], env=environment, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: torch {torch.__version__} lacks what mingpt relies on: "
        f"{torch_internals.RENDEZVOUS}._delay. mingpt is tested with torch {torch_internals.TESTED}: "
        f"{torch_internals.INSTALL}")
    assert not (tmp_path / "prepared").exists()
