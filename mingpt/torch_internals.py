"""Every private name of torch that mingpt uses, in one place, and `check()`, which confirms them.

torch promises nothing about names that start with an underscore; mingpt needs a few: for its agent, rendezvous and
forkserver, DTensor shards, DCP's fsspec classes and pickled index, Inductor's caches and Dynamo's compile callbacks.
`check()` looks each up, on a real agent and rendezvous handler where they are fields, and fails in one line naming
torch's version and what is missing: mingpt-torchrun checks the launcher's names (not DCP's: slow to import), a worker
DCP's, a compiling worker Dynamo's, the tests all. Nothing degrades in silence."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import time
from typing import Any, Callable

import torch
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from mingpt.errors import ConfigError

TESTED = "2.13"  # the torch release the tests ran on: pyproject's range
INSTALL = "pip install torch==2.13.0"

RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
RENDEZVOUS_UTILS = "torch.distributed.elastic.rendezvous.utils"
SUBPROCESS_HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"
LAUNCHER_API = "torch.distributed.launcher.api"
DTENSOR = "torch.distributed.tensor"
DCP_FSSPEC = "torch.distributed.checkpoint._fsspec_filesystem"
INDUCTOR_CODECACHE = "torch._inductor.codecache"
INDUCTOR_CACHE_DIR = "torch._inductor.runtime.cache_dir_utils"
INDUCTOR_VEC_ISA = "torch._inductor.cpu_vec_isa"
DYNAMO_UTILS = "torch._dynamo.utils"
DYNAMO_CALLBACK = "torch._dynamo.callback"
COMPILER_CACHE = "torch.compiler._cache"

# Private classes that DCP's index of a sharded snapshot names, which its unpickler must allow.
DCP_INDEX_CLASSES = (
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
)

# Names looked up in a module, by who needs them (the fields of torch's objects: `_check_objects`).
LAUNCHER_NAMES = (
    (RENDEZVOUS, "_delay"), (RENDEZVOUS, "_Action"), (RENDEZVOUS, "_RendezvousContext"),
    (RENDEZVOUS_UTILS, "_matches_machine_hostname"), (RENDEZVOUS_UTILS, "_parse_rendezvous_config"),
    (SUBPROCESS_HANDLER, "SubprocessHandler"), (LAUNCHER_API, "LocalElasticAgent"),
)
SHARDED_NAMES = (
    (DCP_FSSPEC, "FileSystem"), (DCP_FSSPEC, "FsspecReader"), (DCP_FSSPEC, "FsspecWriter"),
    *DCP_INDEX_CLASSES,
)

COMPILED_NAMES = (
    (INDUCTOR_CODECACHE, "CppCodeCache"), (INDUCTOR_CACHE_DIR, "cache_dir"), (INDUCTOR_VEC_ISA, "VecISA"),
    (DYNAMO_UTILS, "counters"), (COMPILER_CACHE, "CacheArtifactManager"),
    (COMPILER_CACHE, "AppendingByteSerializer"), (COMPILER_CACHE, "_deserialize_single_cache"),
)

# The agent's private steps that mingpt's agent overrides, with their parameters (after self).
AGENT_STEPS = {
    "_monitor_workers": ("worker_group",),
    "_restart_workers": ("worker_group",),
    "_rendezvous": ("worker_group",),
    "_assign_worker_ranks": ("store", "group_rank", "group_world_size", "spec"),
}

LEAVE_ACTIONS = ("REMOVE_FROM_PARTICIPANTS", "REMOVE_FROM_WAIT_LIST", "FINISH")


class TorchInternalsError(ConfigError):
    """The torch that runs lacks a private name mingpt relies on."""


def _missing_error(names: list[str]) -> TorchInternalsError:
    return TorchInternalsError(
        f"torch {torch.__version__} lacks what mingpt relies on: {', '.join(names)}. mingpt is tested with "
        f"torch {TESTED}: {INSTALL}")


def _find(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def check(launcher: bool = True, sharded: bool = True) -> None:
    """Raise TorchInternalsError, in one line, where this torch lacks a name the launcher or sharded runs rely on.
    (The compile caches turn themselves off instead: `compiled_names_missing`.)"""
    names = (LAUNCHER_NAMES if launcher else ()) + (SHARDED_NAMES if sharded else ())
    missing = [f"{module}.{name}" for module, name in names if _find(module, name) is None]
    missing += _check_objects() if launcher else []
    if sharded and not callable(getattr(_find(DTENSOR, "DTensor"), "__create_chunk_list__", None)):
        missing.append(f"{DTENSOR}.DTensor.__create_chunk_list__")
    if missing:
        raise _missing_error(missing)


def _check_objects() -> list[str]:
    """What a real agent and a real rendezvous handler lack of the fields and steps used here."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    missing = []
    for step, parameters in AGENT_STEPS.items():
        method = getattr(LocalElasticAgent, step, None)
        if method is None or tuple(inspect.signature(method).parameters)[1:] != parameters:
            missing.append(f"LocalElasticAgent.{step}({', '.join(parameters)})")
    store = HashStore()
    handler = DynamicRendezvousHandler.from_backend("check", store, C10dRendezvousBackend(store, "check"), 1, 1)
    agent = LocalElasticAgent(WorkerSpec(role="check", local_world_size=1, rdzv_handler=handler, entrypoint="true"),
                              DefaultLogsSpecs(log_dir=os.devnull))  # no torchelastic_* folder in /tmp
    fields = {
        "LocalElasticAgent._remaining_restarts": isinstance(getattr(agent, "_remaining_restarts", None), int),
        "LocalElasticAgent._pcontext": hasattr(agent, "_pcontext"),
        "DynamicRendezvousHandler._heartbeat_lock": hasattr(handler, "_heartbeat_lock"),
        "DynamicRendezvousHandler._stop_heartbeats": callable(getattr(handler, "_stop_heartbeats", None)),
        "DynamicRendezvousHandler._op_executor.run": callable(getattr(getattr(handler, "_op_executor", None), "run",
                                                                      None)),
        "DynamicRendezvousHandler._state_holder.sync": callable(getattr(getattr(handler, "_state_holder", None),
                                                                        "sync", None)),
    }
    starts = _find(SUBPROCESS_HANDLER, "SubprocessHandler")
    fields["SubprocessHandler._popen(args, env), with _stdout and _stderr"] = starts is None or (
        tuple(inspect.signature(starts._popen).parameters)[1:] == ("args", "env")
        and {"_stdout", "_stderr"} <= set(starts.__init__.__code__.co_names))
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    for name in ("participants", "wait_list"):
        fields[f"DynamicRendezvousHandler._state_holder.state.{name}"] = hasattr(state, name)
    actions = _find(RENDEZVOUS, "_Action")
    for name in LEAVE_ACTIONS:
        fields[f"{RENDEZVOUS}._Action.{name}"] = actions is None or hasattr(actions, name)  # its absence is said
    context = _find(RENDEZVOUS, "_RendezvousContext")
    fields[f"{RENDEZVOUS}._RendezvousContext(node, state, ...)"] = context is None or \
        tuple(inspect.signature(context).parameters)[:2] == ("node", "state")
    return missing + [name for name, present in fields.items() if not present]


