"""torch.compile's caches in the run folder (issue 38): the key, the commit, what a reader refuses, and a run on
a machine with an empty Inductor cache that compiles from another machine's caches."""

import hashlib
import io
import json
import logging
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from launch import MAIN, SMALL, Processes, env, output, train_here
from mingpt import torch_internals
from mingpt.checkpoint.compiled import MANIFEST, CompiledCaches
from mingpt.checkpoint.lease import LeaseLostError, RunLease
from mingpt.checkpoint.store import SnapshotStore
from mingpt.jobenv import JobEnv
from mingpt.rundir import RunDir
from mingpt.shape import GPTConfig
from mingpt.training import compile_cache
from mingpt.training.compile_cache import CompileCache, describe, key_of
from test_architecture import imported, modules

NANO = GPTConfig.from_preset("gpt-nano", vocab_size=65, block_size=32)
CPU = torch.device("cpu")
KEY = key_of(describe(NANO, CPU, torch.float32, "ddp"))


@pytest.fixture
def run(tmp_path):
    """A run folder and the lease on it, as the writer of a job holds it."""
    store = SnapshotStore(str(tmp_path / "run"))
    lease = store.claim(60.0, JobEnv())
    yield store.run, lease
    lease.release()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def any_run(request, tmp_path):
    """A run folder on local disk or S3 (moto on 127.0.0.1), and the lease on it."""
    url = str(tmp_path / "run") if request.param == "local" else f"s3://{request.getfixturevalue('s3').bucket}/run"
    store = SnapshotStore(url)
    lease = store.claim(60.0, JobEnv())
    yield store.run, lease
    lease.release()


def blob_path(run: RunDir) -> Path:
    manifest = json.loads(Path(run.compile_cache, MANIFEST).read_text())
    return Path(run.compile_cache, manifest["file"])


# What torch.backends.cpu.get_cpu_capability() says on one CPU or another (ATEN_CPU_CAPABILITY lowers it).
CPU_CAPABILITIES = ("DEFAULT", "NO AVX", "AVX2", "AVX512", "SVE256", "VSX", "Z VECTOR")


def test_the_key_changes_with_what_makes_compiled_code_valid():
    """Whatever CPU runs it: the key is this CPU's capability's, and differs for any other."""
    here = describe(NANO, CPU, torch.float32, "ddp")
    assert here["capability"] == torch.backends.cpu.get_cpu_capability()
    assert key_of(describe(NANO, CPU, torch.float32, "ddp")) == KEY  # a digest, the same in every process
    wider = GPTConfig.from_preset("gpt-nano", vocab_size=65, block_size=64)
    others = [describe(wider, CPU, torch.float32, "ddp"), describe(NANO, CPU, torch.bfloat16, "ddp"),
              describe(NANO, CPU, torch.float32, "fsdp"), {**here, "torch": "2.99.0"},
              *({**here, "capability": other} for other in CPU_CAPABILITIES if other != here["capability"])]
    assert len({KEY, *map(key_of, others)}) == len(others) + 1


def test_committed_caches_read_back_and_only_the_newest_key_stays(any_run):
    run, lease = any_run
    caches = CompiledCaches(run)
    assert caches.read(KEY) is None  # none yet: nothing said above DEBUG
    caches.commit("a" * 32, b"old caches", {}, lease)
    caches.commit(KEY, b"compiled", {"torch": "x"}, lease)
    assert CompiledCaches(run).read(KEY) == b"compiled"
    manifest = json.loads(run.fs.cat_file(f"{run.compile_cache}/{MANIFEST}"))
    assert manifest["sha256"] == hashlib.sha256(b"compiled").hexdigest() and manifest["writer"]["job"] == lease.job
    run.fs.invalidate_cache(run.compile_cache)
    names = sorted(path.rsplit("/", 1)[-1] for path in run.fs.ls(run.compile_cache, detail=False))
    assert names == sorted([MANIFEST, manifest["file"]])  # the old key's caches are gone


def test_a_writer_whose_lease_a_newer_generation_took_writes_nothing(run):
    run, lease = run
    newer = RunLease(run, 60.0, job=lease.job)  # the next generation of the same job takes the run at once
    newer.acquire()
    try:
        with pytest.raises(LeaseLostError):
            CompiledCaches(run).commit(KEY, b"compiled", {}, lease)
        assert not Path(run.compile_cache).exists() or not any(Path(run.compile_cache).iterdir())
    finally:
        newer.release()


