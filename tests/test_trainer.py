"""The trainer under real torchrun processes on 127.0.0.1 (gloo on CPU)."""

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from launch import (
    MAIN, RDZV_CONF, SMALL, children, free_port, kill_node, latest_step, manifests, metrics, output, port_listens,
    rendezvous, run, standalone, torchrun, wait_for, weights, worker,
)


# A model big enough that steps take tens of milliseconds, so a test can act mid-run.
HEAVIER = ["model=gpt-micro", "data.block_size=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8"]


def overrides(tmp_path, name, steps, every=10, extra=()):
    return [*SMALL, f"trainer.max_steps={steps}", f"snapshot.every={every}", f"snapshot.dir={tmp_path / name}",
            f"data.prepared_dir={tmp_path / 'prepared'}", *extra]


def assert_equal_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def test_standalone_two_workers_run_to_the_end(tmp_path, procs):
    text = run(procs, standalone(2), overrides(tmp_path, "snap", 20), "run")
    final = manifests(tmp_path / "snap")[-1]
    assert final["step"] == 20 and final["world_size"] == 2 and final["samples_seen"] == 20 * 8
    assert "done: step 20" in text
    assert [m["step"] for m in metrics(tmp_path / "snap") if "train_loss" in m] == [5, 10, 15, 20]
    # One process logs: every progress line appears once.
    assert text.count("step 20/20") == 1


# For jobs a test stops itself: they never finish on their own, however fast the machine, and keep
# every snapshot, so that two runs can be compared at any step both reached. Both runs of a
# comparison use the same max_steps: the learning-rate schedule depends on it.
ENDLESS_STEPS = 100_000_000
KEEP_ALL = ["snapshot.keep=1000"]


def run_until(procs, args, name, snap, step, timeout=180):
    """Start a job, wait until it has a snapshot of `step` or later, stop it as SLURM or torchrun
    would (SIGTERM: the workers finish the step, snapshot and exit), and wait for it to end."""
    job = procs.start(args, name)
    wait_for(lambda: latest_step(snap) >= step, timeout, f"{name}: a snapshot of step {step}", [job])
    stop(job)
    return job


def stop(job):
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=90)  # torchrun itself may exit non-zero on SIGTERM; the workers' snapshot is what counts


def manifest_at(snap, step):
    return next(m for m in manifests(snap) if m["step"] == step)


