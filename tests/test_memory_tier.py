"""The memory tier (mingpt.checkpoint.memory): a copy cut short by a real kill is never loaded, and a
tier of another job is never used."""

import os
import signal
import subprocess
import sys
import textwrap

import torch

from launch import REPO, wait_for
from mingpt.checkpoint.memory import MemoryTier

WRITER = textwrap.dedent("""
    import sys, time
    import torch
    import mingpt.checkpoint.memory as memory

    tier = memory.MemoryTier("run", "job-1", root=sys.argv[1])
    tier.start()
    for step in (1, 2):  # slot 0 then slot 1
        tier.save({"a": torch.full((4096,), float(step)), "b": torch.full((4096,), float(step)), "step": step}, step, {})
        tier.wait()
    view = memory._view
    def stall_after_one_tensor(buffer, entry, seen=[]):
        seen.append(entry)
        if len(seen) == 2:  # step 3's first tensor is copied over step 1's slot; stop before the second
            print("mid-copy", flush=True)
            time.sleep(3600)
        return view(buffer, entry)
    memory._view = stall_after_one_tensor
    tier.save({"a": torch.full((4096,), 3.0), "b": torch.full((4096,), 3.0), "step": 3}, 3, {})
    tier.wait()
""")


def test_a_copy_cut_short_by_a_kill_is_never_loaded(tmp_path):
    log = tmp_path / "writer.log"
    with open(log, "w") as out:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=out, stderr=subprocess.STDOUT,
                                  cwd=REPO)
    try:
        wait_for(lambda: "mid-copy" in log.read_text(), 60, "the copy of step 3 to start", [writer])
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    tier = MemoryTier("run", "job-1", root=str(tmp_path))
    [written] = tier.folders()  # the writer's, named after its launcher: this process
    assert written.name.endswith(f"-{os.getpid()}")
    # Step 3 went to slot 0, over step 1: its first tensor is there, and nothing describes the slot.
    assert torch.equal(torch.from_file(str(written / "slot-0.bin"), size=4096, dtype=torch.float32),
                       torch.full((4096,), 3.0))
    assert not (written / "slot-0.json").exists()
    held = tier.newest()
    assert held is not None and held.step == 2
    state = MemoryTier.unpack(MemoryTier.load(held), held.header)
    assert state["step"] == 2 and torch.equal(state["a"], torch.full((4096,), 2.0))
    assert torch.equal(state["b"], torch.full((4096,), 2.0))


def test_a_tier_of_another_job_is_never_used_and_is_removed_when_a_job_starts(tmp_path):
    ours = MemoryTier("run", "job-1", root=str(tmp_path))
    ours.start()
    ours.save({"w": torch.ones(3), "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}], 7: None}, 5, {"samples_seen": 40})
    ours.wait()
    held = ours.newest()
    state = MemoryTier.unpack(MemoryTier.load(held), held.header)
    assert state == {"w": state["w"], "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}], 7: None}  # keys and tuples kept
    assert held.header["samples_seen"] == 40

    theirs = MemoryTier("run", "job-2", root=str(tmp_path))  # the same launcher here: the same folder
    assert theirs.newest() is None
    theirs.start()
    assert not list(theirs.folder.iterdir())  # job-1's state is gone
    assert MemoryTier("another run", "job-2", root=str(tmp_path)).folder != theirs.folder


def test_the_tier_of_a_job_whose_launcher_ended_is_removed_by_the_next_job_to_start(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    for run in ("ended run", "running run"):
        tier = MemoryTier(run, "a job", root=str(tmp_path))
        tier.start()
        tier.save({"w": torch.ones(2)}, 1, {})
        tier.wait()
    gone = MemoryTier("ended run", "a job", root=str(tmp_path))
    gone.folder.rename(gone.root / f"{gone.prefix}-{ended.pid}")  # as if its launcher were that ended process
    MemoryTier("a new run", "another job", root=str(tmp_path)).start()
    assert gone.folders() == []
    assert MemoryTier("running run", "a job", root=str(tmp_path)).newest().step == 1  # its launcher (ours) runs


def test_a_tier_older_than_the_generation_of_the_last_snapshot_is_never_used(tmp_path):
    """Generation 1 reached step 12 in memory; a generation 2 that never saw that tier went on from an older
    snapshot and committed step 10: its timeline wins, and the tier is left alone."""
    from types import SimpleNamespace

    from launch import config
    from mingpt.checkpoint.store import SnapshotStore
    from mingpt.model import GPT, GPTConfig
    from mingpt.tokenizers import CharTokenizer
    from mingpt.training.checkpointer import Checkpointer, Replica, TrainState
    from mingpt.training.distributed import World

    cfg = config("snapshot.memory=on", "snapshot.memory_every=1", f"snapshot.dir={tmp_path / 'run'}")
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    store = SnapshotStore(cfg.snapshot.dir)

    def replica(seed: int) -> Replica:
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=8))
        return Replica(model, torch.optim.AdamW(model.parameters()), None, TrainState())

    with store.claim(60):  # generation 1
        writer = Checkpointer(cfg, world, store, CharTokenizer("abc"), "data")
        try:
            assert writer.load_newer_from_memory(replica(0), None) is None and writer.generation == 1
            reached = replica(1)
            reached.state.step, reached.state.samples_seen = 12, 96
            writer.after_step(reached)
            writer.before_update()

            def resume(snapshot) -> Replica:
                reader = Checkpointer(cfg, world, store, CharTokenizer("abc"), "data")
                reader.memory.job = writer.memory.job  # a plain process is a job of its own: be the same job
                resumed = replica(2)
                reader.load_newer_from_memory(resumed, snapshot)
                return resumed

            later = SimpleNamespace(manifest={"step": 10, "writer": {"generation": 2}})
            assert resume(later).state.step == 0  # refused: nothing loaded
            same = SimpleNamespace(manifest={"step": 10, "writer": {"generation": 1}})
            resumed = resume(same)
            assert (resumed.state.step, resumed.state.samples_seen) == (12, 96)
            assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), reached.model.parameters()))
        finally:
            writer.memory.release()
