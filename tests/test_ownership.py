"""One writer per snapshot folder: real jobs started into a live run, dead and frozen holders,
another "host" (a UTS namespace with its own host name), and a worker left over from an older
generation of a torchrun job. Every job here is a real process; faults are real signals."""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch import (
    MAIN, RDZV_CONF, SMALL, env, free_port, latest_step, manifests, output, rendezvous, torchrun, train_here, wait_for,
    worker,
)
from mingpt import claim
from mingpt.checkpoint.lease import RunLease, RunOwnedError
from mingpt.checkpoint.store import SnapshotStore
from mingpt.cli import snapshot as mingpt_snapshot

HAS_UNSHARE = shutil.which("unshare") is not None and subprocess.run(
    ["unshare", "--uts", "true"], capture_output=True).returncode == 0


def job(tmp_path, *extra, steps=100000):
    """A job that runs until it is stopped, snapshotting every 10 steps."""
    return [sys.executable, MAIN, *SMALL, f"trainer.max_steps={steps}", "snapshot.every=10", "snapshot.keep=100",
            f"snapshot.dir={tmp_path / 'snap'}", f"data.prepared_dir={tmp_path / 'prepared'}", *extra]


def committed_state(snapdir: Path) -> dict:
    """Every committed snapshot's manifest bytes, by folder: what nobody may change or delete."""
    return {p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(snapdir.glob("step-*/manifest.json"))}


def claims(snapdir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((snapdir / "owner").glob("gen-*.json"))]


def stop(proc) -> int:
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=120)


@pytest.mark.multiproc
def test_a_second_job_into_a_live_run_is_refused_and_changes_nothing(tmp_path, procs):
    first = procs.start(job(tmp_path), "first")
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first job's snapshot", [first])

    second = procs.run(job(tmp_path, "seed=7", "trainer.lr=1e-3"), "second")
    assert second.returncode == 2, second.stderr
    message = [line for line in second.stderr.splitlines() if "in use by another job" in line]
    assert len(message) == 1 and "Traceback" not in second.stderr
    assert f"(pid {first.pid}" in message[0] and "host " in message[0] and "another snapshot.dir" in message[0]
    assert "reusing prepared data" not in second.stderr  # refused before any data work

    assert stop(first) == 0, output(first)[-3000:]
    assert all(m["config"]["seed"] == 1337 for m in manifests(tmp_path / "snap"))  # only the first job wrote
    assert claims(tmp_path / "snap")[-1]["released"] is True

    # Once the first job has ended, another job (here, in this process) takes the run over at once, and says
    # what changed.
    log = train_here(tmp_path, "seed=7", f"trainer.max_steps={latest_step(tmp_path / 'snap') + 5}")
    assert "continuing" in log and "which released it" in log and "settings changed since that snapshot: seed: " \
        "1337 -> 7" in log


@pytest.mark.multiproc
def test_a_dead_holder_on_this_machine_is_taken_over_at_once(tmp_path, procs):
    first = procs.start(job(tmp_path, "snapshot.lease_timeout_s=3600"), "first")
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first job's snapshot", [first])
    os.killpg(first.pid, signal.SIGKILL)  # no release, and a claim that would not expire for an hour
    first.wait(timeout=30)
    assert claims(tmp_path / "snap")[-1]["released"] is False

    log = train_here(tmp_path, f"trainer.max_steps={latest_step(tmp_path / 'snap') + 5}")  # in this process
    assert re.search(rf"continuing .* after job .*, whose processes on this machine \({first.pid}\) have ended", log)
    assert "taking over" not in log  # an ordinary resume, no alarm
    assert "resumed from" in log