def test_killed_worker_resumes_bitwise_identical(tmp_path, procs):
    heavier = [*HEAVIER, *KEEP_ALL]  # steps of tens of milliseconds
    snap = tmp_path / "killed"
    job = procs.start(standalone(2, max_restarts=2) + overrides(tmp_path, "killed", ENDLESS_STEPS, extra=heavier),
                      "killed")
    wait_for(lambda: latest_step(snap) >= 30, 120, "the step-30 snapshot", [job])
    assert len(children(job.pid)) == 2
    os.kill(worker(job.pid, local_rank=1), signal.SIGKILL)
    # The survivor's collective failed; before exiting, it saved the step it had reached ...
    wait_for(lambda: re.search(r"step failed; saving step (\d+)", output(job)), 120, "the rescue snapshot", [job])
    rescued = int(re.search(r"step failed; saving step (\d+)", output(job))[1])
    # ... and the restarted workers resumed there. Compare a snapshot written well after the resume.
    wait_for(lambda: f"step-{rescued:09d}: step {rescued}," in output(job), 120, "the resume", [job])
    compared = (rescued // 10 + 2) * 10
    wait_for(lambda: latest_step(snap) >= compared, 120, f"the step-{compared} snapshot", [job])
    stop(job)
    assert output(job).count("resumed from") == 1, output(job)[-4000:]

    reference = run_until(procs, standalone(2) + overrides(tmp_path, "reference", ENDLESS_STEPS, extra=heavier),
                          "reference", tmp_path / "reference", compared)
    assert "resumed" not in output(reference)
    assert_equal_weights(weights(tmp_path / "reference", compared), weights(snap, compared))
    loss = lambda d: manifest_at(d, compared)["metrics"]["train_loss"]
    assert loss(snap) == loss(tmp_path / "reference")


@pytest.mark.parametrize("windows", ["random", "strided"])
def test_uneven_shards_and_accumulation_give_the_full_batch_gradient(tmp_path, procs, windows):
    """3 processes share 10 examples as 4+3+3, in micro-batches of 2 (accumulated under no_sync):
    the same steps as one process taking all 10 in one pass, up to float summation order."""
    uneven = ["trainer.global_batch_size=10", "trainer.micro_batch_size=2", f"data.windows={windows}"]
    text = run(procs, standalone(3), overrides(tmp_path, "three", 20, extra=uneven), "three")
    assert f"data.windows={windows}:" in text
    alone = ["trainer.global_batch_size=10", "trainer.micro_batch_size=10", f"data.windows={windows}"]
    run(procs, [sys.executable, MAIN], overrides(tmp_path, "one", 20, extra=alone), "one")
    three, one = weights(tmp_path / "three", 20), weights(tmp_path / "one", 20)
    for key in one:
        assert torch.allclose(three[key], one[key], rtol=1e-4, atol=1e-5), key
    losses = lambda d: [m["train_loss"] for m in metrics(d) if "train_loss" in m]
    assert losses(tmp_path / "three") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert manifests(tmp_path / "three")[-1]["world_size"] == 3


def test_finished_job_run_again_does_no_training(tmp_path, procs):
    args = [sys.executable, MAIN]
    run(procs, args, overrides(tmp_path, "snap", 10), "first")
    before = sorted(p.name for p in (tmp_path / "snap").iterdir())
    text = run(procs, args, overrides(tmp_path, "snap", 10), "again")
    assert "already complete: step 10" in text
    assert "step 1/10" not in text and "loss" not in text
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == before


def test_longer_max_steps_continues_a_finished_run(tmp_path, procs):
    args = [sys.executable, MAIN]
    run(procs, args, overrides(tmp_path, "snap", 10), "first")
    text = run(procs, args, overrides(tmp_path, "snap", 20), "longer")
    assert "resumed from" in text and "done: step 20" in text
    assert manifests(tmp_path / "snap")[-1]["samples_seen"] == 20 * 8


def test_sampling_needs_no_corpus(tmp_path, procs):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 400)
    run(procs, [sys.executable, MAIN], overrides(tmp_path, "snap", 40, extra=[f"data.corpus={corpus}"]), "train")
    corpus.unlink()
    shutil.rmtree(tmp_path / "prepared")
    cmd = [sys.executable, "-m", "mingpt.cli.sample", str(tmp_path / "snap"), "--prompt", "the ",
           "--max-new-tokens", "60", "--num-samples", "2", "--seed", "3"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    samples = first.stdout.split("--- sample ")[1:]
    assert len(samples) == 2
    # Each sample: the prompt and up to 60 characters of the corpus's; fewer where the model ends its document.
    assert all(set(s.split("\n", 1)[1].strip()) <= set("the cat sat on mat.") for s in samples)
    assert all(len("the ") < len(s.split("\n", 1)[1].strip()) <= len("the ") + 60 for s in samples)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.stdout == first.stdout  # same seed, same text


@pytest.mark.parametrize("store_host, lost", [("first-agent", "second"), ("mingpt-rendezvous", "first")])
def test_two_nodes_shrink_and_grow_back(tmp_path, procs, store_host, lost):
    """Two agents on 127.0.0.1 as two nodes, launched with mingpt-torchrun as the README says (no
    variable in the environment); one node dies, the other goes on alone; a node comes back.
    Where the first agent hosts the rendezvous store, only the second may die; where
    mingpt-rendezvous hosts it, the first may die too."""
    snap = tmp_path / "elastic"
    port = free_port()
    conf = RDZV_CONF
    if store_host == "mingpt-rendezvous":
        rendezvous(procs, port)
        conf += ",is_host=false"
    node = torchrun("--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test", f"--rdzv-conf={conf}")
    heavier = [*HEAVIER, *KEEP_ALL]
    args = node + overrides(tmp_path, "elastic", ENDLESS_STEPS, every=20, extra=heavier)
    first = procs.start(args, "node-a")
    if store_host == "first-agent":
        wait_for(lambda: port_listens(port), 60, "the first agent's rendezvous store", [first])
    second = procs.start(args, "node-b")
    by_world = lambda ws: [m for m in manifests(snap) if m["world_size"] == ws]
    wait_for(lambda: by_world(2), 120, "a snapshot from two nodes", [first, second])

    dead, survivor = (first, second) if lost == "first" else (second, first)
    kill_node(dead)
    dead.wait(timeout=30)
    shrunk_from = latest_step(snap)
    wait_for(lambda: [m for m in by_world(1) if m["step"] > shrunk_from], 120, "a snapshot from one node", [survivor])

    grown_from = latest_step(snap)
    newcomer = procs.start(args, "node-c")
    regrown = lambda: [m for m in by_world(2) if m["step"] > grown_from and m["step"] % 20 == 0]
    wait_for(regrown, 120, "a periodic snapshot from two nodes again", [survivor, newcomer])
    compared = regrown()[0]["step"]
    for agent in (survivor, newcomer):
        agent.send_signal(signal.SIGTERM)
    for agent in (survivor, newcomer):
        agent.wait(timeout=90)  # the workers snapshot and exit; an agent may exit non-zero on SIGTERM
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in output(survivor)  # set by mingpt-torchrun, not by us

    history = [m for m in metrics(snap) if "train_loss" in m]
    sizes = [m["world_size"] for m in history]
    assert 1 in sizes and sizes[0] == 2 and sizes[-1] == 2
    for m in manifests(snap):
        assert m["samples_seen"] == m["step"] * 16  # the global batch never changed
    # Against an uninterrupted run: the same examples in the same steps; only float summation
    # order differs while one node is alone.
    run_until(procs, standalone(2) + overrides(tmp_path, "reference", ENDLESS_STEPS, every=20, extra=heavier),
              "reference", tmp_path / "reference", compared)
    ours = manifest_at(snap, compared)["metrics"]["train_loss"]
    reference = manifest_at(tmp_path / "reference", compared)["metrics"]["train_loss"]
    assert abs(ours - reference) < 0.03 * reference, (ours, reference)
