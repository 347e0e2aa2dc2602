"""Corpora as people get them: Parquet shards, zstd-compressed JSONL, Hugging Face Hub URLs."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry as fsspec_registry

from mingpt.data import corpus, pieces
from mingpt.data.prepare import PrepareConfig, prepare, verify
from mingpt.data.prepared import read_meta
from mingpt.errors import DataError
from test_prepare import make_documents, prepared_documents

PREPARE = str(Path(sys.executable).parent / "mingpt-prepare")
SHARDS = 3


def shard(docs: list[str], k: int) -> list[str]:
    return docs[k * len(docs) // SHARDS : (k + 1) * len(docs) // SHARDS]


def write_parquet(folder: Path, docs: list[str]) -> None:
    """Three shards as the Hub's datasets have them: other columns beside the text, several row groups,
    the text as string in one shard and as large_string in another."""
    folder.mkdir(parents=True)
    for k in range(SHARDS):
        texts = shard(docs, k)
        table = pa.table({"id": [f"doc-{k}-{i}" for i in range(len(texts))],
                          "text": pa.array(texts, pa.large_string() if k == 1 else pa.string()),
                          "score": [i / 7 for i in range(len(texts))]})
        pq.write_table(table, folder / f"part-{k:05d}.parquet", row_group_size=7, compression="zstd" if k else "snappy")


def write_jsonl(folder: Path, docs: list[str], compress: bool) -> None:
    folder.mkdir(parents=True)
    for k in range(SHARDS):
        lines = "".join(json.dumps({"url": f"u{i}", "text": doc}) + "\n" for i, doc in enumerate(shard(docs, k)))
        data = zstandard.ZstdCompressor().compress(lines.encode()) if compress else lines.encode()
        (folder / f"part-{k:05d}.jsonl{'.zst' if compress else ''}").write_bytes(data)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 2 KB: many Parquet batches per row group, JSONL files cut into many pieces."""
    monkeypatch.setattr(pieces, "PIECE_BYTES", 2048)


@pytest.fixture
def three_containers(tmp_path) -> tuple[list[str], dict[str, Path]]:
    docs = make_documents(60)
    folders = {"parquet": tmp_path / "parquet", "jsonl.zst": tmp_path / "zst", "jsonl": tmp_path / "jsonl"}
    write_parquet(folders["parquet"], docs)
    write_jsonl(folders["jsonl.zst"], docs, compress=True)
    write_jsonl(folders["jsonl"], docs, compress=False)
    return docs, folders


def test_the_same_documents_give_the_same_tokens_in_parquet_zstd_jsonl_and_plain_jsonl(
        tmp_path, small_pieces, three_containers):
    docs, folders = three_containers
    (folders["jsonl"].parent / "one.jsonl").write_text(
        "".join(json.dumps({"text": doc}) + "\n" for doc in docs))  # the same documents, unsharded
    prepared = {}
    for name, source in {**folders, "one file": folders["jsonl"].parent / "one.jsonl"}.items():
        prepared[name] = prepare(PrepareConfig(corpus=str(source), prepared_dir=tmp_path / f"prep-{name}",
                                               val_fraction=0.2, num_workers=2))
    for name, out in prepared.items():
        for file in ("train.bin", "val.bin", "tokenizer.json"):
            assert (out / file).read_bytes() == (prepared["jsonl"] / file).read_bytes(), (name, file)
    found = prepared_documents(prepared["parquet"])
    assert sorted(found["train"] + found["val"]) == sorted(docs) and found["val"]
    assert read_meta(prepared["parquet"])["text_field"] == "text"
    assert verify(prepared["parquet"]) == [] and verify(prepared["jsonl.zst"]) == []


def test_bpe_samples_parquet_row_groups_and_the_text_field_is_a_column(tmp_path, small_pieces):
    docs = make_documents(30)
    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.table({"content": docs, "n": list(range(30))}), folder / "a.parquet", row_group_size=5)
    out = prepare(PrepareConfig(corpus=str(folder / "*.parquet"), text_field="content", tokenizer="bpe",
                                vocab_size=300, bpe_sample_bytes=8000, prepared_dir=tmp_path / "prep"))
    found = prepared_documents(out)
    assert sorted(found["train"] + found["val"]) == sorted(docs)


