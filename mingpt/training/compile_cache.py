"""torch.compile's caches travel with the run (`trainer.compile_cache`): a worker on a machine that never compiled
this model (a node that joins, a restart elsewhere) starts from what another worker compiled.

One zip per key (mingpt.checkpoint.compiled keeps it) holds torch's portable caches (`mega-cache.bin`) and what those
leave out (`kernels/`: C++ libraries and Inductor's CPU probes, each named after a hash of source and compiler command).
The key digests what makes them valid (`describe`). They are code (docs/snapshots.md, Compile caches)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import sys
import threading
import time
import zipfile

import fsspec
import torch

import mingpt
from mingpt import torch_internals
from mingpt.checkpoint.compiled import CompiledCaches
from mingpt.checkpoint.lease import LeaseLostError, RunLease
from mingpt.rundir import RunDir
from mingpt.shape import GPTConfig
from mingpt.storage import create_exclusive, explain_storage_error, private_folder

log = logging.getLogger(__name__)

MEGA_CACHE = "mega-cache.bin"
_KERNEL = re.compile(r"^kernels/([a-z0-9]{2})/(c[a-z0-9]{20,100}(\.main)?\.so)$")
_PROBE_SOURCE_MAX = 8192  # bytes: the probes are a few lines each; a kernel's source is not read


def describe(model: GPTConfig, device: torch.device, dtype: torch.dtype, parallelism: str) -> dict:
    """What makes compiled caches valid for this job."""
    return {
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "mingpt": mingpt.__version__,
        "device": device.type,
        "capability": _capability(device),
        "model": model.to_dict(),
        "dtype": str(dtype).replace("torch.", ""),
        "parallelism": parallelism,
        "compile": "GPT.compile() with torch's defaults",
    }


def key_of(describes: dict) -> str:
    return hashlib.sha256(json.dumps(describes, sort_keys=True).encode()).hexdigest()[:32]


def _capability(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return torch.backends.cpu.get_cpu_capability()  # the vector ISA Inductor's kernels are built for


class CompileCache:
    """The compile caches of one worker: loaded before the model first compiles, saved by the lease's holder."""

    def __init__(self, run: RunDir, describes: dict, announce: bool):
        self.caches = CompiledCaches(run)
        self.describes, self.key = describes, key_of(describes)
        self.announce = announce  # one process per node says what happened; the others log at DEBUG
        self._saved = 0  # artifacts (torch's and kernels) the run folder holds for this key, as far as known
        self._steps = 0
        self._thread: threading.Thread | None = None

    def load(self) -> None:
        """Install the run's caches of this key; where there are none, or they are unusable, torch compiles anew."""
        missing = torch_internals.compiled_names_missing()
        if missing:
            self._say(logging.INFO, "torch %s lacks %s: compile caches are not loaded or saved", torch.__version__,
                      ", ".join(missing))
            self.key = ""
            return
        started = time.perf_counter()
        blob = self.caches.read(self.key, self._say)
        if blob is None:
            return
        try:
            counts = install(blob)
        except Exception as e:  # a blob its writer could not have meant: compile as if there were none
            self._say(logging.WARNING, "the compile caches in %s are not loaded (%s: %s); compiling from scratch",
                      self.caches.url, type(e).__name__, e)
            return
        self._saved = sum(counts.values())
        self._say(logging.INFO, "compile caches loaded from %s in %.2fs: %s", self.caches.url,
                  time.perf_counter() - started, ", ".join(f"{n} {kind}" for kind, n in counts.items()))

    def after_step(self, lease: RunLease | None, snapshot: bool) -> None:
        """After a generation's first step and at each snapshot, the lease's holder saves what torch newly compiled."""
        self._steps += 1
        if not self.key:  # this torch lacks what they need
            return
        if self._steps == 1:
            self._say(logging.INFO, "torch.compile caches: %s", ", ".join(
                f"{name} {count}" for name, count in torch_internals.compile_counters().items()))
        if lease is None or lease.lost or not (self._steps == 1 or snapshot):
            return
        if self._thread is not None and self._thread.is_alive():
            return  # the next snapshot tries again
        started = time.perf_counter()
        saved = torch.compiler.save_cache_artifacts()  # quick: its bytes are appended to as torch compiles
        if saved is None:
            return
        artifacts = sum(len(keys) for keys in saved[1].artifacts.values())
        keys = torch_internals.compiled_kernel_keys()  # here: the training thread's compiles add to them
        log.debug("torch's compile caches serialized in %.1f ms", (time.perf_counter() - started) * 1e3)
        self._thread = threading.Thread(target=self._commit, args=(saved[0], artifacts, keys, lease),
                                        name="compile-cache", daemon=True)
        self._thread.start()

    def _commit(self, mega: bytes, artifacts: int, keys: set[str], lease: RunLease) -> None:
        try:
            kernels = kernel_files(torch_internals.inductor_cache_dir(), keys)
            if artifacts + len(kernels) <= self._saved:
                return
            self.caches.commit(self.key, pack(mega, kernels), self.describes, lease)
            self._saved = artifacts + len(kernels)
        except LeaseLostError as e:
            log.info("compile caches not saved: %s", e)
        except Exception as e:  # the job goes on: the caches are a start-up's saving, not the run's state
            log.warning("could not save the compile caches to %s: %s", self.caches.url,
                        explain_storage_error(e, self.caches.run.local))

    def finish(self, timeout_s: float = 10.0) -> None:
        """Let a save in flight end (bounded: leaving on SIGTERM must stay quick)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _say(self, level: int, message: str, *args) -> None:
        log.log(level if self.announce else logging.DEBUG, message, *args)


def kernel_files(root: str, keys: set[str]) -> dict[str, str]:
    """The C++ libraries of `keys` and Inductor's probes, under Inductor's cache folder `root`: {name in zip: path}."""
    found = {}
    for key in keys:
        folder = os.path.join(root, key[1:3])
        for name in _names(folder):
            if name.startswith(key) and name.endswith(".so"):
                found[f"kernels/{key[1:3]}/{name}"] = os.path.join(folder, name)
    probes = torch_internals.cpu_probe_sources()
    for sub in _names(root):
        folder = os.path.join(root, sub)
        if len(sub) != 2 or not os.path.isdir(folder):
            continue
        for name in _names(folder):
            source = os.path.join(folder, name[:-3] + ".cpp")
            if name.endswith(".so") and _is_probe(source, probes):
                found[f"kernels/{sub}/{name}"] = os.path.join(folder, name)
    return {name: path for name, path in found.items() if _KERNEL.match(name)}


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _is_probe(source: str, probes: set[str]) -> bool:
    try:
        if os.path.getsize(source) > _PROBE_SOURCE_MAX:
            return False
        with open(source, encoding="utf-8", errors="replace") as f:
            return f.read().strip() in probes
    except OSError:
        return False


def pack(mega: bytes, kernels: dict[str, str]) -> bytes:
    """torch's caches and the kernel files, as one zip (stored: compiled code hardly compresses)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(MEGA_CACHE, mega)
        for name, path in sorted(kernels.items()):
            with open(path, "rb") as f:
                z.writestr(name, f.read())
    return out.getvalue()


