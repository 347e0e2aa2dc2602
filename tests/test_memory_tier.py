"""The memory tier (mingpt.checkpoint.memory): a copy cut short by a real kill is never loaded, and a
tier of another job is never used."""

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
    # Step 3 went to slot 0, over step 1: its first tensor is there, and nothing describes the slot.
    assert torch.equal(torch.from_file(str(tier.folder / "slot-0.bin"), size=4096, dtype=torch.float32),
                       torch.full((4096,), 3.0))
    assert not (tier.folder / "slot-0.json").exists()
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

    theirs = MemoryTier("run", "job-2", root=str(tmp_path))
    assert theirs.newest() is None
    theirs.start()
    assert not list(theirs.folder.iterdir())  # job-1's state is gone
    assert MemoryTier("another run", "job-2", root=str(tmp_path)).folder != theirs.folder


def test_the_tier_of_a_job_whose_launcher_ended_is_removed_by_the_next_job_to_start(tmp_path):
    import json

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    for run, launcher in (("ended run", ended.pid), ("running run", None)):
        tier = MemoryTier(run, "a job", root=str(tmp_path))
        tier.start()
        tier.save({"w": torch.ones(2)}, 1, {})
        tier.wait()
        if launcher:
            header = json.loads((tier.folder / "slot-0.json").read_text())
            (tier.folder / "slot-0.json").write_text(json.dumps({**header, "launcher": launcher}))
    MemoryTier("a new run", "another job", root=str(tmp_path)).start()
    assert not MemoryTier("ended run", "a job", root=str(tmp_path)).folder.exists()
    assert MemoryTier("running run", "a job", root=str(tmp_path)).newest().step == 1  # its launcher (ours) runs
