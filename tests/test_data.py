import json
import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mingpt.data import pieces
from mingpt.data.corpus import builtin_bytes
from mingpt.data.prepared import PreparedData, TokenBlocks
from mingpt.data.prepare import PrepareConfig, default_out_dir, prepare, verify
from mingpt.data.prepared import read_meta
from mingpt.data.resume import Tokenized
from mingpt.errors import DataError


def test_builtin_corpus_exists_offline_and_is_english_prose():
    text = builtin_bytes().decode()
    assert len(text) > 300_000
    assert "statement" in text and "def " in text


def test_prepare_char_counts_dtype_and_split(corpus_file, tmp_path):
    out = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep", val_fraction=0.1))
    meta = read_meta(out)
    text = corpus_file.read_text(encoding="utf-8")
    assert meta["train_tokens"] + meta["val_tokens"] == len(text) + 1  # one document, one end-of-text
    assert meta["val_tokens"] == int((len(text) + 1) * 0.1) and meta["split"] == "tail"
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(set(text)) + 1
    data = PreparedData(out)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert data.tokenizer.decode(train.tolist()) == text[: meta["train_tokens"]]
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert data.tokenizer.decode(val.tolist()) == text[meta["train_tokens"]:] + "<|endoftext|>"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"


def test_prepare_bpe_round_trips_the_corpus(corpus_file, tmp_path):
    out = prepare(PrepareConfig(corpus=str(corpus_file), tokenizer="bpe", vocab_size=400, prepared_dir=tmp_path / "prep",
                                val_fraction=0.0))
    data = PreparedData(out)
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert data.vocab_size == 400 and data.meta["val_tokens"] == 0
    assert ids[-1] == data.tokenizer.eot_id == 399
    assert data.tokenizer.decode(ids[:-1].tolist()) == corpus_file.read_text(encoding="utf-8")


def test_large_vocabulary_uses_uint32(corpus_file, tmp_path):
    # A plugin-free way to get a vocabulary above 65536: a char vocabulary over many code points.
    chars = "".join(chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c < 0xE000)
    path = tmp_path / "wide.txt"
    path.write_text(chars * 2, encoding="utf-8")
    out = prepare(PrepareConfig(corpus=str(path), prepared_dir=tmp_path / "wide"))
    meta = read_meta(out)
    assert meta["vocab_size"] > 2**16 and meta["dtype"] == "uint32"
    data = PreparedData(out)
    x, y = data.split("train", 8)[3]
    assert data.tokenizer.decode(x.tolist()) == (chars * 2)[24:32]


