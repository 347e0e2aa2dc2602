"""data.prepared_dir on S3 (a real S3 server on 127.0.0.1): prepared once by the node that claims it,
copied by every other node with ranged reads, each file checked before it is used."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import boto3
import pytest

from conftest import s3_keys
from launch import BIN, output
from mingpt import claim
from mingpt.data import remote
from mingpt.data.job import Job
from mingpt.data.prepare import PrepareConfig, prepare
from mingpt.data.prepared import PreparedData
from mingpt.errors import DataError


@pytest.fixture
def shared(s3, corpus_file, monkeypatch):
    """A config per node: the same corpus and prepared_dir URL, each node its own local copy."""
    monkeypatch.setattr(remote, "CHUNK_BYTES", 4096)  # several ranged reads per file
    monkeypatch.setattr(remote, "POLL_S", 0.05)
    url = f"s3://{s3.bucket}/prepared/corpus-char"
    return lambda copy: PrepareConfig(corpus=str(corpus_file), prepared_dir=url, local_copy=str(copy))


def refuse_to_tokenize(monkeypatch):
    """This node must copy: preparing here fails the test."""
    def refuse(*args):
        raise AssertionError("this node tokenized the corpus")
    monkeypatch.setattr(Job, "build", refuse)


def put(s3, key: str, body: bytes) -> None:
    boto3.client("s3", endpoint_url=s3.endpoint).put_object(Bucket=s3.bucket, Key=key, Body=body)


def plant_claim(s3, folder: str, record: dict, generation: int = 1) -> None:
    """A claim of `folder` (under prepared/), as another node would have made it."""
    body = json.dumps({**record, "generation": generation}).encode()
    put(s3, f"prepared/{folder}/claim/gen-{generation:09d}.json", body)


def newest_claim(url: str) -> claim.Claim | None:
    return remote.RemoteFolder(url)._claims().newest()


def test_the_first_node_publishes_and_the_next_copies_without_tokenizing(tmp_path, s3, shared, monkeypatch):
    first = prepare(shared(tmp_path / "node-a"))
    assert first == tmp_path / "node-a"
    assert s3_keys(s3, "prepared/") == [f"prepared/corpus-char/{name}" for name in
                                        ("claim/gen-000000001.json", "meta.json", "tokenizer.json", "train.bin",
                                         "val.bin")]
    assert newest_claim(shared(tmp_path).prepared_dir).record["released"] is True

    refuse_to_tokenize(monkeypatch)
    s3.requests.clear()
    second = prepare(shared(tmp_path / "node-b"))
    assert second == tmp_path / "node-b"
    for name in ("meta.json", "tokenizer.json", "train.bin", "val.bin"):
        assert (second / name).read_bytes() == (first / name).read_bytes(), name
    assert PreparedData(second).fingerprint == PreparedData(first).fingerprint
    size = (first / "train.bin").stat().st_size
    reads = [r for r in s3.requests if r[0] == "GET" and r[1].endswith("/train.bin")]
    assert len(reads) == -(-size // 4096) > 1  # ranged reads, one per chunk
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no scratch folders

    s3.requests.clear()
    assert prepare(shared(tmp_path / "node-b")) == second  # a restart: the copy is current, nothing is read
    assert not [r for r in s3.requests if r[1].endswith(".bin")]


def test_a_changed_corpus_is_prepared_again_and_published_over_the_old(tmp_path, s3, shared, corpus_file, monkeypatch):
    old = PreparedData(prepare(shared(tmp_path / "node-a"))).fingerprint
    corpus_file.write_text(corpus_file.read_text() + "A line that was not there before.\n")
    new = PreparedData(prepare(shared(tmp_path / "node-a"))).fingerprint
    assert new != old
    refuse_to_tokenize(monkeypatch)
    assert PreparedData(prepare(shared(tmp_path / "node-b"))).fingerprint == new


def test_a_damaged_upload_is_never_used_and_nothing_is_left(tmp_path, s3, shared, monkeypatch):
    first = prepare(shared(tmp_path / "node-a"))
    tokens = bytearray((first / "train.bin").read_bytes())
    tokens[len(tokens) // 2] ^= 1  # one bit, same size
    put(s3, "prepared/corpus-char/train.bin", bytes(tokens))
    refuse_to_tokenize(monkeypatch)
    with pytest.raises(DataError) as e:
        prepare(shared(tmp_path / "node-b"))
    message = str(e.value)
    assert "train.bin is not what meta.json describes (sha256)" in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "node-a"]  # no copy, no scratch folder


def test_a_claim_whose_beat_stops_is_taken_over_and_a_beating_one_is_waited_for(tmp_path, s3, shared, caplog,
                                                                                  monkeypatch):
    monkeypatch.setattr(remote, "CLAIM_TIMEOUT_S", 1.0)
    monkeypatch.setattr(remote, "BEAT_S", 0.2)
    # A live node holds the claim (its beat advances) for 3 s, three times the timeout: it is waited for.
    folder = remote.RemoteFolder(shared(tmp_path).prepared_dir)
    claim = folder.try_claim()
    assert claim is not None and folder.try_claim() is None

    order = []

    def publish_late():
        time.sleep(3)
        built = prepare(replace(shared(tmp_path), prepared_dir=str(tmp_path / "built")))
        order.append("holder publishes")
        folder.upload(built, PreparedData(built).meta)
        claim.release()
    holder = threading.Thread(target=publish_late)
    holder.start()
    with caplog.at_level(logging.INFO, logger="mingpt"):
        waited = prepare(shared(tmp_path / "waiter"))
    order.append("waiter returns")
    holder.join()
    assert order == ["holder publishes", "waiter returns"]  # it waited for the holder, however long that took
    assert "stopped; preparing it here instead" not in caplog.text
    assert "copied s3://" in caplog.text
    assert PreparedData(waited).fingerprint == PreparedData(tmp_path / "built").fingerprint

    # A node that died left its claim: its beat never moves, and after the timeout it is taken over by the next
    # generation, the dead node's left as it was.
    for key in s3_keys(s3, "prepared/"):
        boto3.client("s3", endpoint_url=s3.endpoint).delete_object(Bucket=s3.bucket, Key=key)
    plant_claim(s3, "corpus-char", {"host": "node-that-died", "pids": [[7, 1]], "beat": 3}, generation=4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mingpt"):
        prepare(shared(tmp_path / "survivor"))
    assert "(host node-that-died, pid 7) stopped; preparing it here instead" in caplog.text
    assert "prepared/corpus-char/meta.json" in s3_keys(s3, "prepared/")
    taken = newest_claim(shared(tmp_path).prepared_dir)
    assert taken.generation == 5 and taken.record["released"] is True and taken.record["pids"][0][0] == os.getpid()


def test_a_published_description_that_contradicts_itself_is_refused(tmp_path, s3, shared, monkeypatch):
    """Every hash matches, but its dtype is not what its tokens are: damaged, not replaced, not trained on."""
    first = prepare(shared(tmp_path / "node-a"))
    meta = PreparedData(first).meta
    refuse_to_tokenize(monkeypatch)
    for dtype in ("uint8", "uint32"):
        put(s3, "prepared/corpus-char/meta.json", json.dumps({**meta, "dtype": dtype}).encode())
        with pytest.raises(DataError, match=rf"corpus-char/meta.json is damaged: its dtype is '{dtype}'"):
            prepare(shared(tmp_path / "node-b"))
        assert not (tmp_path / "node-b").exists()


def test_a_claim_that_cannot_be_read_does_not_hold_the_data(tmp_path, s3, shared, monkeypatch, caplog):
    """Empty, garbage, a silent claim of exactly the largest size read, one byte more: each ends published,
    the readable one after its timeout, the others skipped as no claim. (S3 cannot satisfy a range of an
    empty object: that is an empty file, not a failure.)"""
    monkeypatch.setattr(remote, "CLAIM_TIMEOUT_S", 0.3)
    record = json.dumps({"generation": 1, "host": "node-that-died", "pids": [[7, 1]], "beat": 3, "pad": ""})
    largest = record.replace('"pad": ""', '"pad": "' + "x" * (claim.MAX_CLAIM_BYTES - len(record)) + '"')
    assert len(largest) == claim.MAX_CLAIM_BYTES
    for body, taken_over in [(b"", False), (b"\x00garbage\xff{[", False), (largest.encode(), True),
                             (largest.encode() + b" ", False)]:
        for key in s3_keys(s3, "prepared/"):
            boto3.client("s3", endpoint_url=s3.endpoint).delete_object(Bucket=s3.bucket, Key=key)
        put(s3, "prepared/corpus-char/claim/gen-000000001.json", body)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mingpt"):
            out = prepare(shared(tmp_path / f"node-{len(body)}"))
        assert "prepared/corpus-char/meta.json" in s3_keys(s3, "prepared/"), len(body)
        assert PreparedData(out).meta["sha256"]
        assert ("(host node-that-died, pid 7) stopped; preparing it here instead" in caplog.text) == taken_over
        assert ("is not a claim; skipping it" in caplog.text) != taken_over
        assert newest_claim(shared(tmp_path).prepared_dir).generation == 2
    put(s3, "prepared/corpus-char/meta.json", b"")  # an empty description is damaged, not unreadable
    with pytest.raises(DataError, match=r"meta.json.*damaged") as e:
        prepare(shared(tmp_path / "node-empty-meta"))
    assert "OSError" not in str(e.value)


@pytest.mark.parametrize("reused", [False, True])
def test_a_claim_of_a_dead_process_on_this_machine_is_taken_over_at_once(tmp_path, s3, shared, monkeypatch, reused):
    """Dead by pid and start time: a pid that a new process took since (here: this very process) does not
    keep a dead claim alive."""
    monkeypatch.setattr(remote, "CLAIM_TIMEOUT_S", 3600.0)  # only the dead process can end the wait
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    process = [os.getpid(), claim.start_time(os.getpid()) + 1] if reused else [gone.pid, 1]
    plant_claim(s3, "corpus-char", {**claim.holder([]), "pids": [process], "beat": 0})
    assert PreparedData(prepare(shared(tmp_path / "node-a"))).meta["train_tokens"] > 0
    assert newest_claim(shared(tmp_path).prepared_dir).generation == 2


def test_a_claim_json_of_an_older_version_is_no_claim(tmp_path, s3, shared, monkeypatch):
    """An older version claimed with one file, claim.json, deleted on take-over; one left in a published folder
    (its node died) holds up no preparation of this version, and stays as it was."""
    monkeypatch.setattr(remote, "CLAIM_TIMEOUT_S", 3600.0)  # a wait would end the test by pytest's timeout
    old = json.dumps({**claim.holder([]), "host": "old-node", "beat": 7}).encode()
    put(s3, "prepared/corpus-char/claim.json", old)
    assert PreparedData(prepare(shared(tmp_path / "node-a"))).meta["train_tokens"] > 0
    assert boto3.client("s3", endpoint_url=s3.endpoint).get_object(
        Bucket=s3.bucket, Key="prepared/corpus-char/claim.json")["Body"].read() == old


@pytest.mark.parametrize("where", ["local", "s3"])
def test_of_takers_of_a_dead_claim_at_once_exactly_one_wins(tmp_path, where, request):
    """Every waiter that found the same dead holder takes its claim over at the same moment: one creates the
    next generation and prepares, the others find it claimed and wait for it. Nothing is deleted, so no taker
    can remove a claim another taker has just made."""
    url = str(tmp_path / "published") if where == "local" else f"s3://{request.getfixturevalue('s3').bucket}/published"
    folder = remote.RemoteFolder(url)
    gone = folder._claims().take(lambda holder: True)  # a claim that nobody renews: its node died
    start, won = threading.Barrier(6), []

    def take() -> None:
        start.wait()
        taken = folder.try_claim(gone)
        if taken is not None:
            won.append(taken)

    takers = [threading.Thread(target=take) for _ in range(6)]
    for t in takers:
        t.start()
    for t in takers:
        t.join()
    try:
        assert len(won) == 1 and won[0].held.generation == gone.generation + 1
        assert folder._claims().newest().record["token"] == won[0].held.record["token"]
        assert folder._claims().read(gone.generation) == gone.record  # the dead node's claim, as it was
        assert folder.try_claim(gone) is None  # the winner holds it now, not the dead node
    finally:
        for taken in won:
            taken.release()


def test_two_nodes_starting_together_prepare_once(tmp_path, s3, corpus_file, procs):
    """Two mingpt-prepare processes (two machines' worth: each its own local copy) on one URL."""
    url = f"s3://{s3.bucket}/prepared/corpus-bpe"
    command = [str(BIN / "mingpt-prepare"), "--corpus", str(corpus_file), "--tokenizer", "bpe", "--vocab-size", "300",
               "--out", url, "--local-copy"]
    nodes = [procs.start(command + [str(tmp_path / name)], name) for name in ("node-a", "node-b")]
    for node in nodes:
        assert node.wait(timeout=120) == 0, output(node)
    texts = [output(node) for node in nodes]
    assert sum("here (this node claimed it)" in text for text in texts) == 1, texts
    assert sum("copied s3://" in text for text in texts) == 1, texts
    assert PreparedData(tmp_path / "node-a").fingerprint == PreparedData(tmp_path / "node-b").fingerprint
    assert f"(the local copy of {url})" in texts[0]


def test_a_bucket_that_is_not_there_is_one_line_naming_the_setting_and_nothing_is_written(tmp_path, s3, corpus_file):
    config = PrepareConfig(corpus=str(corpus_file), prepared_dir="s3://no-such-bucket-here/prepared",
                           local_copy=str(tmp_path / "copy"))
    with pytest.raises(DataError) as e:
        prepare(config)
    message = str(e.value)
    assert message.startswith("cannot claim data.prepared_dir=s3://no-such-bucket-here/prepared: the bucket does "
                              "not exist"), message
    assert message.endswith("create it or fix data.prepared_dir") and "\n" not in message
    assert not (tmp_path / "copy").exists()


def test_an_untrusted_claim_or_description_is_bounded_and_typed(tmp_path, s3, corpus_file, monkeypatch):
    """A claim is another node's word: one of a MB is not read whole at every poll (nor logged), a pid no
    process can have is no error, and a description's dtype is one the token files are written in."""
    folder = remote.RemoteFolder(f"s3://{s3.bucket}/prepared/x")
    plant_claim(s3, "x", {"host": "h" * 2**20, "pids": [[1, 1]], "beat": 0})
    reads, cat_file = [], folder.fs.cat_file
    monkeypatch.setattr(folder.fs, "cat_file", lambda path, start=None, end=None: reads.append(end) or
                        cat_file(path, start=start, end=end))
    assert folder._claims().newest() is None  # not a claim: skipped
    assert reads == [claim.MAX_CLAIM_BYTES + 1]  # and never read whole
    for pid in (-1, 0):  # never a signal to a process group
        assert claim.process_alive(pid) is False
    assert claim.ended_here({**claim.holder([]), "pids": [[2**70, 1]]}) is False  # cannot tell: alive
    local = tmp_path / "prepared"
    prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=str(local)))
    meta = json.loads((local / "meta.json").read_text())
    (local / "meta.json").write_text(json.dumps({**meta, "dtype": "garbage"}))
    with pytest.raises(DataError, match="its dtype is 'garbage', not one of uint16, uint32"):
        PreparedData(local)