def expect_error(tmp_path, corpus_url: str, message: str, env: dict | None = None, *extra: str) -> None:
    """mingpt-prepare fails with exit 2 and one line that matches `message`, and leaves no folder."""
    out = tmp_path / "out"
    result = subprocess.run([PREPARE, "--corpus", corpus_url, "--out", str(out), *extra], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **(env or {})})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert message in lines[0], lines[0]
    assert not out.exists()


def test_a_missing_column_a_damaged_file_and_a_null_are_one_line_each(tmp_path, three_containers):
    _, folders = three_containers
    expect_error(tmp_path, str(folders["parquet"]), "has no column 'content'; set data.text_field (--text-field) "
                 "to the column holding the text (its columns: id, text, score)", None, "--text-field", "content")
    whole = (folders["parquet"] / "part-00002.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    expect_error(tmp_path, str(tmp_path / "cut.parquet"), "cut.parquet is not a readable Parquet file")
    damaged = bytearray(whole)
    damaged[200:400] = bytes(200)  # inside the first row group's pages
    (tmp_path / "damaged.parquet").write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"cannot read .*damaged.parquet, row group 0: .*copy it again"):
        prepare(PrepareConfig(corpus=str(tmp_path / "damaged.parquet"), prepared_dir=tmp_path / "p"))
    whole = (folders["jsonl.zst"] / "part-00000.jsonl.zst").read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[: len(whole) // 2])  # zstandard alone would end it silently
    with pytest.raises(DataError, match=r"cut.jsonl.zst: EOFError: the zstd stream ends inside a frame"):
        prepare(PrepareConfig(corpus=str(tmp_path / "cut.jsonl.zst"), prepared_dir=tmp_path / "p"))
    pq.write_table(pa.table({"text": ["a", "b", None, "c"]}), tmp_path / "null.parquet")
    with pytest.raises(DataError, match=r"null.parquet, row 2: 'text' is null, not text"):
        prepare(PrepareConfig(corpus=str(tmp_path / "null.parquet"), prepared_dir=tmp_path / "p"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "numbers.parquet")
    with pytest.raises(DataError, match=r"column 'text' holds int64, not text"):
        prepare(PrepareConfig(corpus=str(tmp_path / "numbers.parquet"), prepared_dir=tmp_path / "p"))
    assert not (tmp_path / "p").exists()


def test_content_that_is_not_text_is_one_line_naming_the_file_and_where(tmp_path, capsys):
    """The policy of every format: text that is not UTF-8 (or a lone surrogate from a JSON escape) is refused,
    naming the file and the byte, line or row; so is JSON nested too deeply or with an integer of thousands of digits
    (which json refuses), and a text column named twice."""
    from mingpt.cli.prepare import main

    pq.write_table(pa.Table.from_arrays([pa.array(["a b"] * 3), pa.array(["c"] * 3)], names=["text", "text"]),
                   tmp_path / "two.parquet")
    bad = pa.array([b"good text", b"more", b"bad \xff text"], pa.binary()).view(pa.string())  # stored unchecked
    pq.write_table(pa.table({"text": bad}), tmp_path / "bad.parquet")
    ok = json.dumps({"text": "fine \U0001F600"}) + "\n"  # a pair of escapes is one character: text
    (tmp_path / "deep.jsonl").write_text(ok + "[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "digits.jsonl").write_text(ok + '{"text": "a", "id": ' + "9" * 5000 + "}\n")
    (tmp_path / "surrogate.jsonl").write_text(ok + '{"text": "a \\ud800 b"}\n')
    (tmp_path / "bad.jsonl").write_bytes(ok.encode() + b'{"text": "caf\xe9"}\n')
    (tmp_path / "bad.txt").write_bytes(b"good\ncaf\xe9\n")
    cases = [("two.parquet", "has 2 columns named 'text'"),
             ("bad.parquet", "bad.parquet, row 2, is not UTF-8 text (bad byte at offset 4 of its text)"),
             ("deep.jsonl", f"deep.jsonl, the record at byte {len(ok)} is not a JSON record (JSON nested too deeply"),
             ("digits.jsonl", f"digits.jsonl, the record at byte {len(ok)} is not a JSON record (Exceeds the limit"),
             ("surrogate.jsonl", f"surrogate.jsonl, the record at byte {len(ok.encode())} is not UTF-8 text: its "
                                 "'\\ud800' at character 2 is a lone surrogate"),
             ("bad.jsonl", f"bad.jsonl is not UTF-8 text (bad byte at offset {len(ok.encode()) + 13})"),
             ("bad.txt", "bad.txt is not UTF-8 text (bad byte at offset 8)")]
    for name, message in cases:
        for tokenizer in ("char", "bpe"):
            args = ["--vocab-size", "300"] if tokenizer == "bpe" else []
            assert main(["--corpus", str(tmp_path / name), "--out", str(tmp_path / "out"), "--tokenizer", tokenizer,
                         "--num-workers", "1", *args]) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and message in err, (name, tokenizer, err)
            assert not (tmp_path / "out").exists()
    (tmp_path / "good.jsonl").write_text(ok)
    found = prepared_documents(prepare(PrepareConfig(corpus=str(tmp_path / "good.jsonl"), val_fraction=0.0,
                                                     prepared_dir=tmp_path / "good")))
    assert found["train"] == ["fine \U0001F600"]


def test_compressed_input_is_read_in_bounded_pieces_and_a_record_longer_than_the_bound_is_refused(
        tmp_path, monkeypatch, capsys):
    """64 MB of zeros compress to a few KB: they are decompressed a block at a time, never whole; a JSONL line
    longer than MAX_RECORD_BYTES is one line naming it, compressed or not, and so is a Parquet row."""
    import tracemalloc

    from mingpt.cli.prepare import main

    zeros = tmp_path / "zeros.txt.zst"
    zeros.write_bytes(zstandard.ZstdCompressor().compress(bytes(64 << 20)))
    tracemalloc.start()
    try:
        read = sum(piece.size for piece in pieces.read_pieces(corpus.list_sources(str(zeros)), "text"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read == 64 << 20 and peak < 16 << 20, peak

    monkeypatch.setattr(pieces, "PIECE_BYTES", 2048)
    monkeypatch.setattr(pieces, "MAX_RECORD_BYTES", 20_000)
    fits, head = json.dumps({"text": "a " * 8_000}) + "\n", json.dumps({"text": "short"}) + "\n"
    lines = head + fits + json.dumps({"text": "b " * 15_000}) + "\n" + head
    for name, data in [("long.jsonl", lines.encode()), ("long.jsonl.zst", zstandard.compress(lines.encode()))]:
        (tmp_path / name).write_bytes(data)
        assert main(["--corpus", str(tmp_path / name), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert f"{name}, the record at byte {len(head + fits)}, is longer than 20,000 bytes" in err, err
        assert not (tmp_path / "out").exists()
    # A Parquet row is held to the same bound (a 100 MB one took 3.6 GB to tokenize): one line naming the row.
    pq.write_table(pa.table({"text": ["short", "c " * 15_000, "short"]}), tmp_path / "long.parquet")
    assert main(["--corpus", str(tmp_path / "long.parquet"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "long.parquet, row 1, holds 30,000 bytes of text, more than the " \
        "20,000 one document may hold" in err, err
    (tmp_path / "fits.jsonl.zst").write_bytes(zstandard.compress((head + fits + head).encode()))
    found = prepared_documents(prepare(PrepareConfig(corpus=str(tmp_path / "fits.jsonl.zst"), val_fraction=0.0,
                                                     prepared_dir=tmp_path / "fits")))
    assert found["train"] == ["short", "a " * 8_000, "short"]


class HubStandIn(DirFileSystem):
    """hf:// served from a local folder, for the fsspec path that huggingface_hub's HfFileSystem takes."""

    protocol = "hf"
    cachable = False
    root = ""

    def __init__(self, **options):
        super().__init__(path=self.root, fs=LocalFileSystem())


def test_an_hf_url_is_read_through_fsspec_and_prepared_like_a_local_copy(tmp_path, monkeypatch, small_pieces,
                                                                         three_containers):
    _, folders = three_containers
    dataset = tmp_path / "hub" / "datasets" / "org" / "web" / "data"
    shutil.copytree(folders["parquet"], dataset)
    monkeypatch.setattr(HubStandIn, "root", str(tmp_path / "hub"))
    monkeypatch.setitem(fsspec_registry, "hf", HubStandIn)
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the tests' default
    url = "hf://datasets/org/web/data/*.parquet"
    out = prepare(PrepareConfig(corpus=url, prepared_dir=tmp_path / "from-hub", val_fraction=0.2, num_workers=2))
    local = prepare(PrepareConfig(corpus=str(folders["parquet"]), prepared_dir=tmp_path / "local", val_fraction=0.2))
    assert (out / "train.bin").read_bytes() == (local / "train.bin").read_bytes()
    assert [s["url"] for s in read_meta(out)["sources"]] == [f"hf://datasets/org/web/data/part-{k:05d}.parquet"
                                                             for k in range(SHARDS)]


def hub_cache(root: Path, repo: str, files: dict[str, bytes]) -> None:
    """The layout huggingface_hub's cache has after a download: blobs, a snapshot of links, refs/main."""
    folder = root / f"datasets--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    for path, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()  # as an LFS file's (a small one: git's sha1)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


@pytest.mark.multiproc
def test_offline_an_hf_url_reads_the_hub_cache_and_says_what_it_lacks(tmp_path, three_containers, closed_port):
    _, folders = three_containers
    hub_cache(tmp_path / "cache", "org/web", {f"data/{p.name}": p.read_bytes() for p in folders["parquet"].iterdir()})
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    result = subprocess.run([PREPARE, "--corpus", "hf://datasets/org/web/data/*.parquet", "--out",
                             str(tmp_path / "offline"), "--val-fraction", "0.2"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, **offline})
    assert result.returncode == 0, result.stderr
    local = prepare(PrepareConfig(corpus=str(folders["parquet"]), prepared_dir=tmp_path / "local", val_fraction=0.2))
    assert (tmp_path / "offline" / "train.bin").read_bytes() == (local / "train.bin").read_bytes()

    expect_error(tmp_path, "hf://datasets/org/other/*.parquet", "HF_HUB_OFFLINE is set and the Hugging Face cache "
                 "holds nothing of org/other; download it first", offline)
    expect_error(tmp_path, "hf://datasets/org/web/*.parquet", "cannot reach the Hugging Face Hub at "
                 f"http://127.0.0.1:{closed_port}", {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port}",
                                                      "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"})


def test_files_of_a_hub_cache_are_versioned_by_their_blob_not_their_download_time(tmp_path, three_containers):
    """Two machines that downloaded the same dataset at different times list the same corpus, so that one
    publishes the prepared data and the other copies it."""
    _, folders = three_containers
    hub_cache(tmp_path / "cache", "org/web", {f"data/{p.name}": p.read_bytes() for p in folders["parquet"].iterdir()})
    [snapshot] = (tmp_path / "cache" / "datasets--org--web" / "snapshots").iterdir()
    listed = corpus.list_sources(str(snapshot / "data"))
    assert [s.version for s in listed] == [os.path.basename(os.path.realpath(s.url)) for s in listed]
    for blob in (tmp_path / "cache" / "datasets--org--web" / "blobs").iterdir():
        os.utime(blob, (1_000_000, 1_000_000))  # downloaded at another time
    assert corpus.list_sources(str(snapshot / "data")) == listed


def test_a_shared_hub_cache_is_read_only_through_its_own_blobs(tmp_path, monkeypatch, capsys):
    """HF_HOME may be a folder every user can write: a link planted there, or a `..` in the URL, must not read
    a file of this user's that lies outside the repository."""
    import huggingface_hub.constants

    from mingpt.cli.prepare import main

    cache, secret = tmp_path / "cache", tmp_path / "secret.txt"
    secret.write_text("this user's secret\n")
    hub_cache(cache, "org/web", {"data/a.txt": b"a document\n", "data/b.txt": b"another document\n"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "datasets--org--web"
    [snapshot] = (repo / "snapshots").iterdir()

    def refused(url: str, message: str) -> None:
        assert main(["--corpus", url, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
        assert not (tmp_path / "out").exists()

    ok = prepare(PrepareConfig(corpus="hf://datasets/org/web/data/*.txt", prepared_dir=tmp_path / "ok"))
    found = prepared_documents(ok)
    assert sorted(found["train"] + found["val"]) == ["a document\n", "another document\n"]
    refused("hf://datasets/org/web/../../../secret.txt", "a Hub path may not hold '..'")
    refused("hf://datasets/org/web@../../secret.txt", "a Hub path may not hold '..'")

    (snapshot / "data" / "c.txt").symlink_to(secret)  # planted: a link out of the repository
    refused("hf://datasets/org/web/data/*.txt", f"leads to {secret}, outside its repository")
    refused(str(snapshot / "data"), f"leads to {secret}, outside its repository")  # the cache named as a folder
    (snapshot / "data" / "c.txt").unlink()
    (snapshot / "more").symlink_to(tmp_path)  # a link to a folder outside it
    refused("hf://datasets/org/web/more/secret.txt", "outside its repository")
    (snapshot / "more").unlink()
    os.mkfifo(repo / "blobs" / "fifo")  # not a file: never opened, so never waited on
    (snapshot / "data" / "c.txt").symlink_to("../../../blobs/fifo")
    refused("hf://datasets/org/web/data/c.txt", "holds no files")
    (snapshot / "data" / "c.txt").unlink()
    if os.getuid() == 0:  # only root can make a file of another user's
        blob = os.path.realpath(snapshot / "data" / "b.txt")
        os.chown(blob, 12345, 12345)
        refused("hf://datasets/org/web/data/*.txt", "owner uid 12345")
        os.chown(blob, 0, 0)

    # Listed while it was good, then swapped for a link out: reading checks again.
    [good] = corpus.list_sources(str(snapshot / "data" / "a.txt"))
    (snapshot / "data" / "a.txt").unlink()
    (snapshot / "data" / "a.txt").symlink_to(secret)
    for read in (lambda: corpus.open_source(good), lambda: next(pieces.sample_pieces([good], "text", lambda s, n: True))):
        with pytest.raises(DataError, match="outside its repository"):
            read()
    assert not good.local_plain  # workers get its bytes from the process that checked it


@pytest.mark.s3
def test_parquet_and_zstd_shards_in_s3_prepare_as_local_ones_and_publish_once(tmp_path, s3, small_pieces,
                                                                            three_containers):
    import boto3

    _, folders = three_containers
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for name in ("parquet", "jsonl.zst"):
        for path in folders[name].iterdir():
            client.put_object(Bucket=s3.bucket, Key=f"corpus/{path.name}", Body=path.read_bytes())
    local = prepare(PrepareConfig(corpus=str(folders["parquet"]), prepared_dir=tmp_path / "local", val_fraction=0.2))
    for pattern in ("*.parquet", "*.jsonl.zst"):
        shared = PrepareConfig(corpus=f"s3://{s3.bucket}/corpus/{pattern}", val_fraction=0.2,
                               prepared_dir=f"s3://{s3.bucket}/prepared/{pattern[2:]}")
        first = prepare(replace(shared, local_copy=str(tmp_path / f"node-a-{pattern[2:]}")))
        second = prepare(replace(shared, local_copy=str(tmp_path / f"node-b-{pattern[2:]}")))  # copies
        for out in (first, second):
            assert (out / "train.bin").read_bytes() == (local / "train.bin").read_bytes(), (pattern, out)
        assert all(source["version"] for source in read_meta(first)["sources"])  # ETags
        assert read_meta(second)["created"] == read_meta(first)["created"]  # a copy of what the first published