class ElasticAgent(LocalElasticAgent):
    """torch's LocalElasticAgent with the private steps that mingpt's agent changes under public names:
    override `monitor`, `restart`, `rendezvous` and `assign_ranks`; super() runs torch's own."""

    def _monitor_workers(self, worker_group):
        return self.monitor(worker_group)

    def _restart_workers(self, worker_group) -> None:
        self.restart(worker_group)

    def _rendezvous(self, worker_group) -> None:
        self.rendezvous(worker_group)

    def _assign_worker_ranks(self, store, group_rank, group_world_size, spec):
        return self.assign_ranks(store, group_rank, group_world_size, spec)

    def monitor(self, worker_group):
        """The workers' state (healthy, failed, succeeded), as torch checks it every monitor interval."""
        return LocalElasticAgent._monitor_workers(self, worker_group)

    def restart(self, worker_group) -> None:
        """Stop the workers, enter the next round, start new ones."""
        LocalElasticAgent._restart_workers(self, worker_group)

    def rendezvous(self, worker_group) -> None:
        """Enter a round of the rendezvous and take this node's place in it."""
        LocalElasticAgent._rendezvous(self, worker_group)

    def assign_ranks(self, store, group_rank: int, group_world_size: int, spec):
        """The ranks of this node's workers, agreed through the round's store."""
        return LocalElasticAgent._assign_worker_ranks(self, store, group_rank, group_world_size, spec)

    def give_back_a_restart(self) -> None:
        """torch's loop takes one of --max-restarts for every restart; this one was not a failure."""
        self._remaining_restarts += 1

    def use_a_restart(self) -> None:
        """Take back a restart given back: it was a failure after all."""
        self._remaining_restarts -= 1

    @property
    def restarts_left(self) -> int:
        return self._remaining_restarts

    def worker_pids(self) -> list[int]:
        """The pids of this node's running workers (none before they start)."""
        return list(self._pcontext.pids().values()) if self._pcontext is not None else []