@pytest.mark.parametrize("damage", ["truncated", "bit flipped", "no writer"])
def test_damaged_caches_are_skipped_with_one_warning_and_the_worker_goes_on(run, caplog, monkeypatch, damage):
    run, lease = run
    CompiledCaches(run).commit(KEY, b"compiled code" * 100, {}, lease)
    path = blob_path(run)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:-7])
    elif damage == "bit flipped":
        path.write_bytes(data[:50] + bytes([data[50] ^ 1]) + data[51:])
    else:  # a manifest that no lease holder wrote
        manifest = json.loads(Path(run.compile_cache, MANIFEST).read_text())
        del manifest["writer"]
        Path(run.compile_cache, MANIFEST).write_text(json.dumps(manifest))
    caplog.set_level(logging.INFO, "mingpt")
    loaded = []
    monkeypatch.setattr(compile_cache, "install", lambda blob: loaded.append(blob) or {})
    CompileCache(run, describe(NANO, CPU, torch.float32, "ddp"), announce=True).load()  # returns: the job goes on
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert loaded == [] and len(warnings) == 1 and "not loaded" in warnings[0] and "from scratch" in warnings[0]


def test_caches_of_another_key_are_never_loaded_and_left_alone(run, caplog):
    run, lease = run
    other = {**describe(NANO, CPU, torch.float32, "ddp"), "torch": "2.99.0"}
    CompiledCaches(run).commit(key_of(other), b"another torch's code", other, lease)
    caplog.set_level(logging.INFO, "mingpt")
    caplog.clear()  # what the commit said, where an earlier test left INFO on
    assert CompiledCaches(run).read(KEY) is None
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(said) == 1 and said[0][0] == logging.INFO and "another torch" in said[0][1]
    assert blob_path(run).read_bytes() == b"another torch's code"


def test_a_zip_naming_anything_but_kernels_and_the_mega_cache_installs_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_internals, "inductor_cache_dir", lambda: str(tmp_path / "inductor"))
    for name in ["../../evil.so", "kernels/ab/../../evil.so", "kernels/ab/cxyz.py"]:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            z.writestr(compile_cache.MEGA_CACHE, b"")
            z.writestr("kernels/ab/cabcdefghijklmnopqrstuvwxyz.so", b"ELF")
            z.writestr(name, b"ELF")
        with pytest.raises(ValueError, match="the zip holds"):
            compile_cache.install(out.getvalue())
    assert not (tmp_path / "inductor").exists() and not (tmp_path / "evil.so").exists()


def test_a_kernel_goes_beside_the_local_ones_never_over_one(tmp_path):
    name = "kernels/ab/cabcdefghijklmnopqrstuvwxyz.main.so"
    assert compile_cache._put_kernel(str(tmp_path), name, b"theirs") == 1
    assert compile_cache._put_kernel(str(tmp_path), name, b"other") == 0
    assert (tmp_path / "ab" / "cabcdefghijklmnopqrstuvwxyz.main.so").read_bytes() == b"theirs"
    assert [p.name for p in (tmp_path / "ab").iterdir()] == ["cabcdefghijklmnopqrstuvwxyz.main.so"]  # no leftovers
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cd").symlink_to(tmp_path / "elsewhere")  # planted: the kernel would land where the link points
    assert compile_cache._put_kernel(str(tmp_path), "kernels/cd/ccdefghijklmnopqrstuvwxyz.so", b"ELF") == 0
    assert not any((tmp_path / "elsewhere").iterdir())
    (tmp_path / "ef").mkdir(mode=0o777)
    (tmp_path / "ef").chmod(0o777)  # this user's, but anyone may write in it
    assert compile_cache._put_kernel(str(tmp_path), "kernels/ef/cefghijklmnopqrstuvwxyzab.so", b"ELF") == 0
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # the cache folder itself: nothing is made in it
    assert compile_cache._put_kernel(str(shared), "kernels/gh/cghijklmnopqrstuvwxyzabcd.so", b"ELF") == 0
    assert not any(shared.iterdir())


