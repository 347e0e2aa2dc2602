"""Sharded snapshots: every process writes its own shard of the state into the snapshot's `state/`, and any number of
processes reads it back, through torch.distributed.checkpoint (DCP), which plans who reads which bytes. The commit
protocol is the store's (docs/snapshots.md), and every file, `.metadata` included, is checked against its sha256 before
DCP sees a byte of it. DCP unpickles `.metadata` and the small values in shards with nothing beyond its own classes and
plain data, so a planted file, even with a manifest to match, cannot run code."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from mingpt.checkpoint.store import INDEX, STATE_DIR, HashingWriter, Snapshot, SnapshotError
from mingpt.errors import MinGPTError
from mingpt.storage import open_exclusive
from mingpt.torch_internals import DCP_INDEX_CLASSES, dcp_fsspec_classes

FileSystem, FsspecReader, FsspecWriter = dcp_fsspec_classes()  # private to DCP


class _ExclusiveHashedFiles(FileSystem):
    """The files DCP writes: created exclusively after `fence()` passes, hashed on the way."""

    def __init__(self, fs, fence: Callable[[], None]):
        super().__init__()
        self.fs, self.fence = fs, fence
        self.entries: dict[str, dict] = {}  # path -> {bytes, sha256}

    def init_path(self, path, **kwargs):
        return path

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        path = os.fspath(path)
        self.fence()
        with open_exclusive(self.fs, path) as f:
            out = HashingWriter(f)
            yield out
        self.entries[path] = out.entry()

    def rename(self, path, new_path) -> None:  # DCP writes .metadata.tmp, then renames it
        self.fs.mv(os.fspath(path), os.fspath(new_path))
        self.entries[os.fspath(new_path)] = self.entries.pop(os.fspath(path))


class ShardWriter(FsspecWriter):
    """DCP's writer into `folder` of `fs`, with every file fenced, exclusive and hashed (`entries`)."""

    def __init__(self, fs, folder: str, fence: Callable[[], None]):
        super().__init__(folder, sync_files=False)  # open_exclusive makes local files durable itself
        self.fs = _ExclusiveHashedFiles(fs, fence)
        self.path = folder

    def written(self) -> dict[str, dict]:
        """What this process wrote: {name in the folder: {bytes, sha256}}."""
        return {path[len(self.path) + 1:]: entry for path, entry in self.fs.entries.items()}


class _VerifiedFiles(FileSystem):
    """The files of a committed snapshot, each read whole and checked against its manifest first."""

    def __init__(self, snapshot: Snapshot):
        super().__init__()
        self.snapshot = snapshot

    def init_path(self, path, **kwargs):
        return path

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode:
            raise ValueError("a committed snapshot is never written")
        yield io.BytesIO(self.snapshot.read(os.fspath(path)))


class ShardReader(FsspecReader):
    """DCP's reader of a sharded snapshot: files checked against the manifest, and the index `read_index` read."""

    def __init__(self, snapshot: Snapshot, index: Metadata):
        super().__init__(STATE_DIR)
        self.fs = _VerifiedFiles(snapshot)
        self.path = STATE_DIR
        self.index = index

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.index.storage_meta = self.index.storage_meta or StorageMeta()
        self.index.storage_meta.load_id = self.load_id
        return self.index


# What DCP's index names: its metadata classes, torch.Size, dtypes and layouts (looked up in torch's own table). Exact
# (module, name) pairs: a module's other attributes, and dotted names (`metadata.os.system`), are never reached.
_INDEX_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata")),
    *DCP_INDEX_CLASSES,
    ("torch", "Size"),
    *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)),
}


def read_index(snapshot: Snapshot) -> Metadata:
    """The snapshot's DCP index, sha256-checked and unpickled with DCP's classes alone; SnapshotError otherwise."""
    try:
        metadata = _IndexUnpickler(io.BytesIO(snapshot.read(INDEX))).load()
    except SnapshotError:
        raise
    except Exception as e:  # EOFError of one cut short, UnpicklingError of a foreign class, ...
        metadata = f"({e or type(e).__name__})"
    if not isinstance(metadata, Metadata):
        raise SnapshotError(f"refusing to read {INDEX} of snapshot {snapshot.url}: it is not DCP's "
                            f"index of shards {metadata if isinstance(metadata, str) else ''}".rstrip())
    return metadata


class _IndexUnpickler(pickle.Unpickler):
    """DCP's index, a pickle, unpickled with _INDEX_CLASSES alone: a planted index cannot call a function."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _INDEX_CLASSES:
            raise pickle.UnpicklingError(f"it names {module}.{name}")
        return super().find_class(module, name)


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that the small values it torch.saves (lrs, betas, steps) load with weights_only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise SnapshotError(f"refusing to load {read_item.dest_index.fqn} from a shard: it is not plain data "
                                f"({type(e).__name__}); only weights_only data is ever loaded") from None
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, found plain above


def write_shards(state: dict[str, Any], fs, folder: str, fence: Callable[[], None], group) -> dict[str, dict]:
    """Write this process's share of `state` into `folder`/state (a collective of `group`); its files' entries."""
    writer = ShardWriter(fs, f"{folder}/{STATE_DIR}", fence)
    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it writes alone: as asked
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=not torch.distributed.is_initialized())
    except CheckpointException as e:  # a BaseException, holding every process's failure
        raise _first_failure(e, "could not write its shard") from None
    return {f"{STATE_DIR}/{name}": entry for name, entry in writer.written().items()}


def read_shards(snapshot: Snapshot, state: dict[str, Any], alone: bool = False) -> None:
    """Fill `state` in place from `snapshot`'s shards: a collective of the default group, or (`alone`) without."""
    alone = alone or not torch.distributed.is_initialized()
    # The index is read here, once: a bad one is refused in one line, not inside DCP (which logs tracebacks).
    reader = ShardReader(snapshot, read_index(snapshot))
    try:
        with warnings.catch_warnings():  # DCP warns that it reads alone: as asked
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=_PlainDataPlanner(), no_dist=alone)
    except CheckpointException as e:
        raise _first_failure(e, f"could not read snapshot {snapshot.url}") from None


def read_model(snapshot: Snapshot, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of `model` (a plain GPT of its model_config), gathered from the shards by this process alone."""
    state = {"model": get_model_state_dict(model)}
    read_shards(snapshot, state, alone=True)
    return state["model"]


def _first_failure(e: CheckpointException, what: str) -> Exception:
    """The error of the first process that failed: ours as they are (they explain themselves), others in a line."""
    if not e.failures:
        return SnapshotError(f"{what}: {e}")
    rank = min(e.failures)
    error = e.failures[rank][0]  # (exception, traceback)
    if isinstance(error, MinGPTError):
        return error
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return SnapshotError(f"process {rank} {what}: {reason}")