def launch_with_agent(agent_class: type) -> None:
    """Make torchrun's launcher start `agent_class` (an `ElasticAgent`) instead of LocalElasticAgent."""
    importlib.import_module(LAUNCHER_API).LocalElasticAgent = agent_class


def start_workers_with(start: Callable[[tuple, dict, Any, Any], Any]) -> None:
    """torch's launcher starts each worker through `start(args, env, stdout, stderr)` (its log files or None), which
    returns what the launcher uses of a Popen, or None where torch is to start it as usual."""
    handler = _find(SUBPROCESS_HANDLER, "SubprocessHandler")
    usual = handler._popen

    def _popen(self, args: tuple, env: dict):
        return start(args, env, self._stdout, self._stderr) or usual(self, args, env)

    handler._popen = _popen


def round_members(handler) -> set[str]:
    """The nodes of the current round ("host_pid_n"), as the store has them now; its errors pass."""
    with handler._heartbeat_lock:
        handler._state_holder.sync()
        return {str(node) for node in handler._state_holder.state.participants}


def leave_round(handler, timeout_s: float) -> None:
    """Take this node out of the round (or its wait list) now, rather than when its heartbeats expire."""
    action = _find(RENDEZVOUS, "_Action")

    def leave(context, deadline: float):
        if context.node in context.state.participants:
            return action.REMOVE_FROM_PARTICIPANTS
        if context.node in context.state.wait_list:
            return action.REMOVE_FROM_WAIT_LIST
        return action.FINISH

    handler._stop_heartbeats()
    handler._op_executor.run(leave, time.monotonic() + timeout_s)


def poll_rendezvous_every(poll_s: float) -> None:
    """Make an agent that waits in a round look at it every `poll_s` at most (torch: every second)."""
    module = importlib.import_module(RENDEZVOUS)
    torch_delay = module._delay

    def quicker(seconds: float | tuple[float, float]) -> None:  # torch calls it with seconds=...
        torch_delay(min(seconds, poll_s) if isinstance(seconds, (int, float)) else seconds)

    module._delay = quicker


def parse_rendezvous_config(text: str) -> dict[str, str]:
    """torchrun's reading of --rdzv-conf ("key=value,..."); ValueError where it is not that."""
    return _find(RENDEZVOUS_UTILS, "_parse_rendezvous_config")(text)


def is_this_machine(host: str) -> bool:
    """torch's own test of whether `host` names this machine (whether this agent hosts the store)."""
    try:
        return _find(RENDEZVOUS_UTILS, "_matches_machine_hostname")(host)
    except OSError:  # this machine's own name does not resolve: torch's test fails, so the store is elsewhere
        return False


def dcp_fsspec_classes() -> tuple[type, type, type]:
    """DCP's FileSystem, FsspecReader and FsspecWriter; a missing one is a stand-in that fails in check()'s words."""
    return tuple(_find(DCP_FSSPEC, name) or _absent(DCP_FSSPEC, name)
                 for name in ("FileSystem", "FsspecReader", "FsspecWriter"))


def _absent(module: str, name: str) -> type:
    def refuse(self, *args, **kwargs):
        raise _missing_error([f"{module}.{name}"])

    return type(name, (), {"__init__": refuse})


