"""A preparation that is stopped or killed: its workers end with it, the machine lock is free, and
no temporary folder outlives it for long. Real `mingpt-prepare` processes, real signals."""

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
INTERRUPTED = "interrupted: nothing was published; run the same command again"


def start_tokenizing(procs, tmp_path: Path, trainer: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """mingpt-prepare (or, `trainer`, a training process) with 2 workers, once they tokenize (past the BPE
    sample: its token file is open); the process and its workers' PIDs. It starts with SIGINT ignored, as
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
    wait_for(lambda: list((tmp_path / "data").glob(".web.tmp-*/train.bin")) and len(children(proc.pid)) == 2, 120,
             "the workers to tokenize", [proc])
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


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_preparation_at_once_and_leaves_nothing(tmp_path, procs, sig, code):
    proc, workers = start_tokenizing(procs, tmp_path)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code  # well before the minute or more that the rest would take
    text = output(proc)
    assert text.splitlines()[-1] == INTERRUPTED and text.count(INTERRUPTED) == 1 and "Traceback" not in text, text
    assert not [pid for pid in workers if alive(pid)]  # ended and reaped before the command exited
    assert scratch(tmp_path / "data") == [] and not (tmp_path / "data" / "web").exists()
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
    assert scratch(tmp_path / "data") == []  # its owner is gone: removed under the machine lock


def test_sigterm_to_a_training_process_that_prepares_stops_it_at_once_and_leaves_nothing(tmp_path, procs):
    """torchrun sends SIGTERM at every membership change, often while a worker still prepares data."""
    proc, workers = start_tokenizing(procs, tmp_path, trainer=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    text = output(proc)
    assert text.splitlines()[-1].startswith("interrupted (SIGTERM): ") and "Traceback" not in text, text
    assert not [pid for pid in workers if alive(pid)]
    assert scratch(tmp_path / "data") == [] and lock_free(tmp_path / "data")
    claim = json.loads(next((tmp_path / "snap" / "owner").glob("gen-*.json")).read_text())
    assert claim["released"] is True  # the next job starts at once, without waiting for the lease to expire


def test_a_stop_swallowed_where_it_was_raised_still_stops_the_preparation():
    """A SIGTERM that arrives while a worker is being forked was handled inside logging's after-fork hook,
    where Python printed the Stopped it raised as a traceback and dropped it (seen in full test runs: the
    preparation went on for 30 s). Forks now defer the raise; and a stop dropped elsewhere (a __del__)
    is raised again by the pool's loop."""
    from mingpt.data.prepare import _Pool
    from mingpt.errors import Stopped, forget_stops, raise_stopped

    try:
        raise_stopped(signal.SIGTERM, None)
    except Stopped:
        pass  # what the after-fork hook's caller does with it
    try:
        with pytest.raises(Stopped), _Pool(2, {"val_sources": []}) as pool:
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
