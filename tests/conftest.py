import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch

from launch import Processes, Reference, WarmPython, train_here


def pytest_configure(config):
    """Bytecode caches are written, whatever PYTHONDONTWRITEBYTECODE says: the suite starts dozens of new Pythons
    (those not forked warm: launch.WarmPython), and without caches each one compiles what it imports from source
    again (pip's torch comes with them, uv's packages only with --compile-bytecode), 0.3-0.7 s of CPU a process.

    Under pytest-xdist each test process trains with one thread: the cores are shared with the other ones.
    So does every process a test starts (launch.env() sets it too, but not every test starts its processes
    with that): two threads each on two shared cores spin-wait for one another."""
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # for every process started from here on
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True, scope="session")
def cache_in_tmp(tmp_path_factory):
    """Caches the code writes (the peak-FLOP probe's) go to a temporary folder, not the user's home,
    and Hugging Face's libraries never reach for the network: every model a test uses is made here."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def warm_python(cache_in_tmp):
    """The Python that this test process's commands are forked from (launch.WarmPython), started on first use."""
    warm = WarmPython()
    yield warm
    warm.stop()


@pytest.fixture
def procs(tmp_path, warm_python):
    """Processes a test starts (see launch.Processes); whatever still runs is ended after the test."""
    started = Processes(tmp_path, warm_python)
    yield started
    started.close()


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    """A small corpus with some non-ASCII text, written by the test itself."""
    lines = [f"Line {i}: the quick brown fox jumps over the lazy dog. Café, naïve, 東京 {i % 7}\n" for i in range(400)]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture
def closed_port() -> int:
    """A loopback port with nothing listening: connecting to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_env(tmp_path: Path, closed_port: int) -> dict:
    """An environment in which HTTP(S) goes to a closed loopback port, so no download can succeed
    and no packet leaves the machine."""
    proxy = f"http://127.0.0.1:{closed_port}"
    env = dict(os.environ)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env[name] = proxy
    env["NO_PROXY"] = env["no_proxy"] = ""
    env["TIKTOKEN_CACHE_DIR"] = str(tmp_path / "empty-tiktoken-cache")
    return env


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 on 127.0.0.1 behind the fault-injecting middleware; stopped after the session."""
    from s3server import FaultyS3

    server = FaultyS3()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """A fresh bucket on the loopback S3 server; this process and its children talk to it alone."""
    import re
    import uuid

    import boto3
    from s3fs import S3FileSystem

    s3_server.reset()
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    # s3fs keeps one file system per set of arguments, with the credentials and endpoint of the moment it
    # was made: each test makes its own, so that one that changes them (a wrong key) affects no other.
    S3FileSystem.clear_instance_cache()
    bucket = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    boto3.client("s3", endpoint_url=s3_server.endpoint).create_bucket(Bucket=bucket)
    s3_server.bucket = bucket
    yield s3_server
    S3FileSystem.clear_instance_cache()
    s3_server.reset()


def s3_keys(server, prefix: str = "") -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=server.endpoint)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


# A corpus of its own, with non-ASCII text, for the runs the tests share.
TEXT = "\n\n".join(
    f"Section {i}: the {animal} jumps over {n} lazy dogs, doesn't it? Naïve café owners count {n * 7} coins."
    for i, (animal, n) in enumerate(zip(["fox", "cat", "owl", "émeu"] * 40, range(160))))


def trained_run(root: Path, *overrides: str) -> Path:
    """A small run trained in this process (snapshots at steps 20 and 40); its snapshot folder. The corpus
    and the prepared data are deleted afterwards: whatever only reads a snapshot must not need them."""
    (root / "corpus.txt").write_text(TEXT)
    train_here(root, f"data.corpus={root / 'corpus.txt'}", "trainer.max_steps=40", "snapshot.every=20", *overrides)
    (root / "corpus.txt").unlink()
    shutil.rmtree(root / "prepared")
    return root / "snap"


@pytest.fixture(scope="session")
def char_run(tmp_path_factory) -> Path:
    """One char-level run for every test that only reads snapshots. Do not change it."""
    return trained_run(tmp_path_factory.mktemp("char-run"))


@pytest.fixture(scope="session")
def bpe_run(tmp_path_factory) -> Path:
    """The same with a BPE vocabulary. Do not change it."""
    return trained_run(tmp_path_factory.mktemp("bpe-run"), "data.tokenizer=bpe", "data.vocab_size=300")


def pytest_collection_modifyitems(config, items):
    """The marks that follow from a test's fixtures: `procs` starts processes, `s3` talks to the S3 server.
    The tests under a real Slurm run only where -m names them (.ci/run runs them apart, after the others).
    Then the slow tests are spread over the test processes, first in each one's share (slow_first_in_each_share)."""
    if "slurm" not in config.option.markexpr:
        slurm = [item for item in items if item.get_closest_marker("slurm")]
        config.hook.pytest_deselected(items=slurm)
        items[:] = [item for item in items if not item.get_closest_marker("slurm")]
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "procs" in fixtures:
            item.add_marker(pytest.mark.multiproc)
        if "s3" in fixtures or "s3_server" in fixtures:
            item.add_marker(pytest.mark.s3)
    items[:] = slow_first_in_each_share(items, getattr(config, "workerinput", {}).get("workercount", 1))


def slow_first_in_each_share(items: list, processes: int) -> list:
    """pytest-xdist's worksteal hands each of its `processes` a contiguous share of the list, the first
    len/processes items to one and so on, and a process that runs out takes from the end of another's queue.
    So each share starts with its own part of the slow tests: they run early and side by side, and what is
    left to take over at the end is short tests, not one long test finishing alone. File order otherwise."""
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = iter([item for item in items if not item.get_closest_marker("slow")])
    ordered, left = [], len(items)
    for share in range(processes):
        size = left // (processes - share)  # as worksteal splits the list
        left -= size
        mine = slow[share::processes]
        ordered += mine + [item for _, item in zip(range(size - len(mine)), fast)]
    return ordered + list(fast)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, warm_python):
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reference"  # the session's
    root.mkdir(exist_ok=True)
    procs = Processes(root, warm_python)
    yield Reference(root, procs)
    procs.close()
