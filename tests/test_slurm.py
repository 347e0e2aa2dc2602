"""train/slurm.sbatch submitted with sbatch to a real Slurm of two nodes on this machine (tests/slurm_cluster.py), as
users submit it: the CPU values, a short time and the notice on the sbatch line. Marked `slurm`, they run only where
-m names them: .ci/run runs them beside the README's test command, with `python -m pytest -q -n 0 -m slurm`."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import boto3
import pytest
from conftest import s3_keys
from launch import BIN, ENDLESS_STEPS, REPO, SMALL, env, free_port_and_next, latest_step, ledger, metrics
from slurm_cluster import NODES, Cluster, SlurmUnavailable

pytestmark = pytest.mark.slurm

SCRIPT = REPO / "train" / "slurm.sbatch"
# One CPU a node instead of the script's GPUs; the script's own time limit would be a day.
CPU_NODES = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=5"]
DELAY_S = 10  # each upload of a slow snapshot: under s3fs's read timeout (15 s), past which it would retry
PACE_S = 0.5  # each commit of a paced job
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The session's Slurm; stopped, every process of it and of its jobs, after the last test."""
    if os.geteuid() != 0:
        pytest.skip("a Slurm of its own needs root (its daemons run as root, and it may install Debian's packages)")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        pytest.fail(f"no Slurm to test with: {e}", pytrace=False)
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def no_job_left(slurm):
    """What a test that failed midway left running is cancelled: the next test's jobs would share its nodes."""
    yield
    slurm.run(["scancel", "--full", "--user=root"], check=False)
    deadline = time.monotonic() + 120  # (a job's end takes up to KillWait; the next test's waits say if it never came)
    while slurm.idle_nodes() != set(NODES) and time.monotonic() < deadline:
        time.sleep(0.5)


def submit(slurm: Cluster, folder: Path, overrides: list[str], *options: str, **variables: str) -> str:
    """sbatch of train/slurm.sbatch with `options` and the trainer's `overrides`; the job's id. The job's output
    goes to FOLDER/job-ID.out, appended to across requeues."""
    environment = {**env(), "SLURM_CONF": str(slurm.conf), "NPROC_PER_NODE": "1",
                   "RDZV_PORT": str(free_port_and_next()), "PATH": f"{BIN}:{os.environ['PATH']}", **variables}
    args = ["sbatch", "--parsable", *CPU_NODES, f"--output={folder}/job-%j.out", "--open-mode=append",
            f"--chdir={REPO}", *options, str(SCRIPT), *overrides]
    done = slurm.run(args, environment=environment)
    return done.strip().split(";")[0]


def job_output(folder: Path, job_id: str) -> str:
    path = folder / f"job-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_until(condition, timeout: float, what: str, slurm: Cluster, folder: Path, job_id: str) -> None:
    """Poll `condition` until true; fail with the job's output (and the end of the daemons' logs) if not."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; job {job_id}: "
                                 f"{slurm.job(job_id)}\n{job_output(folder, job_id)[-4000:]}\n{slurm.logs()}")
        time.sleep(0.5)


def wait_ended(slurm: Cluster, folder: Path, job_id: str, timeout: float = 240) -> dict[str, str]:
    """The job's fields once it ended."""
    wait_until(lambda: slurm.job(job_id)["JobState"] in ENDED, timeout, "the job's end", slurm, folder, job_id)
    return slurm.job(job_id)


def training(tmp_path: Path, steps: int, every: int, *extra: str) -> list[str]:
    return [*SMALL, f"trainer.max_steps={steps}", f"snapshot.every={every}", f"snapshot.dir={tmp_path / 'snap'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", *extra]


def world_sizes(snap: Path) -> set[int]:
    """The world sizes its steps were logged at (the live mode's snapshots hold a replica group's)."""
    return {record["world_size"] for record in metrics(snap) if "train_loss" in record}


def assert_every_sample_once(snap: Path, last: int) -> None:
    """The ledger has each step from 1 to `last` with one set of samples: none lost, none trained twice."""
    seen = ledger(snap)
    assert sorted(seen) == list(range(1, last + 1)), sorted(seen)
    assert all(len(samples) == 1 for samples in seen.values()), {s: d for s, d in seen.items() if len(d) > 1}


