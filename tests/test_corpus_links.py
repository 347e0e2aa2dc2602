"""What gets prepared: corpora of symbolic links (a Hugging Face cache), and the fingerprint of the result."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import env
from mingpt.cli.prepare import main
from mingpt.data.prepare import PrepareConfig, prepare, verify
from mingpt.data.prepared import PreparedData
from mingpt.errors import DataError

EOT = "<|endoftext|>"
PREPARE = str(Path(sys.executable).parent / "mingpt-prepare")


def hf_cache(root: Path) -> Path:
    """Hugging Face's layout: the content in blobs/<hash>, snapshots/<rev>/<file> -> ../../blobs/<hash>;
    and a link to a folder of more shards. The snapshot folder."""
    (root / "blobs").mkdir(parents=True)
    snapshot = root / "snapshots" / "rev1"
    (snapshot / "data").mkdir(parents=True)
    for name, target in [("a.txt", "h1"), ("data/b.jsonl", "h2")]:
        (snapshot / name).symlink_to(os.path.relpath(root / "blobs" / target, (snapshot / name).parent))
    (root / "blobs" / "h1").write_text("first shard, a text file\n")
    (root / "blobs" / "h2").write_text(json.dumps({"text": "second shard, a record"}) + "\n")
    (root / "more").mkdir()
    (root / "more" / "c.txt").write_text("third shard, in a linked folder\n")
    (snapshot / "more").symlink_to("../../more")
    return snapshot


def documents(out: Path) -> list[str]:
    data = PreparedData(out)
    ids = [i for split in ("train", "val") for i in np.fromfile(out / f"{split}.bin", data.meta["dtype"]).tolist()]
    return sorted(data.tokenizer.decode(ids).split(EOT)[:-1])


def test_symlinked_shards_are_all_prepared(tmp_path):
    snapshot = hf_cache(tmp_path / "hub")
    wanted = ["first shard, a text file\n", "second shard, a record", "third shard, in a linked folder\n"]
    out = prepare(PrepareConfig(corpus=str(snapshot), prepared_dir=tmp_path / "folder", val_fraction=0.4))
    assert documents(out) == wanted
    out = prepare(PrepareConfig(corpus=str(snapshot / "*.txt"), prepared_dir=tmp_path / "glob", val_fraction=0.0))
    assert PreparedData(out).meta["sources"][0]["size"] == len(wanted[0])  # the blob's, not the link's
    assert documents(out) == wanted[:1]


@pytest.mark.parametrize("make, message", [
    (lambda s: (s / "data" / "up").symlink_to(".."), r"loop: .*/data/up is a symbolic link back to .*/rev1;"),
    (lambda s: (s / "self.txt").symlink_to("self.txt"), r"/self.txt is a loop of symbolic links"),
    (lambda s: (s / "gone.txt").symlink_to("../../blobs/missing"), r"/gone.txt is a symbolic link to "
                                                                    r"../../blobs/missing, which does not exist"),
])
def test_a_link_loop_or_a_broken_link_is_one_line(tmp_path, capsys, make, message):
    snapshot = hf_cache(tmp_path / "hub")
    make(snapshot)
    assert main(["--corpus", str(snapshot), "--out", str(tmp_path / "prep")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    with pytest.raises(DataError, match=message):
        prepare(PrepareConfig(corpus=str(snapshot), prepared_dir=tmp_path / "prep"))
    assert not (tmp_path / "prep").exists()


def test_a_file_in_a_folder_of_ones_own_named_blobs_is_read_again_once_edited(tmp_path):
    """Only a Hugging Face cache names a blob by its content. A corpus that links into a folder of the user's own
    named blobs (its file named like a hash, even) is versioned by the file's mtime: edited in place to text of
    the same size, it is prepared again, by mingpt-prepare as users run it."""
    blob = tmp_path / "blobs" / hashlib.sha256(b"anything").hexdigest()
    blob.parent.mkdir()
    blob.write_text("the first text\n")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "input.txt").symlink_to(blob)

    def prepared() -> list[str]:
        result = subprocess.run([PREPARE, "--corpus", str(tmp_path / "corpus"), "--out", str(tmp_path / "prep")],
                                capture_output=True, text=True, timeout=120, env=env())
        assert result.returncode == 0, result.stderr
        return documents(tmp_path / "prep")

    assert prepared() == ["the first text\n"]
    blob.write_text("the other text\n")  # the same size, the same name
    assert prepared() == ["the other text\n"]


def test_the_fingerprint_follows_the_tokens(tmp_path, corpus_file):
    def fingerprint(name: str, **settings) -> str:
        return PreparedData(prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / name,
                                                  **settings))).fingerprint

    first = fingerprint("a")
    assert len(first) == 64 and fingerprint("b", num_workers=1) == first  # the same tokens, prepared again
    assert fingerprint("c", val_fraction=0.2) != first  # another split
    assert fingerprint("d", tokenizer="bpe", vocab_size=300) != first
    corpus_file.write_text(corpus_file.read_text().replace("fox", "cat"))
    assert fingerprint("e") != first

    assert verify(tmp_path / "e") == []
    with open(tmp_path / "e" / "train.bin", "r+b") as f:
        f.write(b"\0\0")  # a damaged token file: verify says so
    assert [line.split(":")[0] for line in verify(tmp_path / "e")] == [str(tmp_path / "e" / "train.bin")]