def install(blob: bytes) -> dict[str, int]:
    """Put the kernels of `blob` into Inductor's cache folder (never over one), then hand torch its caches. Any other
    name is refused (ValueError): nothing is written outside the folder."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        names = z.namelist()
        strange = [name for name in names if name != MEGA_CACHE and not _KERNEL.match(name)]
        if strange or MEGA_CACHE not in names:
            raise ValueError(f"the zip holds {strange[0]!r}" if strange else f"the zip lacks {MEGA_CACHE}")
        root = torch_internals.inductor_cache_dir()
        kernels = [name for name in names if name != MEGA_CACHE]
        added = sum(_put_kernel(root, name, z.read(name)) for name in kernels)
        counts = torch_internals.load_cache_artifacts(z.read(MEGA_CACHE))
    log.debug("%d of %d kernels were new to %s", added, len(kernels), root)
    return {**counts, "kernels": len(kernels)}


def _put_kernel(root: str, name: str, data: bytes) -> int:
    """1 where the kernel was added, 0 where one was there or a folder is not this user's alone (it is code to load)."""
    match = _KERNEL.match(name)
    sub, filename = match[1], match[2]
    folder = os.path.join(root, sub)
    for place in (root, folder):  # /tmp/torchinductor_$USER, torch's default, is in a folder every user writes
        os.makedirs(place, mode=0o700, exist_ok=True)
        if not private_folder(place, others=0o022):
            log.debug("skipping kernel %s: %s is not a folder that only this user can write", filename, place)
            return 0
    try:  # written whole under a temporary name, then linked: another process never sees a part of it
        create_exclusive(fsspec.filesystem("file"), os.path.join(folder, filename), data)
    except FileExistsError:
        return 0
    return 1
