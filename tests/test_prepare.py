"""Preparing corpora of any size and shape: sources, documents, streaming, reuse without reading."""

import gzip
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import REPO
from mingpt.data import job, pieces, progress
from mingpt.data.corpus import builtin_bytes
from mingpt.data.prepared import PreparedData
from mingpt.errors import DataError
from mingpt.cli.prepare import main
from mingpt.data.prepare import PrepareConfig, prepare
from mingpt.data.prepared import read_meta

sys.path.insert(0, str(REPO / "bench"))
from pss import run_measured  # noqa: E402

EOT = "<|endoftext|>"


def make_documents(count: int) -> list[str]:
    """Documents of different lengths and shapes: paragraphs, indented code, blank lines, unicode."""
    docs = []
    for i in range(count):
        lines = [f"Document {i}: the quick brown fox — café {i}.\n"]
        for j in range(3 + (i * 37) % 90):
            lines.append(f"    line {j} of {i}:  x = {j * i}  \n" if j % 5 == 0 else f"Words {j}, more words; and {i}.\n")
            if j % 7 == 0:
                lines.append("\n\n")
        docs.append("".join(lines))
    return docs


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 2 KB, so that documents are cut into many pieces."""
    monkeypatch.setattr(pieces, "PIECE_BYTES", 2048)


def prepared_documents(out: Path) -> dict[str, list[str]]:
    """The documents of each split, decoded: the token files cut at end-of-text."""
    data = PreparedData(out)
    found = {}
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=data.meta["dtype"]).tolist()
        text = data.tokenizer.decode(ids)
        assert text.endswith(EOT) or not text
        found[split] = text.split(EOT)[:-1]
    return found


def write_files(folder: Path, docs: list[str], suffix: str = ".txt") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        data = doc.encode()
        (folder / f"doc-{i:03d}{suffix}").write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> None:
    lines = "".join(json.dumps({"id": i, field: doc}) + "\n" for i, doc in enumerate(docs)).encode()
    path.write_bytes(gzip.compress(lines) if path.name.endswith(".gz") else lines)


@pytest.mark.parametrize("layout", ["folder", "glob", "list", "gz", "jsonl", "jsonl.gz"])
def test_every_source_kind_gives_every_document_whole(tmp_path, small_pieces, layout):
    docs = make_documents(24)
    root = tmp_path / "corpus"
    if layout in ("folder", "glob", "list"):
        write_files(root, docs)
    if layout == "gz":
        write_files(root, docs, ".txt.gz")
    if layout.startswith("jsonl"):
        root.mkdir()
        write_jsonl(root / f"a.{layout}", docs[:10])
        write_jsonl(root / f"b.{layout}", docs[10:])
    (root / ".hidden-notes.txt").write_text("not part of the corpus")
    source = {"glob": str(root / "doc-*.txt"), "list": [str(root / f"doc-{i:03d}.txt") for i in range(24)]}.get(
        layout, str(root))
    out = prepare(PrepareConfig(corpus=source, prepared_dir=tmp_path / "prep", val_fraction=0.2, num_workers=2))
    found = prepared_documents(out)
    assert sorted(found["train"] + found["val"]) == sorted(docs)  # each document whole, none run together
    assert found["val"] and found["train"]
    assert "not part of the corpus" not in "".join(found["train"] + found["val"])


def test_tokens_equal_encoding_each_document_whole(tmp_path, small_pieces):
    doc = "".join(make_documents(40))  # one document of about 70 KB, cut into many pieces
    path = tmp_path / "one.txt"
    path.write_text(doc)
    ids = {}
    for workers in (1, 2):
        out = prepare(PrepareConfig(corpus=str(path), tokenizer="bpe", vocab_size=400, val_fraction=0.0,
                                    prepared_dir=tmp_path / f"prep-{workers}", num_workers=workers))
        data = PreparedData(out)
        ids[workers] = np.fromfile(out / "train.bin", dtype=np.uint16).tolist()
        assert ids[workers] == data.tokenizer.encode(doc) + [data.tokenizer.eot_id]
    assert ids[1] == ids[2]


FORKS = []  # a mark for each fork of this process
os.register_at_fork(after_in_parent=lambda: FORKS.append(1))


def test_a_corpus_of_one_piece_is_tokenized_here_and_one_of_more_by_the_worker_processes(tmp_path, small_pieces):
    """A fork of a trainer-sized process costs more than a piece's work: with data.num_workers=2, a corpus under a
    piece forks nothing, and one of several pieces forks the workers."""
    for name, documents, forked in (("small", 1, False), ("large", 40, True)):
        (tmp_path / f"{name}.txt").write_text("".join(make_documents(documents)))
        before = len(FORKS)
        prepare(PrepareConfig(corpus=str(tmp_path / f"{name}.txt"), prepared_dir=tmp_path / name, num_workers=2))
        assert (len(FORKS) > before) == forked, name


def test_a_line_longer_than_four_pieces_is_cut_and_still_decodes(tmp_path, small_pieces):
    doc = "start\n" + "é" * 10_000 + "\nend\n"  # 20 KB on one line: cut inside it, between characters
    (tmp_path / "long.txt").write_text(doc)
    out = prepare(PrepareConfig(corpus=str(tmp_path / "long.txt"), prepared_dir=tmp_path / "prep", val_fraction=0.0))
    assert prepared_documents(out)["train"] == [doc]


def test_validation_takes_whole_documents_in_a_fixed_order(tmp_path):
    docs = make_documents(20)
    write_files(tmp_path / "files", docs)
    out = prepare(PrepareConfig(corpus=str(tmp_path / "files"), prepared_dir=tmp_path / "a", val_fraction=0.1))
    found = prepared_documents(out)
    assert len(found["val"]) == 2 and len(found["train"]) == 18 and read_meta(out)["split"] == "documents"
    again = prepare(PrepareConfig(corpus=str(tmp_path / "files"), prepared_dir=tmp_path / "b", val_fraction=0.1,
                                  num_workers=1))
    assert prepared_documents(again) == found
    # JSONL records: each one drawn by a seeded hash; about val_fraction of them.
    write_jsonl(tmp_path / "records.jsonl", make_documents(400))
    records = prepared_documents(prepare(PrepareConfig(corpus=str(tmp_path / "records.jsonl"), prepared_dir=tmp_path / "c",
                                                       val_fraction=0.2)))
    assert 40 <= len(records["val"]) <= 120 and len(records["val"]) + len(records["train"]) == 400


def test_jsonl_text_field_and_bad_records_are_explained(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", make_documents(5), field="content")
    with pytest.raises(DataError, match=r"no text field 'text'.*data.text_field.*id, content"):
        prepare(PrepareConfig(corpus=str(tmp_path / "a.jsonl"), prepared_dir=tmp_path / "prep"))
    out = prepare(PrepareConfig(corpus=str(tmp_path / "a.jsonl"), prepared_dir=tmp_path / "prep", text_field="content",
                                val_fraction=0.5))
    assert sorted(sum(prepared_documents(out).values(), [])) == sorted(make_documents(5))
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"b.jsonl, the record at byte 17 is not a JSON record"):
        prepare(PrepareConfig(corpus=str(tmp_path / "b.jsonl"), prepared_dir=tmp_path / "prep2"))
    assert not (tmp_path / "prep2").exists()


@pytest.mark.parametrize("entry, message", [
    ("missing.txt", "does not exist"), ("empty-folder", "holds no files"), ("nothing-*.txt", "holds no files"),
])
def test_sources_that_name_nothing_are_explained(tmp_path, entry, message):
    (tmp_path / "empty-folder").mkdir()
    with pytest.raises(DataError, match=message):
        prepare(PrepareConfig(corpus=str(tmp_path / entry), prepared_dir=tmp_path / "prep"))


def test_corpus_on_s3(tmp_path, s3, small_pieces):
    import boto3

    docs = make_documents(12)
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for i, doc in enumerate(docs[:8]):
        client.put_object(Bucket=s3.bucket, Key=f"corpus/doc-{i:03d}.txt", Body=doc.encode())
    lines = "".join(json.dumps({"text": doc}) + "\n" for doc in docs[8:]).encode()
    client.put_object(Bucket=s3.bucket, Key="corpus/more.jsonl.gz", Body=gzip.compress(lines))
    folder = prepare(PrepareConfig(corpus=f"s3://{s3.bucket}/corpus", prepared_dir=tmp_path / "folder",
                                   val_fraction=0.2))
    assert sorted(sum(prepared_documents(folder).values(), [])) == sorted(docs)
    glob = prepare(PrepareConfig(corpus=f"s3://{s3.bucket}/corpus/doc-*.txt", prepared_dir=tmp_path / "glob",
                                 val_fraction=0.2))
    assert sorted(sum(prepared_documents(glob).values(), [])) == sorted(docs[:8])
    assert all(source["version"] for source in read_meta(folder)["sources"])  # ETags
    bpe = prepare(PrepareConfig(corpus=f"s3://{s3.bucket}/corpus", tokenizer="bpe", vocab_size=300,
                                prepared_dir=tmp_path / "bpe", val_fraction=0.2,
                                bpe_sample_bytes=5000))  # a sample read by ranged GETs
    assert sorted(sum(prepared_documents(bpe).values(), [])) == sorted(docs)
    with pytest.raises(DataError, match="does not exist"):
        prepare(PrepareConfig(corpus=f"s3://{s3.bucket}/nothing.txt", prepared_dir=tmp_path / "none"))


def test_a_restart_never_reads_the_corpus_and_verify_does(tmp_path, capsys):
    path = tmp_path / "corpus.txt"
    original = "".join(make_documents(30))
    path.write_text(original)
    out = prepare(PrepareConfig(corpus=str(path), prepared_dir=tmp_path / "prep"))
    inode = (out / "train.bin").stat().st_ino
    assert main(["--verify", "--out", str(out)]) == 0
    assert "current" in capsys.readouterr().out

    # Other bytes of the same size, with the old mtime: only reading the corpus could tell.
    stat = path.stat()
    path.write_text(original.replace("quick", "QUICK"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert prepare(PrepareConfig(corpus=str(path), prepared_dir=tmp_path / "prep")) == out
    assert (out / "train.bin").stat().st_ino == inode  # reused: the corpus was not read
    assert main(["--verify", "--out", str(out)]) == 1
    assert "content differs from what was prepared" in capsys.readouterr().out

    path.write_text(original + "one more line\n")  # a new size: prepared again
    prepare(PrepareConfig(corpus=str(path), prepared_dir=tmp_path / "prep"))
    assert (out / "train.bin").stat().st_ino != inode
    assert main(["--verify", "--out", str(out)]) == 0


def test_progress_is_logged_when_not_on_a_terminal(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    (tmp_path / "c.txt").write_text("".join(make_documents(50)))
    with caplog.at_level(logging.INFO, logger="mingpt"):
        prepare(PrepareConfig(corpus=str(tmp_path / "c.txt"), tokenizer="bpe", vocab_size=300,
                              prepared_dir=tmp_path / "prep"))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("tokenizing: ") and "MB/s" in line and "left" in line for line in lines), lines
    assert any(line.startswith("training bpe on a sample: ") for line in lines), lines


def test_more_workers_than_the_machine_can_use_are_not_started(tmp_path, monkeypatch, caplog):
    """data.num_workers=100000 started that many processes (and the OOM killer): at most WORKERS_PER_CORE run."""
    monkeypatch.setattr(job, "_cpu_count", lambda: 1)
    (tmp_path / "c.txt").write_text("".join(make_documents(50)))
    with caplog.at_level(logging.INFO, logger="mingpt"):
        prepare(PrepareConfig(corpus=str(tmp_path / "c.txt"), num_workers=100_000, prepared_dir=tmp_path / "prep"))
    lines = [r.getMessage() for r in caplog.records]
    assert f"data.num_workers=100000: using {job.WORKERS_PER_CORE}, {job.WORKERS_PER_CORE} per CPU core" in lines[0]
    assert any(line.startswith("prepared ") and f"{job.WORKERS_PER_CORE} workers)" in line for line in lines), lines


def test_bpe_learns_from_a_bounded_sample(tmp_path, small_pieces):
    (tmp_path / "c.txt").write_text("".join(make_documents(200)))
    out = prepare(PrepareConfig(corpus=str(tmp_path / "c.txt"), tokenizer="bpe", vocab_size=300,
                                prepared_dir=tmp_path / "prep", bpe_sample_bytes=20_000))
    data = PreparedData(out)
    assert data.vocab_size == 300 and read_meta(out)["bpe_sample_bytes"] == 20_000
    ids = np.fromfile(out / "train.bin", dtype=np.uint16).tolist() + np.fromfile(out / "val.bin", np.uint16).tolist()
    assert data.tokenizer.decode(ids) == "".join(make_documents(200)) + EOT  # the whole corpus, encoded


def test_bpe_samples_a_jsonl_record_longer_than_a_piece(tmp_path, small_pieces):
    """A record is sampled by the piece it begins in, read to its end: one longer than a piece (2 KB here, 1 MB
    for real) was left out, and the merges were learnt from the short ones alone, or none."""
    long = "".join(make_documents(40))  # about 100 KB: fifty pieces
    records = [{"text": long}] + [{"text": f"short {i}"} for i in range(20)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    out = prepare(PrepareConfig(corpus=str(tmp_path / "c.jsonl"), tokenizer="bpe", vocab_size=400, val_fraction=0.0,
                                prepared_dir=tmp_path / "prep", bpe_sample_bytes=10**9))
    assert PreparedData(out).vocab_size == 400  # the short records alone hold too few pairs for 143 merges


@pytest.mark.multiproc
def test_memory_stays_bounded_on_a_large_corpus(tmp_path):
    """About 40 MB of text, in 600 MB: the former whole-corpus preparation needed about 31 bytes per byte
    (1.2 GB here); streaming needs about 120 MB, whatever the corpus size."""
    block = builtin_bytes() + b"\n\n"
    with open(tmp_path / "big.txt", "wb") as f:
        for _ in range(40_000_000 // len(block)):
            f.write(block)
    size = (tmp_path / "big.txt").stat().st_size
    rc, seconds, peak = run_measured(
        [str(Path(sys.executable).parent / "mingpt-prepare"), "--corpus", str(tmp_path / "big.txt"),
         "--num-workers", "2", "--out", str(tmp_path / "prep")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert rc == 0
    assert peak < 0.6e9, f"peak PSS {peak / 1e6:.0f} MB for a {size / 1e6:.0f} MB corpus"
    meta = read_meta(tmp_path / "prep")
    assert meta["train_tokens"] + meta["val_tokens"] == len((tmp_path / "big.txt").read_text()) + 1


def test_a_truncated_gz_is_explained_and_leaves_nothing(tmp_path):
    data = gzip.compress("".join(make_documents(50)).encode())
    (tmp_path / "c.txt.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cannot read .*c.txt.gz.*gzip -t"):
        prepare(PrepareConfig(corpus=str(tmp_path / "c.txt.gz"), prepared_dir=tmp_path / "prep"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt.gz"]


@pytest.mark.multiproc
def test_the_trainer_takes_a_hydra_list_of_sources_text_jsonl_and_a_parquet_glob(tmp_path, procs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_documents(40)
    write_files(tmp_path / "books", docs[:6])
    write_jsonl(tmp_path / "web.jsonl", docs[6:30])
    (tmp_path / "shards").mkdir()
    for k, start in enumerate((30, 35)):
        pq.write_table(pa.table({"text": docs[start : start + 5], "id": [1] * 5}), tmp_path / "shards" / f"{k}.parquet")
    shards = f"'{tmp_path / 'shards'}/*.parquet'"
    result = procs.run(
        [sys.executable, str(REPO / "train" / "main.py"),
         f"data.corpus=[{tmp_path / 'books'},{tmp_path / 'web.jsonl'},{shards}]",
         "model=gpt-nano", "data.block_size=32", "trainer.max_steps=2", "trainer.eval_every=0",
         f"snapshot.dir={tmp_path / 'snap'}", f"data.prepared_dir={tmp_path / 'prep'}"], "train", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: step 2" in result.stderr
    found = prepared_documents(tmp_path / "prep")
    assert sorted(found["train"] + found["val"]) == sorted(docs)


@pytest.mark.multiproc
def test_a_named_tiktoken_encoding_ends_documents_with_its_own_end_of_text(tmp_path, closed_port):
    from conftest import offline_env

    plugin = tmp_path / "plugins" / "tiktoken_ext"
    plugin.mkdir(parents=True)
    (plugin / "mingpt_test_eot.py").write_text(
        "def _bytes_eot():\n"
        "    return {'name': 'bytes_eot', 'pat_str': r'\\S+|\\s+', 'mergeable_ranks': {bytes([b]): b for b in range(256)},"
        " 'special_tokens': {'<|endoftext|>': 256}}\n"
        "ENCODING_CONSTRUCTORS = {'bytes_eot': _bytes_eot}\n")
    write_files(tmp_path / "docs", ["first doc", "second doc"])
    env = {**offline_env(tmp_path, closed_port), "PYTHONPATH": str(tmp_path / "plugins")}
    result = subprocess.run([str(Path(sys.executable).parent / "mingpt-prepare"), "--corpus", str(tmp_path / "docs"),
                             "--tokenizer", "bytes_eot", "--val-fraction", "0", "--out", str(tmp_path / "prep")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ids = np.fromfile(tmp_path / "prep" / "train.bin", dtype=np.uint16).tolist()
    assert ids == list(b"first doc") + [256] + list(b"second doc") + [256]


def _killed(piece):
    """Run by the forked workers in place of tasks.encode: each dies as if killed for memory."""
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_mid_preparation_fails_it_at_once_and_publishes_nothing(tmp_path, monkeypatch, small_pieces):
    from mingpt.data import tasks

    monkeypatch.setattr(tasks, "encode", _killed)
    (tmp_path / "c.txt").write_text("".join(make_documents(40)))
    with pytest.raises(DataError, match="worker process died.*--num-workers"):
        prepare(PrepareConfig(corpus=str(tmp_path / "c.txt"), prepared_dir=tmp_path / "prep", num_workers=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


def test_the_bpe_sample_of_an_uncompressed_file_reads_about_the_sample(tmp_path, small_pieces):
    """Pieces are read where they are drawn: sampling 10% of a corpus reads about 10% of it."""
    from mingpt.data.corpus import list_sources
    from mingpt.data.job import Job

    text = "".join(make_documents(400)).encode()
    (tmp_path / "c.txt").write_bytes(text)
    config = PrepareConfig(tokenizer="bpe", vocab_size=300, bpe_sample_bytes=len(text) // 10, num_workers=1)
    job = Job(config, list_sources(str(tmp_path / "c.txt")))

    def bytes_read() -> int:
        return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])

    before = bytes_read()
    sample = "".join(job.bpe_sample())
    read = bytes_read() - before
    assert len(text) // 20 < len(sample.encode()) and read < len(text) // 4, (len(sample), read, len(text))
    assert sample.replace("\n", "") and all(line in text.decode() for line in sample.splitlines()[:50])
