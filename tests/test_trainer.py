"""The trainer under real torchrun processes on 127.0.0.1 (gloo on CPU), and in this process where one
process is all a test needs."""

import os
import re
import shutil
import signal
import time

import pytest
import torch

from launch import (
    ENDLESS_STEPS, HEAVIER, KEEP_ALL, RDZV_CONF, assert_equal_weights, free_port, kill_node,
    latest_step, manifest_at, manifests, metrics, output, overrides, rendezvous, run, standalone, stop,
    torchrun, train_here, wait_for, weights, worker,
)
from conftest import TEXT
from mingpt.checkpoint.memory import MemoryTier
from mingpt.checkpoint.store import SnapshotError
from mingpt.cli import sample


@pytest.mark.slow
def test_killed_workers_cost_at_most_a_step_and_the_run_stays_bitwise_identical(tmp_path, procs, reference):
    """A worker that is not the leader is SIGKILLed between periodic snapshots: the leader saves the step it
    reached (the rescue snapshot), the restarted workers resume there, and the run stays bitwise that of an
    uninterrupted one. (A killed leader, which cannot save for itself, resumes from the memory tier: see
    test_watchdog's frozen leader under ddp and test_fsdp's two kills of the leader.)"""
    snap = tmp_path / "killed"
    tier = MemoryTier(str(snap), "")  # to read what the job's tier records
    every_step = [*HEAVIER, *KEEP_ALL, "snapshot.memory=on", "snapshot.memory_every=1"]  # steps of tens of ms
    job = procs.start(standalone(2, max_restarts=2) + overrides(tmp_path, "killed", ENDLESS_STEPS, extra=every_step),
                      "killed")
    between_snapshots = lambda: tier.reached() >= 10 and 3 <= tier.reached() % 10 <= 6
    wait_for(between_snapshots, 120, "a step between two snapshots", [job])
    workers = [worker(job.pid, local_rank) for local_rank in (0, 1)]  # both run
    os.kill(workers[1], signal.SIGKILL)
    # The survivor's collective failed; before exiting, it saved the step it had reached ...
    wait_for(lambda: re.search(r"step failed; saving step (\d+)", output(job)), 120, "the rescue snapshot", [job])
    rescued = int(re.search(r"step failed; saving step (\d+)", output(job))[1])
    # ... and the restarted workers resumed there.
    wait_for(lambda: f"step-{rescued:09d}: step {rescued}," in output(job), 120, "the resume", [job])
    compared = (rescued // 10 + 2) * 10
    wait_for(lambda: latest_step(snap) >= compared, 120, f"the step-{compared} snapshot", [job])
    stop(job)
    assert output(job).count("resumed from") == 1, output(job)[-4000:]
    lost = [m["steps_lost"] for m in metrics(snap) if "steps_lost" in m]
    assert len(lost) == 1 and max(lost) <= 1, lost
    assert f"steps lost: {lost[-1]}" in output(job)

    uninterrupted = reference.at(compared)
    assert_equal_weights(weights(uninterrupted, compared), weights(snap, compared))
    loss = lambda d: manifest_at(d, compared)["metrics"]["train_loss"]
    assert loss(snap) == loss(uninterrupted)
    assert tier.folders() == []  # released when the job ended


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [
    pytest.param([], id="gpt2-adamw"),
    pytest.param(["model.arch=modern", "trainer.optimizer=muon"], id="modern-muon"),
])
def test_workers_run_to_the_end_and_uneven_shards_give_the_full_batch_gradient(tmp_path, procs, recipe):
    """3 processes share 10 examples as 4+3+3, in micro-batches of 2 (accumulated under no_sync):
    the same steps as one process taking all 10 in one pass, up to float summation order, with either optimizer.
    (Strided windows are sliced the same way from their own order: test_sampler checks that order.)
    Launched as the README's multinode line on one node: the agent finds that --rdzv-endpoint names
    this machine and hosts the rendezvous store itself, torch's default."""
    windows = "random"
    uneven = ["trainer.global_batch_size=10", "trainer.micro_batch_size=2", f"data.windows={windows}", *recipe]
    node = torchrun("--nnodes=1:4", "--nproc-per-node=3", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=uneven", f"--rdzv-conf={RDZV_CONF}")
    text = run(procs, node, overrides(tmp_path, "three", 20, extra=uneven), "three")
    assert f"data.windows={windows}:" in text
    final = manifests(tmp_path / "three")[-1]
    assert final["step"] == 20 and final["world_size"] == 3 and final["samples_seen"] == 20 * 10
    assert "done: step 20" in text
    # mingpt-torchrun prepared the data before its agent started (a node that joins a running job must not
    # make it wait while it tokenizes); the workers reuse it.
    assert text.index("mingpt-torchrun: data ready in") < text.index("this job holds") < text.index("reusing prepared")
    assert [m["step"] for m in metrics(tmp_path / "three") if "train_loss" in m] == [5, 10, 15, 20]
    # One process logs: every progress line appears once.
    assert text.count("step 20/20") == 1
    # Hydra writes nothing of its own (no outputs/ folder, none per rank) in the working directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared", "three", "three.log"]

    alone = ["trainer.global_batch_size=10", "trainer.micro_batch_size=10", f"data.windows={windows}", *recipe]
    train_here(tmp_path / "alone", "trainer.max_steps=20", "snapshot.every=10", *alone)  # one process: this one
    three, one = weights(tmp_path / "three", 20), weights(tmp_path / "alone" / "snap", 20)
    for key in one:
        assert torch.allclose(three[key], one[key], rtol=1e-4, atol=1e-5), key
    losses = lambda d: [m["train_loss"] for m in metrics(d) if "train_loss" in m]
    assert losses(tmp_path / "three") == pytest.approx(losses(tmp_path / "alone" / "snap"), rel=1e-5)


def test_finished_job_run_again_does_no_training_and_leaves_no_memory_tier(tmp_path):
    """Nor does a job refused for another model shape: the memory tier its start made goes with it."""
    tier = ["snapshot.memory=on", f"snapshot.memory_dir={tmp_path / 'shm'}"]
    (tmp_path / "shm").mkdir()
    train_here(tmp_path, "trainer.max_steps=10", *tier)
    before = sorted(p.name for p in (tmp_path / "snap").iterdir())
    text = train_here(tmp_path, "trainer.max_steps=10", *tier)
    assert "already complete: step 10" in text
    assert "step 1/10" not in text and "loss" not in text
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == before
    with pytest.raises(SnapshotError, match="n_layer"):
        train_here(tmp_path, "trainer.max_steps=10", "model.n_layer=2", *tier)
    assert list((tmp_path / "shm").iterdir()) == []


def test_longer_max_steps_continues_a_finished_run(tmp_path):
    text = train_here(tmp_path, "trainer.max_steps=10", "trainer.warmup_steps=10")
    assert "trainer.warmup_steps=10 is not below trainer.max_steps=10: the whole run warms the learning rate up" in text
    text = train_here(tmp_path, "trainer.max_steps=20", "trainer.warmup_steps=10")
    assert "resumed from" in text and "done: step 20" in text and "warms the learning rate up" not in text
    assert manifests(tmp_path / "snap")[-1]["samples_seen"] == 20 * 8


def test_sampling_needs_no_corpus(char_run, capsys):
    """The shared run's corpus and prepared data are gone (see conftest): the snapshot is enough."""
    args = [str(char_run), "--prompt", "the ", "--max-new-tokens", "60", "--num-samples", "2", "--seed", "3"]
    assert sample.main(args) == 0
    first = capsys.readouterr().out
    samples = first.split("--- sample ")[1:]
    assert len(samples) == 2
    # Each sample: the prompt and up to 60 characters of the corpus's; fewer where the model ends its document.
    assert all(set(s.split("\n", 1)[1].strip()) <= set(TEXT) for s in samples)
    assert all(len("the ") < len(s.split("\n", 1)[1].strip()) <= len("the ") + 60 for s in samples)
    assert sample.main(args) == 0
    assert capsys.readouterr().out == first  # same seed, same text


EVERY = 10  # steps between the elastic job's snapshots


@pytest.mark.slow
def test_two_nodes_shrink_and_grow_back(tmp_path, procs, reference):
    """Two agents on 127.0.0.1 as two nodes, launched with mingpt-torchrun as the README says (no
    variable in the environment), around the store that mingpt-rendezvous hosts, sharding the model
    between them (fsdp); the first node dies (the node any other store would live on; its
    snapshot.memory_dir goes with it, as a machine's memory does), the other goes on alone, from its
    own shard and the copy of the dead node's shard that it holds in memory; a node comes back, then
    leaves on SIGTERM (a preemption: every process writes its shard of the snapshot), and the survivor
    goes on alone again. None of it uses up --max-restarts=0. (An agent hosting the store itself,
    torch's default, trains the uneven-shards test above.)"""
    snap = tmp_path / "elastic"
    began = time.time()  # the wall clock, as the agents stamp a change they notice
    port = free_port()
    rendezvous(procs, port)
    args = torchrun("--no-live", "--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
                    f"--rdzv-conf={RDZV_CONF},is_host=false")
    args += overrides(tmp_path, "elastic", ENDLESS_STEPS, every=EVERY,
                      extra=[*HEAVIER, *KEEP_ALL, "trainer.parallelism=fsdp", "snapshot.memory_every=1"])
    node = lambda name: procs.start([*args, f"snapshot.memory_dir={tmp_path / name}"], name)  # memory of its own
    for name in ("node-a", "node-b", "node-c"):
        (tmp_path / name).mkdir()
    dead = node("node-a")
    survivor = node("node-b")  # at once, so that it joins the first rendezvous
    by_world = lambda ws: [m for m in manifests(snap) if m["world_size"] == ws]
    wait_for(lambda: by_world(2), 120, "a snapshot from two nodes", [dead, survivor])
    tier = MemoryTier(str(snap), "", root=str(tmp_path / "node-b"))  # to read what the survivor's tier records
    wait_for(lambda: tier.reached() > by_world(2)[0]["step"] and 3 <= tier.reached() % EVERY <= 6, 120,
             "a step between two snapshots", [dead, survivor])

    kill_node(dead)
    dead.wait(timeout=30)
    shutil.rmtree(tmp_path / "node-a")  # a machine that dies takes its memory with it
    shrunk_from = latest_step(snap)
    wait_for(lambda: [m for m in by_world(1) if m["step"] > shrunk_from], 120, "a snapshot from one node", [survivor])

    grown_from = latest_step(snap)
    newcomer = node("node-c")
    regrown = lambda: [m for m in by_world(2) if m["step"] > grown_from and m["step"] % EVERY == 0]
    wait_for(regrown, 120, "a periodic snapshot from two nodes again", [survivor, newcomer])
    compared = regrown()[0]["step"]

    # The newcomer leaves. Both nodes snapshot the step they reached; the survivor goes on alone, in a
    # new round, instead of taking the shared stop for the end of the job.
    newcomer.send_signal(signal.SIGTERM)
    assert newcomer.wait(timeout=90) == 128 + signal.SIGTERM  # its workers snapshot and exit; then it, in a line
    assert output(newcomer).strip().splitlines()[-1] == \
        "mingpt-torchrun: stopped by SIGTERM; the workers' lines above say where they stopped"
    left_at = latest_step(snap)
    wait_for(lambda: [m for m in by_world(1) if m["step"] > left_at], 120, "a snapshot from the survivor alone",
             [survivor])
    survivor.send_signal(signal.SIGTERM)
    survivor.wait(timeout=90)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in output(survivor)  # set by mingpt-torchrun, not by us
    assert "deprecated" not in output(survivor)  # no setting of mingpt-torchrun's under a name torch retired
    assert re.search(rf"membership change: left \S+ \(agent {newcomer.pid}\)", output(survivor))

    # The leader of each new round says what changed: the dead node, lost; the newcomer joining; the
    # newcomer leaving on SIGTERM (or, had its agent left the rendezvous first, gone from it).
    changes = [(m["membership"], m["recovery_s"]) for m in metrics(snap) if "membership" in m]
    named = lambda node: f"(agent {node.pid})"
    assert [c["cause"] for c, _ in changes if any(named(dead) in n for n in c["left"])] == \
        ["lost (its processes died or were cut off)"]
    assert [len(c["members"]) for c, _ in changes if any(named(newcomer) in n for n in c["joined"])] == [2]
    causes = [c["cause"] for c, _ in changes if any(named(newcomer) in n for n in c["left"])]
    assert causes in (["asked to stop (SIGTERM)"], ["gone from the rendezvous"]), causes
    # Each change was noticed after this test began and before the step that reports it, however long
    # recovering took on this machine.
    assert all(0 < seconds <= time.time() - began for _, seconds in changes), changes

    # The survivor goes on from the step it reached, from the memory tiers (snapshots are 10 steps apart):
    # where the other node was lost, from its own shard and the copy of the other's that it was sent.
    lost_steps = [m["steps_lost"] for m in metrics(snap) if "steps_lost" in m]
    assert lost_steps and max(lost_steps) <= 1, lost_steps
    assert "resumed from the memory tier" in output(survivor)  # which held both shards of the step reached
    history = [m for m in metrics(snap) if "train_loss" in m]
    sizes = [m["world_size"] for m in history]
    # Two nodes, one, two again, one (the first node may train alone for a moment before the second joins).
    grown = sizes.index(2, sizes.index(1, sizes.index(2)))
    assert 1 in sizes[grown:] and sizes[-1] == 1, sizes
    for m in manifests(snap):
        assert m["samples_seen"] == m["step"] * 16  # the global batch never changed
    # Against an uninterrupted run: the same examples in the same steps; only float summation
    # order differs while one node is alone.
    ours = manifest_at(snap, compared)["metrics"]["train_loss"]
    expected = manifest_at(reference.at(compared), compared)["metrics"]["train_loss"]
    assert abs(ours - expected) < 0.03 * expected, (ours, expected)