# Members of COMPILED_NAMES' classes that load_cache_artifacts calls.
COMPILED_MEMBERS = (("CacheArtifactManager", "_ensure_cache_artifacts_registered"),
                    ("CacheArtifactManager", "populate_caches"), ("AppendingByteSerializer", "to_list"))


def compiled_names_missing() -> list[str]:
    """The names of COMPILED_NAMES, and the members of theirs used here, that this torch lacks."""
    missing = [f"{module}.{name}" for module, name in COMPILED_NAMES if _find(module, name) is None]
    missing += [f"{COMPILER_CACHE}.{owner}.{member}" for owner, member in COMPILED_MEMBERS
                if not hasattr(_find(COMPILER_CACHE, owner), member)]
    return missing


def inductor_cache_dir() -> str:
    """The local folder of Inductor's caches (TORCHINDUCTOR_CACHE_DIR, or torch's default), created."""
    return _find(INDUCTOR_CACHE_DIR, "cache_dir")()


def compiled_kernel_keys() -> set[str]:
    """The keys of the C++ libraries Inductor built or loaded in this process (`<cache dir>/<key[1:3]>/<key>*.so`)."""
    return {key for cls in _with_subclasses(_find(INDUCTOR_CODECACHE, "CppCodeCache"))
            for key in cls.__dict__.get("cache", {})}  # each class keeps its own


def cpu_probe_sources() -> set[str]:
    """The C++ programs of Inductor's CPU feature probes (VecISA's dry compiles, cached once per cache folder)."""
    return {value.strip() for cls in _with_subclasses(_find(INDUCTOR_VEC_ISA, "VecISA"))
            for name, value in vars(cls).items() if name.endswith("_code") and isinstance(value, str)}


def _with_subclasses(cls: type) -> list[type]:
    found, frontier = [], [cls]
    while frontier:
        found.append(frontier.pop())
        frontier += found[-1].__subclasses__()
    return found


def load_cache_artifacts(data: bytes) -> dict[str, int]:
    """`torch.compiler.load_cache_artifacts(data)` of every section (torch's keeps each kind's last only, and each
    `save_cache_artifacts` appends one); the number of artifacts loaded, by kind."""
    cache = importlib.import_module(COMPILER_CACHE)
    manager = cache.CacheArtifactManager
    manager._ensure_cache_artifacts_registered()
    merged: dict[str, list] = {}
    for kind, artifacts in cache.AppendingByteSerializer.to_list(data, deserialize_fn=cache._deserialize_single_cache):
        merged.setdefault(kind, []).extend(artifacts)
    info = manager.populate_caches(merged)
    return {kind: len(keys) for kind, keys in info.artifacts.items()}


def compile_counters() -> dict[str, int]:
    """This process's counts of Inductor's FX graph cache and AOTAutograd's cache: hits and misses."""
    counters = _find(DYNAMO_UTILS, "counters")
    return {"fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def watch_compiles(started: Callable[[], None], ended: Callable[[], None]) -> Callable[[], None]:
    """Call `started()` and `ended()` around every compile in this process (a nested one counts once); returns what
    stops the calls. TorchInternalsError where this torch has no such callbacks."""
    handler = _find(DYNAMO_CALLBACK, "callback_handler")
    if handler is None:
        raise _missing_error([f"{DYNAMO_CALLBACK}.callback_handler"])
    on_start, on_end = (lambda args: started()), (lambda args: ended())
    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)

    def unwatch() -> None:
        handler.remove_start_callback(on_start)
        handler.remove_end_callback(on_end)

    return unwatch


def shard_offsets(tensor: Any) -> tuple[list[int], list[int]] | None:
    """Where this process's shard of a DTensor lies in the whole, as DCP records it: (offsets, sizes); None for any
    other tensor. (torch.distributed.tensor is slow to import: where nothing imported it, no tensor is a DTensor.)"""
    module = sys.modules.get(DTENSOR)
    if module is None or not isinstance(tensor, module.DTensor):
        return None
    [chunk] = tensor.__create_chunk_list__()
    return list(chunk.offsets), list(chunk.sizes)