def skewed_clock(tmp_path, offset_s: float) -> dict:
    """An environment whose Python processes read a wall clock `offset_s` seconds off (time.time, which
    is what claims record), as on a host whose clock is wrong: a sitecustomize on PYTHONPATH."""
    folder = tmp_path / f"clock{offset_s:+.0f}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        f"import time\n_wall = time.time\ntime.time = lambda: _wall() + {offset_s!r}\n")
    return {**env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.skipif(not HAS_UNSHARE, reason="needs unshare --uts (root) to play another host")
def test_another_host_never_takes_over_a_live_holder_whatever_the_clocks_and_takes_over_a_silent_one(tmp_path, procs):
    """The holder renews its claim every lease_timeout_s / 4; its clock is 600 s behind. A job on another
    host, its clock 600 s ahead (the claim looks 20 minutes old there), watches the claim change and is
    refused: expiry is judged on the claimant's own monotonic clock, never by comparing timestamps of two
    hosts. Once the holder is frozen (SIGSTOP: alive, but silent) and its claim files deleted, the other
    host takes over after watching it for the timeout. Thawed, the old holder finds itself fenced off: it stops with exit 2 and
    commits or deletes nothing more."""
    timeout = 6
    first = procs.start(job(tmp_path, "model=gpt-micro", f"snapshot.lease_timeout_s={timeout}"), "first",
                        environment=skewed_clock(tmp_path, -600))
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first job's snapshot", [first])
    assert claims(tmp_path / "snap")[-1]["renewed"] < time.time() - 500  # its clock is behind

    other_host = ["unshare", "--uts", "sh", "-c", 'hostname other-node && exec "$@"', "sh"]
    refused = subprocess.run(other_host + job(tmp_path, "model=gpt-micro"), cwd=tmp_path,
                             env=skewed_clock(tmp_path, 600), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "in use by another job" in refused.stderr, refused.stderr[-3000:]
    assert f"on host {socket.gethostname()} (pid {first.pid}" in refused.stderr
    assert "renewed its claim or committed while this job watched" in refused.stderr
    assert first.poll() is None

    os.killpg(first.pid, signal.SIGSTOP)
    try:
        # And its claim files are deleted (by hand, or by a bucket's expiry rule): the newest commit's writer
        # stands for the holder, so this is a take-over at generation 2, never a fresh run at generation 1
        # (two jobs at generation 1 used to train into one run, one of them ending "done" with its work lost).
        shutil.rmtree(tmp_path / "snap" / "owner")
        frozen_at = latest_step(tmp_path / "snap")
        taker = procs.start(other_host + job(tmp_path, "model=gpt-micro", f"snapshot.lease_timeout_s={timeout}",
                                             steps=frozen_at + 20), "taker")
        assert taker.wait(timeout=180) == 0, output(taker)[-3000:]
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    text = output(taker)
    assert "was last committed by job process:" in text and "whose claim file in" in text
    assert "has not renewed its claim for 6 s" in text and f"step-{frozen_at:09d}" in text
    after_takeover = committed_state(tmp_path / "snap")

    assert first.wait(timeout=120) == 2, output(first)[-3000:]
    assert "taken over by generation 2" in output(first)
    assert committed_state(tmp_path / "snap") == after_takeover  # the old holder wrote and deleted nothing
    assert manifests(tmp_path / "snap")[-1]["writer"]["generation"] == 2


@pytest.mark.multiproc
def test_a_commit_this_job_did_not_write_stops_it_with_exit_2(tmp_path, procs):
    """Another writer's commit appears at a step this job is about to save (here: a copy of the job's own
    snapshot, signed by another job): the job stops with exit 2 and one line, keeps that commit as it
    is, and never reports done."""
    first = procs.start(job(tmp_path, "model=gpt-micro", steps=200), "first")
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first job's snapshot", [first])
    os.killpg(first.pid, signal.SIGSTOP)  # planted while it stands still: surely ahead of it, on any machine
    source = tmp_path / "snap" / f"step-{latest_step(tmp_path / 'snap'):09d}"
    planted_step = latest_step(tmp_path / "snap") + 50
    planted = tmp_path / "snap" / f"step-{planted_step:09d}"
    shutil.copytree(source, tmp_path / "planting")
    manifest = json.loads((tmp_path / "planting" / "manifest.json").read_text())
    manifest.update(step=planted_step, writer={"job": "someone-else", "generation": 1})
    (tmp_path / "planting" / "manifest.json").write_text(json.dumps(manifest))
    os.rename(tmp_path / "planting", planted)  # appears whole, as a commit does
    planted_bytes = (planted / "manifest.json").read_bytes()
    os.killpg(first.pid, signal.SIGCONT)

    assert first.wait(timeout=120) == 2, output(first)[-3000:]
    text = output(first)
    assert f"step-{planted_step:09d} was committed by job someone-else (generation 1), not by this job" in text
    assert "done:" not in text and "Traceback" not in text
    assert (planted / "manifest.json").read_bytes() == planted_bytes
    assert latest_step(tmp_path / "snap") == planted_step


def test_stray_entries_in_owner_and_the_run_folder_are_skipped(tmp_path, capsys):
    """FIFOs, folders, garbage and foreign names where claims and snapshots live: nothing hangs (a FIFO
    read would block forever), nothing breaks; a job claims the run and trains; the listing says what is
    damaged."""
    snap = tmp_path / "snap"
    (snap / "owner").mkdir(parents=True)
    os.mkfifo(snap / "owner" / "gen-000000009.json")
    (snap / "owner" / "gen-000000008.json").mkdir()
    (snap / "owner" / "gen-000000007.json").write_text("garbage")
    (snap / "owner" / "gen-000000006.json").write_text(json.dumps({"job": "x", "generation": 5}))  # wrong number
    (snap / "owner" / "notes.txt").write_text("hello")
    os.mkfifo(snap / "step-000000003")
    (snap / "step-000000004").mkdir()
    os.mkfifo(snap / "step-000000004" / "manifest.json")
    (snap / "step-banana").mkdir()

    lease = RunLease(SnapshotStore(str(snap)).run, timeout_s=60, job="me")
    assert lease.current() is None  # none of those is a claim
    log = train_here(tmp_path, "trainer.max_steps=10")
    assert "done: step 10" in log
    assert lease.current().generation == 1 and lease.current().record["released"] is True
    assert mingpt_snapshot.main(["list", str(snap)]) == 1  # 1: it lists damaged entries
    listing = capsys.readouterr().out
    assert re.search(r"step-000000003 .* damaged: not a folder", listing)
    assert re.search(r"step-000000004 .* damaged: manifest.json is not a regular file", listing)
    assert re.search(r"step-banana .* damaged: not a snapshot name", listing)
    assert re.search(r"step-000000010 +10 .* committed", listing) and "(generation 1), released" in listing

    # The next claim's own name taken by junk, and a snapshot name that loops: skipped, the run resumes.
    os.mkfifo(snap / "owner" / "gen-000000002.json")
    os.symlink("step-000000099", snap / "step-000000099")
    log = train_here(tmp_path, "trainer.max_steps=20")
    assert "gen-000000002.json is not a claim; skipping it" in log and "done: step 20" in log
    assert lease.current().generation == 3
    assert os.path.islink(snap / "step-000000099")  # left alone, for inspection


def test_a_run_whose_claim_file_went_before_its_first_commit_is_watched_not_started_afresh(tmp_path):
    """No claim and no commit, but metrics: a job may be training there (its claim deleted before its first
    commit). A new job watches it for the lease timeout before it claims the run."""
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "metrics.jsonl").write_text('{"step": 5, "train_loss": 4.0}\n')
    log = train_here(tmp_path, "trainer.max_steps=5", "snapshot.lease_timeout_s=1")
    assert "has metrics but no claim and no commit" in log and "has not renewed its claim for 1 s" in log
    assert "done: step 5" in log


def test_a_run_claimed_by_the_previous_version_is_taken_over_as_before(tmp_path):
    """A claim file of the version before claims carried a token: its job's process on this machine has ended, so
    a new job takes the run over at once, at the next generation."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    owner = tmp_path / "snap" / "owner"
    owner.mkdir(parents=True)
    (owner / "gen-000000003.json").write_text(json.dumps({
        "job": "process:old", "generation": 3, **claim.holder([]), "pids": [[gone.pid, 1]], "since": 1.0,
        "renewed": 2.0, "beat": 4, "released": False, "timeout_s": 3600}))
    lease = RunLease(SnapshotStore(str(tmp_path / "snap")).run, timeout_s=60, job="new")
    assert lease.acquire().generation == 4
    lease.release()
    assert lease.current().record["released"] is True and lease.current().record["job"] == "new"


@pytest.mark.slow
def test_a_worker_left_from_an_older_generation_cannot_commit(tmp_path, procs):
    """torchrun's agent is SIGKILLed while its worker lives on (frozen here, so that the new
    generation is surely first). The agent is started again with the same --rdzv-id: the same job,
    so it claims the run at once, resumes and finishes. Then the old worker thaws and trains on
    alone; it must not commit nor delete anything."""
    port = free_port()
    rendezvous(procs, port)  # the store outlives the agent that is killed
    agent = torchrun("--no-live", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=zombie-test", f"--rdzv-conf={RDZV_CONF},is_host=false")
    overrides = [*SMALL, "model=gpt-micro", "snapshot.every=10", "snapshot.keep=100",
                 f"snapshot.dir={tmp_path / 'snap'}", f"data.prepared_dir={tmp_path / 'prepared'}"]
    old = procs.start(agent + overrides + ["trainer.max_steps=100000"], "old-agent")
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first generation's snapshot", [old])
    zombie = worker(old.pid, local_rank=0)
    os.kill(zombie, signal.SIGSTOP)
    os.kill(old.pid, signal.SIGKILL)  # the agent alone: its worker lives on in a session of its own
    old.wait(timeout=30)
    try:
        resumed_at = latest_step(tmp_path / "snap")
        new = procs.start(agent + overrides + ["trainer.max_steps=100000"], "new-agent")
        wait_for(lambda: latest_step(tmp_path / "snap") >= resumed_at + 20, 120, "the new generation's snapshots",
                 [new])
        assert "in use by another job" not in output(new)
        assert [c["job"] for c in claims(tmp_path / "snap")] == ["torchrun:zombie-test"] * 2  # same job, no wait
        new.send_signal(signal.SIGTERM)
        new.wait(timeout=120)
    finally:
        os.kill(zombie, signal.SIGCONT)
    before = committed_state(tmp_path / "snap")
    wait_for(lambda: not Path(f"/proc/{zombie}").exists() or _zombie_state(zombie), 120, "the old worker to stop")
    assert committed_state(tmp_path / "snap") == before
    log = output(old)
    # It names the generation that took over, whichever of its checks saw it first (its beat, or its commit).
    assert "taken over by generation 2" in log or "generation 2 of this job writes now" in log, log[-3000:]
    assert all(m["writer"]["generation"] == 2 for m in manifests(tmp_path / "snap") if m["step"] > resumed_at)


def _zombie_state(pid: int) -> bool:
    """True once `pid` has exited (a defunct entry whose parent is gone counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("where", ["local", "s3"])
def test_of_many_claims_at_once_exactly_one_wins(tmp_path, where, request):
    url = str(tmp_path / "snap") if where == "local" else f"s3://{request.getfixturevalue('s3').bucket}/run"
    store = SnapshotStore(url)
    if where == "local":
        os.makedirs(store.path)
    start, results = threading.Barrier(6), []

    def claim(i: int) -> None:
        lease = RunLease(store.run, timeout_s=60, job=f"job-{i}")
        start.wait()
        try:
            results.append(lease.acquire().generation)
        except RunOwnedError:
            results.append(None)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [1] + [None] * 5