def test_the_script_trains_on_two_nodes_and_resumes_when_submitted_again(slurm, tmp_path):
    """In the script's default mode, the live one, where a group trains alone until the other joins: enough steps
    for it to. (LIVE=0, the restart mode, runs in the notice-window test; its two-node jobs in test_trainer.py.)"""
    steps = 200
    first = submit(slurm, tmp_path, training(tmp_path, steps, steps // 2))
    assert wait_ended(slurm, tmp_path, first)["JobState"] == "COMPLETED", job_output(tmp_path, first)[-4000:]
    text = job_output(tmp_path, first)
    assert latest_step(tmp_path / "snap") == steps and 2 in world_sizes(tmp_path / "snap"), text[-4000:]
    assert "SLURM_RESTART_COUNT=0" in text and "--shutdown-timeout=110" in text

    again = submit(slurm, tmp_path, training(tmp_path, steps + 3, steps // 2))
    assert wait_ended(slurm, tmp_path, again)["JobState"] == "COMPLETED", job_output(tmp_path, again)[-4000:]
    assert latest_step(tmp_path / "snap") == steps + 3
    assert_every_sample_once(tmp_path / "snap", steps + 3)  # it went on from the first job's last step


def test_a_time_limit_leaves_a_snapshot_of_the_last_step_and_exits_0(slurm, tmp_path, s3):
    """--time=1 with --signal=TERM@15 on the sbatch line: SIGTERM 15 to 45 s into the job (Slurm sends it up to its
    30 s check period early). The workers finish their step and snapshot it, and the job ends before its limit.
    One node: what it shows is the same on each (the requeue test stops two nodes at once). It snapshots every step
    to an S3 that commits slowly: until the SIGTERM it waits on its saves rather than trains."""
    job = submit(slurm, tmp_path, paced(s3, tmp_path), "--nodes=1", "--time=1", "--signal=TERM@15", STOP_NOTICE_S="15")
    fields = wait_ended(slurm, tmp_path, job, timeout=120)
    text = job_output(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text[-4000:]
    stopped = [line for line in text.splitlines() if line.startswith("slurm.sbatch: job") and "SIGTERM" in line]
    assert len(stopped) == 1 and "--shutdown-timeout=5" in text, text[-4000:]
    trained = [record["step"] for record in s3_metrics(s3) if "samples" in record]
    assert committed_steps(s3)[-1] == max(trained) > 0, text[-4000:]  # the snapshot is of its last step


def test_a_requeued_job_comes_back_by_itself_and_resumes_where_it_stopped_until_its_limit(slurm, tmp_path):
    """scontrol requeue: Slurm's SIGTERM (KillWait before its SIGKILL), then the job runs again by itself, with
    SLURM_RESTART_COUNT=1, from the snapshot of the step it stopped at. Requeued once more than MAX_REQUEUES=1,
    it stops, naming the limit."""
    snap = tmp_path / "snap"
    job = submit(slurm, tmp_path, training(tmp_path, ENDLESS_STEPS, 1000), MAX_REQUEUES="1")
    running = lambda: slurm.job(job)["JobState"] == "RUNNING"
    wait_until(lambda: max(ledger(snap), default=0) >= 3, 180, "three steps", slurm, tmp_path, job)
    requeue(slurm, tmp_path, job)
    wait_until(lambda: "SLURM_RESTART_COUNT=1" in job_output(tmp_path, job), 180, "the requeued run", slurm,
               tmp_path, job)
    stopped_at = latest_step(snap)
    wait_until(lambda: max(ledger(snap)) > stopped_at + 2, 180, "training after the requeue", slurm, tmp_path, job)
    assert_every_sample_once(snap, max(ledger(snap)))
    # (srun forwards the tasks' lines through slurmstepd: under load they may come after the steps' records)
    wait_until(lambda: "resumed" in job_output(tmp_path, job).lower(), 60, "the line saying so", slurm, tmp_path, job)

    wait_until(running, 60, "the job running", slurm, tmp_path, job)
    requeue(slurm, tmp_path, job)
    fields = wait_ended(slurm, tmp_path, job, timeout=120)
    text = job_output(tmp_path, job)
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "2", text[-4000:]
    assert "requeued 2 times, more than MAX_REQUEUES=1" in text


def requeue(slurm: Cluster, folder: Path, job_id: str) -> None:
    """scontrol requeue; then, once the job is pending again, the two minutes Slurm holds a requeued job before it
    may start again (its BeginTime) are cut short."""
    slurm.run(["scontrol", "requeue", job_id])
    wait_until(lambda: slurm.job(job_id)["JobState"] == "PENDING", 60, "the job pending", slurm, folder, job_id)
    slurm.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])


def test_a_node_lost_with_no_kill_leaves_the_other_training_at_the_smaller_size(slurm, tmp_path, s3):
    """--no-kill (the script's, on sbatch and srun): one node's slurmd and tasks are killed. Slurm sets the node
    DOWN and keeps the job and the other node's task, which goes on alone. In the script's default mode, the live
    one: what Slurm does is the same in both, and the restart mode's shrinking is tested without Slurm
    (test_trainer.py). Paced by slow commits, as Slurm takes its time to see the node gone."""
    job = submit(slurm, tmp_path, paced(s3, tmp_path))
    trained = lambda size: [r["step"] for r in s3_metrics(s3) if "train_loss" in r and r["world_size"] == size]
    wait_until(lambda: trained(2), 180, "steps on two nodes", slurm, tmp_path, job)
    try:
        slurm.kill_node(NODES[1])
        lost_at = max(trained(2))
        wait_until(lambda: max(trained(1), default=0) > lost_at, 180, "steps on the node left", slurm, tmp_path, job)
        wait_until(lambda: slurm.node_state(NODES[1]).startswith("down"), 90, "the node DOWN", slurm, tmp_path, job)
        down_at = committed_steps(s3)[-1]
        wait_until(lambda: committed_steps(s3)[-1] > down_at + 5, 60, "training after", slurm, tmp_path, job)
        assert slurm.job(job)["JobState"] == "RUNNING"
    finally:
        slurm.run(["scancel", job], check=False)
        wait_ended(slurm, tmp_path, job, timeout=120)
        slurm.start_node(NODES[1])
    wait_until(lambda: slurm.idle_nodes() == set(NODES), 120, "the lost node back", slurm, tmp_path, job)


def committed_steps(s3) -> list[int]:
    return sorted(int(key.split("/")[1][5:]) for key in s3_keys(s3, "run/") if key.endswith("/manifest.json"))


def paced(s3, tmp_path: Path) -> list[str]:
    """An endless job that snapshots every step to an S3 that takes PACE_S to commit each: while Slurm's clocks run,
    its workers wait on their saves rather than train (a core each, which the tests beside these need)."""
    s3.add("PUT", r"/run/step-\d+/manifest\.json", "delay", count=float("inf"), delay_s=PACE_S)
    return [*SMALL, f"trainer.max_steps={ENDLESS_STEPS}", "snapshot.every=1", f"snapshot.dir=s3://{s3.bucket}/run",
            "snapshot.memory=off", f"data.prepared_dir={tmp_path}/prepared"]


def s3_metrics(s3) -> list[dict]:
    """The records of the run's metrics.jsonl, which an S3 run writes at each snapshot."""
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    try:
        text = client.get_object(Bucket=s3.bucket, Key="run/metrics.jsonl")["Body"].read().decode()
    except client.exceptions.NoSuchKey:
        return []
    return [json.loads(line) for line in text.splitlines()]


def test_the_workers_get_the_whole_notice_and_a_save_cut_short_leaves_the_previous_snapshot(slurm, tmp_path, s3):
    """The notice window, shown with a slow snapshot: S3 delays each of its uploads DELAY_S (the issue's 60 s save
    in a 90 s notice, scaled down). `scancel --signal=TERM` signals the steps and sends no SIGKILL after it, so only
    the agent's window can cut a save short:
    1. STOP_NOTICE_S=70: a 60 s window, in which a save of over 30 s (torch's fixed window) is committed;
    2. STOP_NOTICE_S=20: a 10 s window, cut short: the agent SIGKILLs the worker mid-save, and the snapshot of 1.
       stays the newest complete one;
    3. which the same command resumes from.
    One node, as the window is each agent's own. The restart mode, where the save starts as the step ends: in the
    live mode a stopping group first leaves the quorum, which under load took more than the 10 s window of 2., so
    that no save began (the time-limit test stops a live job with a notice)."""
    run = [*SMALL, f"snapshot.dir=s3://{s3.bucket}/run", "snapshot.every=1000", "snapshot.memory=off",
           f"data.prepared_dir={tmp_path}/prepared"]

    def stop_during_a_slow_save(notice: int) -> tuple[str, float]:
        job = submit(slurm, tmp_path, [*run, f"trainer.max_steps={ENDLESS_STEPS}"], "--nodes=1",
                     STOP_NOTICE_S=str(notice), LIVE="0")
        stepping = lambda: re.search(r"INFO step \d+/", job_output(tmp_path, job)) is not None
        wait_until(stepping, 120, "training", slurm, tmp_path, job)
        slow = s3.add("PUT", r"/run/step-\d+/", "delay", count=float("inf"), delay_s=DELAY_S)
        slurm.run(["scancel", "--signal=TERM", job])
        stopped = time.monotonic()
        wait_ended(slurm, tmp_path, job, timeout=150)
        slow.count = 0  # spent: it slows no later save
        return job, time.monotonic() - stopped

    job, stopping_s = stop_during_a_slow_save(70)  # 1.
    text = job_output(tmp_path, job)
    assert stopping_s > 30 and len(committed_steps(s3)) == 1 and "Unable to shutdown process" not in text, text[-4000:]
    saved = committed_steps(s3)[0]

    job, stopping_s = stop_during_a_slow_save(20)  # 2.
    text = job_output(tmp_path, job)
    assert stopping_s < 30 and "Unable to shutdown process" in text, text[-4000:]  # the agents' SIGKILL, at 10 s
    assert committed_steps(s3) == [saved]
    assert any(f"/step-{saved:09d}/" not in key for key in s3_keys(s3, "run/step-"))  # the torn save's debris

    job = submit(slurm, tmp_path, [*run, f"trainer.max_steps={saved + 2}"], "--nodes=1", LIVE="0")  # 3.
    assert wait_ended(slurm, tmp_path, job)["JobState"] == "COMPLETED", job_output(tmp_path, job)[-4000:]
    assert f"step-{saved:09d}: step {saved}" in job_output(tmp_path, job) and committed_steps(s3)[-1] == saved + 2
