"""The memory tier (mingpt.checkpoint.memory): a copy cut short by a real kill is never loaded, a tier of
another job is never used, and nothing another user plants in /dev/shm is ever read or written through."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from launch import REPO, train_here, wait_for
from mingpt.checkpoint.memory import MemoryTier, unusable
from mingpt.errors import ConfigError
from mingpt.training.config import SnapshotConfig
from mingpt.training.recovery import check_memory_dir


def newest(tier: MemoryTier):
    """The newest shard of `tier` whose buffer matches its sha256, as a restore finds it; None if none."""
    return next((held for held in tier.shards() if tier.read(held) is not None), None)

WRITER = textwrap.dedent("""
    import sys, time
    import torch
    import mingpt.checkpoint.memory as memory

    tier = memory.MemoryTier("run", "job-1", root=sys.argv[1])
    tier.start()
    for step in (1, 2):  # own-0 then own-1
        tier.save({"a": torch.full((4096,), float(step)), "b": torch.full((4096,), float(step)), "step": step}, step, {})
        tier.wait()
    view = memory._view
    def stall_after_one_tensor(buffer, entry, seen=[]):
        seen.append(entry)
        if len(seen) == 2:  # step 3's first tensor is copied over step 1's own-0; stop before the second
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
    [written] = tier.folders()  # the writer's, named after its launcher (itself: it was started without torchrun)
    assert written.name.endswith(f"-{writer.pid}-0of1")
    # Step 3 went to own-0, over step 1: its first tensor is there, and nothing describes the slot.
    assert torch.equal(torch.from_file(str(written / "own-0.bin"), size=4096, dtype=torch.float32),
                       torch.full((4096,), 3.0))
    assert not (written / "own-0.json").exists()
    held = newest(tier)
    assert held is not None and held.step == 2
    state = MemoryTier.unpack(tier.read(held), held.header)
    assert state["step"] == 2 and torch.equal(state["a"], torch.full((4096,), 2.0))
    assert torch.equal(state["b"], torch.full((4096,), 2.0))
    # Its parent (this process) lives on; the next job to start on this machine removes the dead writer's tier,
    # though it keeps no tier itself (started without torchrun, snapshot.memory=auto).
    log = train_here(tmp_path / "next", f"snapshot.memory_dir={tmp_path}", "trainer.max_steps=1")
    assert not written.exists() and f"removing {written}, the memory tier of a job that ended" in log