def test_blocks_are_aligned_and_shifted_by_one(corpus_file, tmp_path):
    data = PreparedData(prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep")))
    train = data.split("train", block_size=32)
    tokens = np.fromfile(data.directory / "train.bin", dtype=np.uint16).astype(np.int64)
    assert len(train) == (len(tokens) - 33) // 32 + 1
    x, y = train.batch([0, 7, len(train) - 1])
    assert x.dtype == torch.int64 and x.shape == y.shape == (3, 32)
    for row, i in enumerate([0, 7, len(train) - 1]):
        assert x[row].tolist() == tokens[i * 32 : i * 32 + 32].tolist()
        assert y[row].tolist() == tokens[i * 32 + 1 : i * 32 + 33].tolist()
    x1, y1 = train[7]
    assert torch.equal(x1, x[1]) and torch.equal(y1, y[1])
    with pytest.raises(IndexError):
        train.batch([len(train)])


def test_stride_one_addresses_every_offset(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    blocks = TokenBlocks(path, "uint16", block_size=4, stride=1)
    assert len(blocks) == 16
    x, y = blocks[15]
    assert x.tolist() == [15, 16, 17, 18] and y.tolist() == [16, 17, 18, 19]



def test_windows_at_any_offset_and_blocks_are_windows_at_multiples_of_the_stride(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    blocks = TokenBlocks(path, "uint16", block_size=4)
    assert blocks.num_starts == 16 and len(blocks) == 4
    x, y = blocks.windows([0, 3, 15])
    assert x.dtype == torch.int64 and x.shape == y.shape == (3, 4)
    assert x[1].tolist() == [3, 4, 5, 6] and y[2].tolist() == [16, 17, 18, 19]
    for a, b in zip(blocks.batch([0, 3]), blocks.windows([0, 12])):
        assert torch.equal(a, b)
    for bad in ([16], [-1]):
        with pytest.raises(IndexError):
            blocks.windows(bad)
    assert blocks.windows(np.zeros(0, dtype=np.int64))[0].shape == (0, 4)


def test_windows_check_ids_against_the_vocabulary(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, 3, 9, 4, 5], dtype=np.uint16).tofile(path)
    blocks = TokenBlocks(path, "uint16", block_size=2, vocab_size=8)
    blocks.windows([0])
    with pytest.raises(DataError, match="beyond the tokenizer's vocabulary"):
        blocks.windows([1])


def test_prepared_data_is_reused_when_unchanged(corpus_file, tmp_path):
    out = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep"))
    stamp = (out / "train.bin").stat().st_mtime_ns
    inode = (out / "train.bin").stat().st_ino
    again = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep"))
    assert again == out
    assert (out / "train.bin").stat().st_ino == inode and (out / "train.bin").stat().st_mtime_ns == stamp


def test_prepared_data_is_rebuilt_when_corpus_or_tokenizer_changes(corpus_file, tmp_path):
    out = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep"))
    first = read_meta(out)
    corpus_file.write_text(corpus_file.read_text(encoding="utf-8") + "A brand new line with new letters: QZ¿\n",
                           encoding="utf-8")
    prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep"))
    second = read_meta(out)
    assert second["source_sha256"] != first["source_sha256"]
    assert second["train_tokens"] + second["val_tokens"] > first["train_tokens"] + first["val_tokens"]
    assert "¿" in PreparedData(out).tokenizer.chars
    prepare(PrepareConfig(corpus=str(corpus_file), tokenizer="bpe", vocab_size=300,
                          prepared_dir=tmp_path / "prep"))
    assert read_meta(out)["tokenizer"] == "bpe"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "stale folders left behind"


def _prepare_in_child(args):
    corpus, out, barrier = args
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("mingpt.data").addHandler(handler)
    logging.getLogger("mingpt.data").setLevel(logging.INFO)
    barrier.wait()  # all three start at once
    prepare(PrepareConfig(corpus=corpus, tokenizer="bpe", vocab_size=350, prepared_dir=out))
    built = any(m.startswith("prepared ") for m in messages)
    return built, read_meta(out)["created"], (Path(out) / "train.bin").stat().st_ino


def test_concurrent_preparation_of_the_same_data_is_safe_and_done_once(corpus_file, tmp_path):
    out = tmp_path / "prep"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(3) as pool:
        barrier = manager.Barrier(3)
        results = pool.map(_prepare_in_child, [(str(corpus_file), str(out), barrier)] * 3)
    assert [built for built, *_ in results].count(True) == 1  # one process built it; the others waited
    assert len({tuple(rest) for _, *rest in results}) == 1  # ... and reused that very folder
    data = PreparedData(out)
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert len(ids) == data.meta["train_tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "prep"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        (b"", "empty"),
        (b"   \n\n", "empty"),
        (b"caf\xe9 latin-1", "not UTF-8.*offset 3"),
    ],
)
def test_bad_corpora_are_refused_and_leave_nothing(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        prepare(PrepareConfig(corpus=str(path), prepared_dir=tmp_path / "prep"))
    assert not (tmp_path / "prep").exists()
    assert [p.name for p in tmp_path.iterdir()] == ([] if content is None else ["corpus.txt"])


def test_corpus_shorter_than_a_block_is_explained(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("just a few words here, forty characters", encoding="utf-8")
    data = PreparedData(prepare(PrepareConfig(corpus=str(path), prepared_dir=tmp_path / "prep")))
    with pytest.raises(DataError, match="train split.*fewer than one block of 64.*smaller block_size"):
        data.split("train", 64)
    with pytest.raises(DataError, match="val split.*val_fraction"):
        data.split("val", 8)


def test_truncated_token_file_is_detected(corpus_file, tmp_path):
    out = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep"))
    with open(out / "train.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match="damaged"):
        PreparedData(out).split("train", 16)


def test_missing_or_damaged_meta(tmp_path, corpus_file):
    with pytest.raises(DataError, match="not prepared data.*mingpt.prepare"):
        PreparedData(tmp_path)
    out = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep"))
    (out / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="damaged"):
        PreparedData(out)


def test_a_description_that_contradicts_its_data_is_damaged(tmp_path, corpus_file):
    """Every field of meta.json that tells how to read the files (which their sha256 do not cover) is checked
    against them: one line, "damaged", naming the field."""
    out = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prep"))
    meta = read_meta(out)
    tampered = {"dtype": ["garbage", "uint8", "uint32", None], "train_tokens": [meta["train_tokens"] + 1, -1, "9"],
                "val_tokens": [meta["val_tokens"] - 1, 1.5], "eot_id": [meta["eot_id"] - 1, None],
                "fingerprint": ["0" * 64], "sha256": [{**meta["sha256"], "val.bin": 7}, {}]}
    for field, values in tampered.items():
        for value in values:
            (out / "meta.json").write_text(json.dumps({**meta, field: value}))
            with pytest.raises(DataError) as e:
                PreparedData(out)
            message = str(e.value)
            assert f"meta.json is damaged: its {field} is {value!r}" in message and "\n" not in message, message
    (out / "meta.json").write_text(json.dumps(meta))
    assert PreparedData(out).meta == meta


def test_a_working_folder_that_cannot_be_written_is_one_line_naming_the_setting(tmp_path, corpus_file, monkeypatch,
                                                                                 capsys):
    from mingpt.cli.prepare import main

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root writes anywhere, except where the kernel refuses all (/sys)
        folder = Path("/sys")
    try:
        os.mkdir(folder / "data")
    except OSError:
        pass
    else:
        pytest.skip(f"{folder} can be written here")
    monkeypatch.chdir(folder)
    assert main(["--corpus", str(corpus_file)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"cannot write prepared data into {folder / 'data'} (" in err and "set data.prepared_dir (--out" in err
    monkeypatch.chdir(tmp_path)  # from a folder that can be written, the same command prepares
    assert main(["--corpus", str(corpus_file)]) == 0


def test_default_out_dir_names(tmp_path, monkeypatch):
    assert str(default_out_dir("python-docs", "char", None)) == os.path.join("data", "python-docs-char")
    remote = default_out_dir("s3://bucket/texts/shakespeare.txt", "bpe", 4096)
    assert remote.parent.name == "data" and remote.name.startswith("shakespeare-") and remote.name.endswith("-bpe-4096")
    # Two corpora of the same file name get two folders; one corpus reached two ways gets one.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    local = default_out_dir("input.txt", "char", None)
    assert local != default_out_dir("s3://bucket/input.txt", "char", None)
    assert local != default_out_dir("a/input.txt", "char", None)
    assert local == default_out_dir(str(tmp_path / "input.txt"), "char", None)


def test_prepare_command_line(tmp_path, corpus_file, capsys):
    from mingpt.cli.prepare import main

    assert main(["--corpus", str(corpus_file), "--tokenizer", "bpe", "--vocab-size", "300",
                 "--out", str(tmp_path / "p")]) == 0
    assert "tokenizer bpe with vocab 300" in capsys.readouterr().out
    assert main(["--corpus", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "q")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert json.loads((tmp_path / "p" / "meta.json").read_text())["tokenizer"] == "bpe"


def test_another_vocab_size_or_text_field_over_an_existing_folder_prepares_anew(tmp_path):
    lines = "".join(json.dumps({"text": f"the {i} quick words {i * 7}", "body": f"other text {i}"}) + "\n"
                    for i in range(300))
    (tmp_path / "c.jsonl").write_text(lines)
    settings = dict(corpus=str(tmp_path / "c.jsonl"), tokenizer="bpe", prepared_dir=tmp_path / "prep")
    out = prepare(PrepareConfig(**settings, vocab_size=300))
    assert PreparedData(out).vocab_size == 300
    prepare(PrepareConfig(**settings, vocab_size=400))
    assert PreparedData(out).vocab_size == 400 and read_meta(out)["requested_vocab_size"] == 400
    prepare(PrepareConfig(**settings, vocab_size=400, text_field="body"))
    data = PreparedData(out)
    assert "other text" in data.tokenizer.decode(np.fromfile(out / "train.bin", dtype=np.uint16).tolist())


def stopped_preparation(tmp_path: Path, corpus: Path, monkeypatch, after: int = 3) -> PrepareConfig:
    """A preparation of `corpus` stopped (as by Ctrl-C) after `after` pieces: its scratch folder is left."""
    monkeypatch.setattr(pieces, "PIECE_BYTES", 2048)
    config = PrepareConfig(corpus=str(corpus), prepared_dir=tmp_path / "prep", num_workers=1)
    save, calls = Tokenized.save, []

    def save_then_stop(self, folder):
        save(self, folder)
        calls.append(1)
        if len(calls) == after:
            raise KeyboardInterrupt

    monkeypatch.setattr(Tokenized, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare(config)
    monkeypatch.setattr(Tokenized, "save", save)
    assert len(list(tmp_path.glob(".prep.tmp-*/progress.json"))) == 1
    return config


@pytest.mark.parametrize("tamper", ["garbage", "raised counts", "raised pieces", "corpus replaced as by cp -p"])
def test_a_resumed_preparation_checks_what_it_keeps_or_starts_over(tmp_path, monkeypatch, caplog, tamper):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i}: some words, then more of them.\n" for i in range(2000)))
    config = stopped_preparation(tmp_path, corpus, monkeypatch)
    [progress] = tmp_path.glob(".prep.tmp-*/progress.json")
    record = json.loads(progress.read_text())
    if tamper == "garbage":
        progress.write_text('{"meta": 1, "pieces": "x"')
    elif tamper in ("raised counts", "raised pieces"):
        key = "sizes" if tamper == "raised counts" else "pieces"
        record[key] = {s: n + 2 for s, n in record["sizes"].items()} if key == "sizes" else record["pieces"] + 2
        progress.write_text(json.dumps(record))
    else:  # other text of the same size, with the old mtime: only reading it can tell
        stat = corpus.stat()
        corpus.write_text(corpus.read_text().replace("Line 1:", "LINE 1:"))
        os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with caplog.at_level(logging.INFO, logger="mingpt"):
        out = prepare(config)
    resumed = "going on with a preparation that was stopped" in caplog.text
    assert resumed == (tamper == "corpus replaced as by cp -p")  # found only on reading the pieces done again
    assert ("the corpus changed since the preparation was stopped; starting over" in caplog.text) == resumed
    fresh = prepare(PrepareConfig(corpus=str(corpus), prepared_dir=tmp_path / "fresh", num_workers=1))
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name
    assert verify(out) == []


def test_an_untouched_stopped_preparation_goes_on_and_ends_as_if_never_stopped(tmp_path, monkeypatch, caplog):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line {i}: some words, then more of them.\n" for i in range(2000)))
    config = stopped_preparation(tmp_path, corpus, monkeypatch)
    with caplog.at_level(logging.INFO, logger="mingpt"):
        out = prepare(config)
    assert "going on with a preparation that was stopped" in caplog.text and "starting over" not in caplog.text
    fresh = prepare(PrepareConfig(corpus=str(corpus), prepared_dir=tmp_path / "fresh", num_workers=1))
    assert (out / "train.bin").read_bytes() == (fresh / "train.bin").read_bytes()


def test_a_loop_of_links_or_a_file_at_or_above_the_folder_is_one_line(tmp_path, corpus_file):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out, why in ((tmp_path / "loop", "Too many levels of symbolic links"),
                     (tmp_path / "loop" / "x", "Too many levels of symbolic links"),
                     (corpus_file / "x", "Not a directory")):
        with pytest.raises(DataError, match=rf"cannot use {out} as the prepared-data folder: {why}; choose another"):
            prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=out))
    with pytest.raises(DataError, match="Too many levels of symbolic links"):  # a shared prepared_dir's local copy
        prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir="s3://bucket/x", local_copy=str(tmp_path / "loop")))