def test_a_node_with_read_only_credentials_copies_what_another_published(tmp_path, s3, shared, monkeypatch):
    first = prepare(shared(tmp_path / "node-a"))
    s3.requests.clear()
    for method in ("PUT", "POST", "DELETE"):  # as a role that may read the bucket, and nothing more
        s3.add(method, ".", "error", count=float("inf"), status=403, code="AccessDenied")
    refuse_to_tokenize(monkeypatch)
    second = prepare(shared(tmp_path / "node-b"))
    assert (second / "train.bin").read_bytes() == (first / "train.bin").read_bytes()
    assert not [r for r in s3.requests if r[0] != "GET" and r[0] != "HEAD"]


def test_a_published_folder_of_an_older_format_is_prepared_again_and_replaced(tmp_path, s3, shared, caplog):
    prepare(shared(tmp_path / "node-a"))
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    key = "prepared/corpus-char/meta.json"
    meta = json.loads(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    put(s3, key, json.dumps({**meta, "version": meta["version"] - 1}).encode())
    with caplog.at_level(logging.INFO, logger="mingpt"):
        out = prepare(shared(tmp_path / "node-b"))
    assert "preparing" in caplog.text and "published" in caplog.text
    republished = json.loads(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    assert republished["version"] == meta["version"] and PreparedData(out).fingerprint == meta["fingerprint"]
    put(s3, key, json.dumps({**meta, "version": meta["version"] + 1}).encode())  # a newer one is not ours to replace
    with pytest.raises(DataError, match="newer"):
        prepare(shared(tmp_path / "node-c"))


def test_a_frozen_preparer_on_this_machine_is_named_not_taken_over(tmp_path, s3, shared, monkeypatch, procs):
    """Its claim stops beating, but the process runs (SIGSTOP) and holds this machine's lock: taking its claim
    over would wait on that lock for good. One line names it instead."""
    monkeypatch.setattr(remote, "CLAIM_TIMEOUT_S", 1.0)
    frozen = procs.start([sys.executable, "-c", "import time; time.sleep(120)"], "frozen")
    os.kill(frozen.pid, signal.SIGSTOP)
    plant_claim(s3, "corpus-char", {**claim.holder([frozen.pid]), "beat": 3})
    # Ending at all, with this error, is the proof: a takeover would wait on the lock for good (pytest's
    # timeout ends the test then).
    with pytest.raises(DataError, match=rf"process {frozen.pid} on this machine claimed s3://.* resume it \(kill -CONT\)"):
        prepare(shared(tmp_path / "node-b"))
    assert newest_claim(f"s3://{s3.bucket}/prepared/corpus-char").record["pids"][0][0] == frozen.pid  # still its