def test_a_tier_of_another_job_is_never_used_and_is_removed_when_a_job_starts(tmp_path):
    ours = MemoryTier("run", "job-1", root=str(tmp_path))
    ours.start()
    ours.save({"w": torch.ones(3), "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}], 7: None}, 5, {"samples_seen": 40})
    ours.wait()
    held = newest(ours)
    state = MemoryTier.unpack(ours.read(held), held.header)
    assert state == {"w": state["w"], "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}], 7: None}  # keys and tuples kept
    assert held.header["samples_seen"] == 40

    theirs = MemoryTier("run", "job-2", root=str(tmp_path))  # the same launcher here: the same folder
    assert newest(theirs) is None
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
    gone.folder.rename(gone.root / f"{gone.prefix}-{ended.pid}-0of1")  # as if its launcher were that ended process
    MemoryTier("a new run", "another job", root=str(tmp_path)).start()
    assert gone.folders() == []
    assert newest(MemoryTier("running run", "a job", root=str(tmp_path))).step == 1  # its launcher (ours) runs


def test_a_generation_of_another_world_size_leaves_no_folder_behind_once_this_one_has_copied(tmp_path):
    tier = MemoryTier("run", "job-1", root=str(tmp_path), shard=(0, 2))
    for layout in ("0of2", "1of2", "0of1", "3of12"):
        (tmp_path / f"{tier.launcher}-{layout}").mkdir(mode=0o700)
    tier.forget_other_layouts()
    assert sorted(path.name.rsplit("-", 1)[-1] for path in tmp_path.iterdir()) == ["0of2", "1of2"]


def test_a_tier_older_than_the_generation_of_the_last_snapshot_is_never_used(tmp_path):
    """Generation 1 reached step 12 in memory; a generation 2 that never saw that tier went on from an older
    snapshot and committed step 10: its timeline wins, and the tier is left alone."""
    from launch import config
    from mingpt.model import GPT, GPTConfig
    from mingpt.training.distributed import World
    from mingpt.training.parallel import Topology
    from mingpt.training.recovery import MemoryCopies
    from mingpt.training.state import Replica, TrainState

    cfg = config("snapshot.memory=on", "snapshot.memory_every=1", f"snapshot.memory_dir={tmp_path}")
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    def copies(seed: int) -> MemoryCopies:
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=8))
        made = MemoryCopies(cfg.snapshot, Topology(world, "ddp"), "run",
                            Replica(model, torch.optim.AdamW(model.parameters()), None, TrainState()))
        made.tier.job = "job-1"  # a plain process is a job of its own: be the same job
        return made

    writer = copies(1)
    assert writer.restore(0, None) is None  # nothing held yet; the tier starts
    writer.generation = 1
    writer.replica.state.step, writer.replica.state.samples_seen = 12, 96
    writer.replica.state.ledger = [(11, "digest of 11"), (12, "digest of 12")]
    writer.after_step()
    writer.before_update()
    try:
        refused = copies(2)
        assert refused.restore(10, 2) is None and refused.replica.state.step == 0  # nothing loaded
        resumed = copies(2)
        assert resumed.restore(10, 1)["step"] == 12
        assert (resumed.replica.state.step, resumed.replica.state.samples_seen) == (12, 96)
        assert resumed.replica.state.ledger == writer.replica.state.ledger  # for a writer that died to log them
        assert all(torch.equal(a, b) for a, b in zip(resumed.replica.model.parameters(),
                                                      writer.replica.model.parameters()))
    finally:
        writer.finish(release=True)


def test_on_a_cpu_the_chosen_interval_counts_the_copys_own_work(tmp_path):
    """snapshot.memory_every=0 training on the CPU: a copy's memcpy and sha256 take the cores that train, so a copy
    of tens of ms beside a step of 20 ms that never waits for it is made every few steps, not every step."""
    from launch import config
    from mingpt.training.distributed import World
    from mingpt.training.parallel import Topology
    from mingpt.training.recovery import MEASURED_AT, OVERHEAD, MemoryCopies
    from mingpt.training.state import Replica, TrainState

    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = torch.nn.Linear(2048, 4096)  # 32 MB of weights
    copies = MemoryCopies(config("snapshot.memory=on", f"snapshot.memory_dir={tmp_path}").snapshot,
                          Topology(world, "ddp"), "run", Replica(model, torch.optim.SGD(model.parameters()), None,
                                                                 TrainState()))
    copies.restore(0, None)
    try:
        for step in range(1, MEASURED_AT + 1):
            copies.replica.state.step = step
            copies.after_step()
            copies.tier.wait()  # the copy is done before the next step, which never waits for it
            copies.before_update()
            time.sleep(0.02)  # the step: 20 ms in which the copy's work would have been training's
        assert copies.tier.copy_seconds > 0 and copies.every > 1
        assert copies.every >= copies.tier.copy_seconds / (OVERHEAD * copies._step_seconds)
    finally:
        copies.finish(release=True)


@pytest.mark.parametrize("kind", ["a file", "missing", "a link to a file", "read-only"])
def test_memory_on_where_no_tier_can_be_kept_is_one_line_before_the_data_work(tmp_path, kind):
    """An explicit snapshot.memory=on that cannot work is refused (auto turns the tier off with a warning)."""
    from launch import train_here
    from mingpt.errors import ConfigError

    place = tmp_path / "memory"
    if kind == "a file":
        place.write_text("not a folder")
    elif kind == "a link to a file":
        (tmp_path / "file").write_text("not a folder")
        place.symlink_to(tmp_path / "file")
    elif kind == "read-only":
        if os.getuid() == 0:
            pytest.skip("root writes in any folder")
        place.mkdir(mode=0o500)
    with pytest.raises(ConfigError) as refused:
        train_here(tmp_path, "snapshot.memory=on", f"snapshot.memory_dir={place}")
    message = str(refused.value)
    assert "\n" not in message and f"snapshot.memory_dir={place}" in message and "snapshot.memory=auto" in message
    assert not (tmp_path / "prepared").exists() and unusable(str(place))
    assert unusable(str(tmp_path)) is None


# -- hostile ground: /dev/shm is writable by every user of the machine ---------------------------------------

NOBODY = 65534


@pytest.fixture
def shared_memory():
    """A folder like /dev/shm (world-writable, sticky), inside it."""
    if os.getuid() != 0:
        pytest.skip("giving files to another user needs root")
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="test-tier-"))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def give_to_nobody(path: Path) -> None:
    """Make `path` (and what is in it) another user's, as if that user had made it."""
    for item in [path, *path.rglob("*")]:
        os.lchown(item, NOBODY, NOBODY)


