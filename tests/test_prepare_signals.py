"""A preparation that is stopped or killed: its workers end with it, the machine lock is free, and the
next start goes on from what it had tokenized, or removes what it left. Real `mingpt-prepare`
processes, real signals."""

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch import MAIN, SMALL, children, output, slow_corpus, wait_for
from mingpt.data.prepare import PrepareConfig, prepare

PREPARE = str(Path(sys.executable).parent / "mingpt-prepare")
INTERRUPTED = "interrupted: nothing was published; the same command goes on from where it stopped"


def start_tokenizing(procs, tmp_path: Path, trainer: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """mingpt-prepare (or, `trainer`, a training process) with 2 workers, once they tokenize (past the BPE
    sample: a piece's tokens are written); the process and its workers' PIDs. It starts with SIGINT ignored, as
    a script's background job does."""
    corpus = slow_corpus(tmp_path / "records.jsonl.gz")
    out = tmp_path / "data" / "web"
    command = [PREPARE, "--corpus", str(corpus), "--tokenizer", "bpe", "--vocab-size", "300",
               "--bpe-sample-bytes", "100000", "--num-workers", "2", "--out", str(out)]
    if trainer:
        command = [sys.executable, MAIN, *SMALL, f"data.corpus={corpus}", "data.tokenizer=bpe", "data.vocab_size=300",
                   "data.bpe_sample_bytes=1000000", "data.num_workers=2", f"data.prepared_dir={out}",
                   f"snapshot.dir={tmp_path / 'snap'}"]
    proc = procs.start(["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command], "prepare")
    wait_for(lambda: list((tmp_path / "data").glob(".web.tmp-*/progress.json")) and len(children(proc.pid)) == 2,
             120, "the workers to tokenize", [proc])
    return proc, children(proc.pid)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def lock_free(folder: Path) -> bool:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases it again


def scratch(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def tokenized(folder: Path) -> int:
    """Bytes of the corpus that the kept progress of the stopped preparation in `folder` counts as done."""
    return json.loads(next(folder.glob(".web.tmp-*/progress.json")).read_text())["read"]


AT_ONCE = 100 * 2**20  # half of slow_corpus's 200 MB: a stop deferred to the end of the corpus reads all of it


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_preparation_at_once_and_keeps_what_it_tokenized(tmp_path, procs, sig, code):
    proc, workers = start_tokenizing(procs, tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == code
    text = output(proc)
    assert text.splitlines()[-1] == INTERRUPTED and text.count(INTERRUPTED) == 1 and "Traceback" not in text, text
    assert not [pid for pid in workers if alive(pid)]  # ended and reaped before the command exited
    assert len(scratch(tmp_path / "data")) == 1 and not (tmp_path / "data" / "web").exists()  # kept to go on from
    assert 0 < tokenized(tmp_path / "data") < AT_ONCE  # stopped where it was, not once the rest was tokenized
    assert lock_free(tmp_path / "data")


def test_a_killed_preparation_leaves_no_worker_nor_lock_and_the_next_one_cleans_up(tmp_path, procs):
    proc, workers = start_tokenizing(procs, tmp_path)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    wait_for(lambda: not [pid for pid in workers if alive(pid)], 30, "the workers to die with their parent")
    assert lock_free(tmp_path / "data")  # the kernel released it: no worker held a copy
    assert len(scratch(tmp_path / "data")) == 1  # the killed one's temporary folder

    (tmp_path / "small.txt").write_text("a small corpus, prepared next to the killed one\n")
    prepare(PrepareConfig(corpus=str(tmp_path / "small.txt"), prepared_dir=tmp_path / "data" / "small",
                          val_fraction=0.0))
    assert scratch(tmp_path / "data") == []  # its owner is gone and it is not this data: removed under the lock


def test_a_killed_preparation_goes_on_from_what_it_tokenized_and_ends_as_if_never_stopped(tmp_path, procs):
    """Killed twice (SIGKILL, then SIGTERM) in the middle; each start goes on from the pieces finished.
    The result equals a preparation that was never stopped, byte for byte."""
    corpus = slow_corpus(tmp_path / "records.jsonl.gz", megabytes=6)  # pieces of 1 MB
    out = tmp_path / "data" / "web"
    command = [PREPARE, "--corpus", str(corpus), "--num-workers", "2", "--out", str(out)]
    progress = lambda: [json.loads(p.read_text())["pieces"] for p in (tmp_path / "data").glob(".web.tmp-*/progress.json")
                        if p.stat().st_size]
    gone_on = []
    for name, sig in (("killed", signal.SIGKILL), ("stopped", signal.SIGTERM)):
        proc = procs.start(command, name)
        wait_for(lambda: progress() and progress()[0] >= (gone_on[-1] if gone_on else 0) + 1, 120,
                 "one more piece tokenized", [proc])
        proc.send_signal(sig)
        proc.wait(timeout=30)
        gone_on.append(progress()[0])
    last = procs.start(command, "last")
    assert last.wait(timeout=120) == 0, output(last)
    assert "going on with a preparation that was stopped" in output(last)
    assert output(proc).count("going on with a preparation that was stopped") == 1  # the second start too
    assert scratch(tmp_path / "data") == []

    whole = prepare(PrepareConfig(corpus=str(corpus), prepared_dir=tmp_path / "whole"))
    for name in ("tokenizer.json", "train.bin", "val.bin"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    resumed, uninterrupted = (json.loads((d / "meta.json").read_text()) for d in (out, whole))
    assert {k: v for k, v in resumed.items() if k != "created"} == {k: v for k, v in uninterrupted.items() if k != "created"}


def test_sigterm_to_a_training_process_that_prepares_stops_it_at_once_and_keeps_its_tokens(tmp_path, procs):
    """torchrun sends SIGTERM at every membership change, often while a worker still prepares data: the
    tokens so far are kept for the restarted worker to go on from."""
    proc, workers = start_tokenizing(procs, tmp_path, trainer=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    text = output(proc)
    assert text.splitlines()[-1].startswith("interrupted (SIGTERM): ") and "Traceback" not in text, text
    assert not [pid for pid in workers if alive(pid)]
    assert len(scratch(tmp_path / "data")) == 1 and lock_free(tmp_path / "data")
    assert 0 < tokenized(tmp_path / "data") < AT_ONCE  # kept, and stopped where it was
    claim = json.loads(next((tmp_path / "snap" / "owner").glob("gen-*.json")).read_text())
    assert claim["released"] is True  # the next job starts at once, without waiting for the lease to expire


def test_a_stop_swallowed_where_it_was_raised_still_stops_the_preparation():
    """A SIGTERM that arrives while a worker is being forked was handled inside logging's after-fork hook,
    where Python printed the Stopped it raised as a traceback and dropped it (seen in full test runs: the
    preparation went on for 30 s). Forks now defer the raise; and a stop dropped elsewhere (a __del__)
    is raised again by the pool's loop."""
    from mingpt.data.pool import WorkerPool
    from mingpt.data.tasks import setup
    from mingpt.errors import Stopped, forget_stops, raise_stopped

    try:
        raise_stopped(signal.SIGTERM, None)
    except Stopped:
        pass  # what the after-fork hook's caller does with it
    try:
        with pytest.raises(Stopped), WorkerPool(2, setup, {"val_sources": []}) as pool:
            list(pool.map(abs, range(-10, 0)))
    finally:
        forget_stops()


def test_a_stop_during_a_fork_is_raised_after_it():
    from mingpt.errors import Stopped, deferred_stops, forget_stops, raise_stopped

    try:
        with pytest.raises(Stopped):
            with deferred_stops():
                raise_stopped(signal.SIGTERM, None)  # as if in the fork's hooks: nothing raised there
                reached = True
        assert reached
    finally:
        forget_stops()