def test_the_kernels_that_travel_are_the_graphs_libraries_and_the_cpu_probes(tmp_path):
    kernel, probe, other = "cab" + "k" * 49, "ccd" + "p" * 49, "cef" + "o" * 49
    for key, source in [(kernel, "a kernel"), (probe, next(iter(torch_internals.cpu_probe_sources()))),
                        (other, "another model's kernel")]:
        (tmp_path / key[1:3]).mkdir()
        (tmp_path / key[1:3] / f"{key}.main.cpp").write_text(source)
        (tmp_path / key[1:3] / f"{key}.main.so").write_bytes(b"ELF")
    found = compile_cache.kernel_files(str(tmp_path), {kernel})
    assert found == {f"kernels/ab/{kernel}.main.so": str(tmp_path / "ab" / f"{kernel}.main.so"),
                     f"kernels/cd/{probe}.main.so": str(tmp_path / "cd" / f"{probe}.main.so")}


def test_only_the_training_job_can_reach_the_loading_of_compile_caches():
    tree = modules()
    known = set(tree)
    for command in ("mingpt.cli.sample", "mingpt.cli.export", "mingpt.cli.snapshot"):
        reached, todo = set(), [command]
        while todo:
            module = todo.pop()
            if module not in reached and module in tree:
                reached.add(module)
                todo += imported(tree[module], known)
        assert "mingpt.training.compile_cache" not in reached and "mingpt.training.trainer" not in reached, command


def test_this_torch_has_what_the_compile_caches_rely_on():
    assert torch_internals.compiled_names_missing() == []


def train_with_cache(procs: Processes, root: Path, cache: Path, name: str, *overrides: str) -> str:
    environment = {**env(), "TORCHINDUCTOR_CACHE_DIR": str(cache),  # this "machine"'s own Inductor cache
                   "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # a few kernels: no pool of compiling processes to start
    proc = procs.start([sys.executable, MAIN, *SMALL, "model.n_layer=1", "trainer.compile=true", "trainer.log_every=1",
                        f"snapshot.dir={root / 'snap'}", f"data.prepared_dir={root / 'prepared'}", *overrides],
                       name, environment=environment)
    assert proc.wait(timeout=170) == 0, output(proc)[-4000:]
    return output(proc)


def losses(snap: Path, steps: int) -> dict[int, float]:
    records = [json.loads(line) for line in (snap / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r and r["step"] <= steps}


@pytest.mark.slow
def test_a_worker_on_a_new_machine_compiles_from_the_runs_caches(tmp_path, procs):
    """A compiled job trains as the eager one does; a second "machine" with an empty Inductor cache goes on
    from the caches the first committed to the run, compiling nothing. One layer: fewer kernels to build cold
    (a fresh clone's cache is empty)."""
    first = train_with_cache(procs, tmp_path, tmp_path / "machine-1", "first", "trainer.max_steps=10")
    assert "torch.compile on (as configured)" in first
    train_here(tmp_path / "eager", "model.n_layer=1", "trainer.max_steps=10", "trainer.log_every=1",
               "trainer.compile=false")
    compiled, eager = losses(tmp_path / "snap", 10), losses(tmp_path / "eager" / "snap", 10)
    assert list(compiled) == list(range(1, 11)) and list(compiled.values()) == pytest.approx(list(eager.values()),
                                                                                             rel=1e-4)
    assert "fxgraph_cache_miss 2" in first and "compile caches committed" in first
    manifest = json.loads((tmp_path / "snap" / "compile-cache" / MANIFEST).read_text())
    assert manifest["describes"]["model"]["n_layer"] == 1 and manifest["describes"]["device"] == "cpu"
    blob = (tmp_path / "snap" / "compile-cache" / manifest["file"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == manifest["sha256"]
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        assert any(name.endswith(".so") for name in z.namelist())  # Inductor's C++ kernels travel too

    second = train_with_cache(procs, tmp_path, tmp_path / "machine-2", "second", "trainer.max_steps=12")
    assert "compile caches loaded from" in second
    # Every graph came from the caches: none compiled here; and what the run holds is not written again.
    assert "fxgraph_cache_hit 2, fxgraph_cache_miss 0, autograd_cache_hit 1, autograd_cache_miss 0" in second
    assert "compile caches committed" not in second