def test_a_tier_folder_another_user_made_is_never_read_nor_written(shared_memory, caplog):
    """Another user makes a valid tier of this job (its id can be worked out from the command line) under
    the very name this job's launcher will use, open to everyone."""
    planted = MemoryTier("run", "job-1", root=str(shared_memory))
    planted.start()
    planted.save({"w": torch.full((4,), 666.0)}, 99, {})
    planted.wait()
    planted.release = lambda: None
    planted.folder.chmod(0o777)
    give_to_nobody(planted.folder)
    before = {p.name: p.read_bytes() for p in planted.folder.iterdir()}

    ours = MemoryTier("run", "job-1", root=str(shared_memory))
    assert ours.folder == planted.folder
    assert newest(ours) is None  # never loaded as this job's weights
    ours.start()
    assert ours.off and not ours.writes  # never written into: the tier is off, the job goes on
    ours.mark_reached(100)
    assert {p.name: p.read_bytes() for p in ours.folder.iterdir()} == before
    assert caplog.text.count("memory tier off") == 1 and "another user may have made it" in caplog.text


def test_a_tier_in_a_folder_where_others_could_replace_its_folders_is_refused_or_off(tmp_path):
    """snapshot.memory_dir that other users may write in, without the sticky bit /dev/shm has: snapshot.memory=on
    is refused in one line before any work; auto turns the tier off with one warning (MemoryCopies)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cfg = SnapshotConfig(memory="on", memory_dir=str(shared))
    with pytest.raises(ConfigError) as refused:
        check_memory_dir(cfg)
    assert str(refused.value) == (
        f"snapshot.memory=on keeps the state in snapshot.memory_dir={shared}, but other users may write in {shared}, "
        "which has no sticky bit, so another user could replace the tier's folders on this machine; give a folder "
        "this user can write (/dev/shm), or use snapshot.memory=auto or off")
    shared.chmod(0o1777)  # as /dev/shm
    check_memory_dir(cfg)


def test_a_planted_link_never_makes_the_tier_write_elsewhere(shared_memory, tmp_path):
    ours = MemoryTier("run", "job-1", root=str(shared_memory))
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "own-0.bin").write_bytes(b"precious")
    ours.folder.symlink_to(victim)  # to a folder of this user's: only the link is the other user's
    os.lchown(ours.folder, NOBODY, NOBODY)
    ours.start()
    assert ours.off and newest(ours) is None
    assert (victim / "own-0.bin").read_bytes() == b"precious" and [p.name for p in victim.iterdir()] == ["own-0.bin"]


def test_a_fifo_a_damaged_description_or_changed_bytes_are_skipped_never_loaded(tmp_path, caplog):
    tier = MemoryTier("run", "job-1", root=str(tmp_path))
    tier.start()
    for step in (1, 2):  # own-0 holds step 1, own-1 step 2
        tier.save({"w": torch.full((8,), float(step))}, step, {})
        tier.wait()
    assert newest(tier).step == 2
    (tier.folder / "own-1.bin").write_bytes(b"\1" + (tier.folder / "own-1.bin").read_bytes()[1:])
    held = newest(tier)  # step 2's bytes changed: step 1 it is
    assert held.step == 1 and torch.equal(MemoryTier.unpack(tier.read(held), held.header)["w"],
                                          torch.full((8,), 1.0))
    header = json.loads((tier.folder / "own-0.json").read_text())
    for damage in ({"step": "1"}, {"nbytes": -1}, {"tensors": [{**header["tensors"][0], "dtype": "garbage"}]},
                   {"tensors": [{**header["tensors"][0], "offset": 10**9}]}, {"tree": {"tensor": 5}},
                   {"shard": [1, 1]}):
        (tier.folder / "own-0.json").write_text(json.dumps({**header, **damage}))
        assert newest(tier) is None  # skipped: no exception, nothing loaded
        tier._skipped.clear()
    (tier.folder / "own-0.json").unlink()
    os.mkfifo(tier.folder / "own-0.json")
    # Returning at all is the proof: opening a FIFO to read waits for a writer, and none ever comes here
    # (pytest's timeout ends the test if it waits).
    assert newest(tier) is None
    assert "memory tier: skipping" in caplog.text


def test_a_tier_whose_folder_vanishes_turns_itself_off_once_and_training_goes_on(tmp_path, caplog):
    tier = MemoryTier("run", "job-1", root=str(tmp_path))
    tier.start()
    tier.save({"w": torch.ones(4)}, 1, {})
    tier.wait()
    shutil.rmtree(tier.folder)  # as systemd's RemoveIPC does when a user's last session ends
    tier.mark_reached(2)
    assert tier.off and not tier.writes
    tier.mark_reached(3)
    assert caplog.text.count("memory tier off") == 1 and newest(tier) is None


def small_tmpfs(folder: Path, size: str) -> Path:
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root and a machine that allows it")
    return folder


@pytest.fixture
def full_memory(tmp_path):
    """A tmpfs of 256 KiB: shared memory with less room than the state."""
    yield small_tmpfs(tmp_path / "tiny", "256k")
    subprocess.run(["umount", str(tmp_path / "tiny")], check=True)


@pytest.fixture
def room_for_one(tmp_path):
    """A tmpfs of 1.5 MiB: room for one copy of a 1 MiB state, not two."""
    yield small_tmpfs(tmp_path / "small", "1536k")
    subprocess.run(["umount", str(tmp_path / "small")], check=True)


def test_a_tier_keeps_one_copy_where_two_do_not_fit_and_none_where_one_does_not(room_for_one, tmp_path, caplog):
    state = lambda step: {"w": torch.full((2**18,), float(step))}  # 1 MiB
    tier = MemoryTier("run", "job-1", root=str(room_for_one))
    tier.start()
    tier.fit(state(0), kinds=1, writers=1)
    assert tier.slots == 1 and not tier.off
    for step in (1, 2, 3):
        tier.save(state(step), step, {})
        tier.wait()
    assert not tier.off and sorted(p.name for p in tier.folder.iterdir()) == ["own-0.bin", "own-0.json"]
    held = newest(tier)
    assert held.step == 3 and torch.equal(MemoryTier.unpack(tier.read(held), held.header)["w"], state(3)["w"])
    tier.release()  # its buffers are mapped until then

    crowded = MemoryTier("another run", "job-2", root=str(room_for_one))  # two writers here: half the room each
    crowded.start()
    crowded.fit(state(0), kinds=1, writers=2)
    assert crowded.off and caplog.text.count("memory tier off") == 1 and "no room for one copy" in caplog.text
    crowded.release()

    roomy = MemoryTier("run", "job-1", root=str(tmp_path))  # and a peer's shard (fsdp across nodes)
    roomy.start()
    roomy.fit(state(0), kinds=2, writers=1)
    assert roomy.slots == 2 and not roomy.off


def test_a_tier_with_no_room_left_turns_itself_off_instead_of_killing_the_process(full_memory):
    """A sparse buffer in a full tmpfs would kill the process (SIGBUS) at its first page without room."""
    code = textwrap.dedent("""
        import sys, torch
        from mingpt.checkpoint.memory import MemoryTier, unusable
        tier = MemoryTier("run", "job-1", root=sys.argv[1])
        tier.start()
        tier.save({"w": torch.ones(2**18)}, 1, {})  # 1 MiB
        tier.wait()
        print("off" if tier.off else "on", next((h for h in tier.shards() if tier.read(h) is not None), None))
    """)
    result = subprocess.run([sys.executable, "-c", code, str(full_memory)], capture_output=True, text=True, cwd=REPO,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["off", "None"] and result.stderr.count("memory tier off") == 1
