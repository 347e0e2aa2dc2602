"""trainer.parallelism=fsdp: sharded training and sharded snapshots, under real torchrun processes on
127.0.0.1 (gloo on CPU), and the sharded snapshot format in this process."""

import hashlib
import json
import os
import pickle
import re
import shutil
import signal

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from launch import SMALL, ledger, manifests, metrics, output, standalone, train_here, wait_for, worker
from mingpt.checkpoint.lease import LeaseLostError, RunLease
from mingpt.checkpoint.load import open_model, snapshot_store
from mingpt.checkpoint.memory import MemoryTier
from mingpt.checkpoint.sharded import write_shards
from mingpt.checkpoint.store import SnapshotError, SnapshotStore
from mingpt.cli import snapshot as snapshot_command
from mingpt.errors import ConfigError
from mingpt.interop.pretrained import open_pretrained
from mingpt.model import GPT, GPTConfig
from mingpt.tokenizers import CharTokenizer
from mingpt.training import parallel
from mingpt.training.distributed import World

FSDP, HSDP = ["trainer.parallelism=fsdp"], ["trainer.parallelism=hsdp"]
# After warm-up the learning rate stays put, so a run may stop at any trainer.max_steps and go on to a
# later one exactly as a run that was always going there.
CONSTANT_LR = ["trainer.min_lr_ratio=1.0"]
UNEVEN = ["trainer.global_batch_size=9", "trainer.micro_batch_size=2"]  # 5 + 4 examples over two processes
TOKENIZER = CharTokenizer(list("abcdefgh "))
CONFIG = GPTConfig(vocab_size=TOKENIZER.vocab_size, block_size=8, n_layer=2, n_head=2, n_embd=16)


def overrides(root, name, steps, every=5, extra=()):
    return [*SMALL, *CONSTANT_LR, *UNEVEN, f"trainer.max_steps={steps}", f"snapshot.every={every}",
            f"snapshot.dir={root / name}", f"data.prepared_dir={root / 'prepared'}", "snapshot.keep=1000", *extra]


def model_at(snap, step):
    return open_model(str(snap / f"step-{step:09d}"), torch.device("cpu"))[1]


def greedy(model) -> list[int]:
    prompt = torch.zeros((1, 1), dtype=torch.long)
    return model.generate(prompt, 30, temperature=0.0)[0].tolist()


def assert_same_end(snap, reference, steps):
    """Both runs reached `steps` with the same validation loss (to 1e-4) and the same greedy text."""
    ours, theirs = manifests(snap)[-1], manifests(reference)[-1]
    assert ours["step"] == theirs["step"] == steps
    assert ours["metrics"]["val_loss"] == pytest.approx(theirs["metrics"]["val_loss"], abs=1e-4)
    assert greedy(model_at(snap, steps)) == greedy(model_at(reference, steps))


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_moves_between_ddp_and_fsdp_through_two_kills_of_its_leader_and_ends_as_if_it_never_had(
        tmp_path, procs):
    """One process (ddp) to step 5; two sharded workers (fsdp) to 30, whose leader is SIGKILLed twice
    between snapshots (snapshot.every=100): each time, the next generation resumes from the memory tiers,
    where each process keeps its shard after every step, and trains at most the step in flight again; then
    one process to 40. Against a run that went from 5 to 40 untouched, sharded by hsdp (a mesh of 1 node
    x 2 processes, whose gradients go through the same reduce-scatter): at 30 the weights are equal bit
    for bit, and both runs end alike. 9 examples a step: the worker with 4 runs two micro-batches of 2 and
    one that weighs nothing, as each forward of a sharded model is a collective of both. The modern architecture
    (model.arch=modern): its norms of queries and keys, its untied head and no position table go through the same."""
    start, modern = tmp_path / "start", ["model.arch=modern"]
    train_here(tmp_path, *overrides(tmp_path, "start", 5, extra=modern)[len(SMALL):])
    assert (start / "step-000000005" / "model.pt").exists()
    for name in ("reference", "run"):
        shutil.copytree(start, tmp_path / name)  # its owner/ says the run was released: taken over at once
    reference, snap, memory = tmp_path / "reference", tmp_path / "run", tmp_path / "memory"
    memory.mkdir()
    uninterrupted = procs.start(standalone(2) + overrides(tmp_path, "reference", 40, every=10, extra=[*HSDP, *modern]),
                                "reference")

    in_memory = ["snapshot.memory=on", "snapshot.memory_every=1", f"snapshot.memory_dir={memory}"]
    job = procs.start(standalone(2, max_restarts=3) + overrides(tmp_path, "run", 30, every=100,
                                                                extra=[*FSDP, *in_memory, *modern]), "run")
    tier = MemoryTier(str(snap), "", root=str(memory))  # to read the steps the job's tiers record
    for kill, at in enumerate((8, 18)):
        wait_for(lambda: tier.reached() >= at, 180, f"step {at}", [job])
        os.kill(worker(job.pid, local_rank=0), signal.SIGKILL)  # standalone: local rank 0 leads
        wait_for(lambda: output(job).count("resumed from the memory tier") > kill, 180, "the resume", [job])
    assert job.wait(timeout=180) == 0, output(job)[-4000:]
    assert uninterrupted.wait(timeout=180) == 0, output(uninterrupted)[-4000:]
    assert "fsdp (as configured)" in output(job) and "hsdp (as configured)" in output(uninterrupted)
    lost = [m["steps_lost"] for m in metrics(snap) if "steps_lost" in m]
    assert len(lost) == 2 and max(lost) <= 1, lost
    assert [m["step"] for m in manifests(snap)] == [5, 30]  # every resume came from memory
    seen, expected = ledger(snap), ledger(reference)  # every step's samples logged, whenever the leader died
    assert [step for step in range(1, 31) if seen.get(step) != expected[step]] == []
    assert {path.name for path in (snap / "step-000000030" / "state").iterdir()} == \
        {".metadata", "__0_0.distcp", "__1_0.distcp"}
    ours, theirs = model_at(snap, 30).state_dict(), model_at(reference, 30).state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    assert list(memory.iterdir()) == []  # released when the job ended

    text = train_here(tmp_path, *overrides(tmp_path, "run", 40, extra=modern)[len(SMALL):])
    assert "step 30, 270 examples seen, now 1 process(es)" in text
    assert (snap / "step-000000040" / "model.pt").exists()
    assert_same_end(snap, reference, 40)


# -- the sharded format, in this process -------------------------------------------------------------------


def save_sharded(store: SnapshotStore, step: int, model: GPT | None = None) -> GPT:
    """A sharded snapshot as one process writes it (a world of one): model and AdamW state after a step."""
    torch.manual_seed(step)
    model = model or GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros((1, 4), dtype=torch.long), torch.zeros((1, 4), dtype=torch.long))[1].backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    assert store.begin(step) is None
    folder = f"{store.path}/step-{step:09d}"
    entries = write_shards({"model": model_state, "optimizer": optimizer_state}, store.fs, folder, lambda: None, None)
    entries |= store.write(step, {"tokenizer.json": TOKENIZER.to_json().encode()})
    store.commit(step, entries, {"samples_seen": step, "model_config": CONFIG.to_dict()})
    return model


class _Evil:
    """Unpickling this would create a file: the attack a planted index carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "snaps")
    return f"s3://{request.getfixturevalue('s3').bucket}/run"


def test_sharded_snapshots_load_without_a_process_group_and_are_listed_verified_and_pruned(store_url, capsys):
    store = SnapshotStore(store_url, keep=2)
    for step in (10, 20):
        save_sharded(store, step)
    model = save_sharded(store, 30)
    assert [s.step for s in store.committed()] == [20, 30]  # retention counts sharded snapshots as any other
    snapshot = store.latest()
    assert snapshot.sharded and snapshot.step == 30
    loaded = open_model(store_url, torch.device("cpu"))[1]  # mingpt-sample's and mingpt-export's way in
    initial = open_pretrained(store_url, CONFIG.block_size).load()  # model.init_from's
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
        assert torch.equal(initial[key], value), key
    assert snapshot_command.main(["verify", store_url]) == 0
    listing = capsys.readouterr().out
    assert "step-000000030" in listing and "verified" in listing, listing

    # A truncated shard: the newest is damaged, verify says so, and loading falls back to step 20.
    shard = f"{store.path}/step-000000030/state/__0_0.distcp"
    store.fs.pipe_file(shard, store.fs.cat_file(shard)[:100])
    assert store.latest().step == 20
    assert snapshot_command.main(["verify", store_url]) != 0
    assert "__0_0.distcp" in capsys.readouterr().out
    assert open_model(store_url, torch.device("cpu"))[0].step == 20


def test_a_planted_index_is_refused_and_never_runs_even_with_a_manifest_to_match(tmp_path, capsys):
    store = SnapshotStore(str(tmp_path / "snaps"))
    save_sharded(store, 10)
    marker = tmp_path / "pwned"
    folder = tmp_path / "snaps" / "step-000000010"
    planted = pickle.dumps(_Evil(str(marker)))
    (folder / "state" / ".metadata").write_bytes(planted)
    # Without a matching manifest, the checksum refuses it before anything parses it ...
    with pytest.raises(SnapshotError, match="damaged"):
        open_model(str(folder), torch.device("cpu"))
    # ... and with one (whoever can write the bucket can write the manifest), the index is still never
    # unpickled with more than DCP's own classes.
    plant_index(folder, planted)
    with pytest.raises(SnapshotError, match=r"refusing to read state/.metadata .* index of shards \(it names (io|builtins)\.open\)"):
        open_model(str(folder), torch.device("cpu"))
    assert not marker.exists()


def test_a_cut_index_with_a_manifest_to_match_is_skipped_like_any_damaged_snapshot(tmp_path, caplog):
    """DCP's index cut short, its checksum rewritten to match: verifying the snapshot reads the index, so a
    resume, mingpt-sample and mingpt-snapshot fall back to the snapshot before it, with no DCP traceback."""
    url = str(tmp_path / "snaps")
    store = SnapshotStore(url)
    for step in (20, 30):
        save_sharded(store, step)
    index = (tmp_path / "snaps" / "step-000000030" / "state" / ".metadata").read_bytes()
    plant_index(tmp_path / "snaps" / "step-000000030", index[: len(index) // 2])
    assert snapshot_store(url).latest().step == 20  # a resume's choice
    assert open_model(url, torch.device("cpu"))[0].step == 20  # mingpt-sample's
    assert "refusing to read state/.metadata" in caplog.text and "falling back" in caplog.text
    assert "Traceback" not in caplog.text
    assert snapshot_command.main(["verify", url]) == 1


def plant_index(folder, planted: bytes) -> None:
    """Put `planted` in as the snapshot's DCP index, with a manifest rewritten to match it."""
    (folder / "state" / ".metadata").write_bytes(planted)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["state/.metadata"] = {"bytes": len(planted), "sha256": hashlib.sha256(planted).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _calls(module: str, name: str, argument: str) -> bytes:
    """A pickle (protocol 4) that calls module.name(argument): what pickle.dumps cannot be made to write
    for a dotted name, written opcode by opcode."""
    text = lambda value: b"\x8c" + bytes([len(value.encode())]) + value.encode()  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R."  # STACK_GLOBAL, TUPLE1, REDUCE


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint.metadata", "os.system"),  # the module imports os: a dotted name reaches it
    ("torch.distributed.checkpoint.metadata", "torch.serialization.os.system"),
    ("torch.distributed.checkpoint.metadata", "dataclass"),  # a function the module imported
    ("torch", "load"),
])
def test_a_planted_index_reaches_no_function_through_dcps_modules(tmp_path, module, name):
    store = SnapshotStore(str(tmp_path / "snaps"))
    save_sharded(store, 10)
    marker = tmp_path / "pwned"
    folder = tmp_path / "snaps" / "step-000000010"
    plant_index(folder, _calls(module, name, f"touch {marker}"))
    with pytest.raises(SnapshotError, match=rf"refusing to read state/.metadata .* \(it names {re.escape(module)}\."):
        open_model(str(folder), torch.device("cpu"))
    assert not marker.exists()


def test_every_process_fences_its_shard_with_the_leaders_lease(tmp_path):
    """A process writing its shard beside the leader checks the leader's claim before each file: once a newer
    generation holds the run, it writes nothing."""
    store = SnapshotStore(str(tmp_path / "snaps"))
    leader = RunLease(store.run, timeout_s=60, job="old")
    claim = leader.acquire()
    beside = RunLease.following(store.run, claim)
    beside.check()  # the leader's generation holds the run: writing is allowed
    leader.release()
    assert RunLease(store.run, timeout_s=60, job="new").acquire().generation == claim.generation + 1
    model = GPT(CONFIG)
    folder = f"{store.path}/step-000000010"
    with pytest.raises(LeaseLostError, match="taken over by generation 2"):
        write_shards({"model": model.state_dict()}, store.fs, folder, beside.check, None)
    assert [path for path in (tmp_path / "snaps").rglob("*") if path.is_file() and "owner" not in path.parts] == []


def test_ddp_that_cannot_fit_names_the_numbers_and_fsdp():
    class Distributed(World):
        distributed = True

    world = Distributed(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"))
    room = parallel.memory_per_process(world)
    params = int(room / parallel.STATE_BYTES_PER_PARAM) * 2  # twice what fits
    with pytest.raises(ConfigError, match=r"trainer.parallelism=ddp .* GB .* Use trainer.parallelism=fsdp"):
        parallel.choose("ddp", params, world)
    assert parallel.choose("auto", params, world)[0] == "fsdp"
    assert parallel.choose("auto", 1000, world)[0] == "ddp"
    assert parallel.choose("fsdp", 1000, world)[0] == "fsdp"


def test_muon_keeps_matrices_whole_auto_is_ddp_and_a_model_too_large_for_ddp_is_refused():
    """Muon orthogonalises whole matrices: auto never shards for it, live or not (fsdp and hsdp with it are refused
    by config.validate: test_app)."""
    class Distributed(World):
        distributed = True

    world = Distributed(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), per_node=2)
    params = int(parallel.memory_per_process(world) / parallel.STATE_BYTES_PER_PARAM) * 2  # twice what fits
    fits = params // 3  # auto would shard it for AdamW, but one copy fits
    assert parallel.choose("auto", fits, world)[0] == "fsdp"
    for live in (False, True):
        assert parallel.choose("auto", fits, world, live, "muon") == \
            ("ddp", "auto: trainer.optimizer=muon needs whole matrices")
    assert parallel.choose("ddp", 1000, world, optimizer="muon") == ("ddp", "as configured")
    with pytest.raises(ConfigError, match=r"trainer.optimizer=muon .* \(ddp\): .* GB .* Use trainer.optimizer=adamw"):
        parallel.choose("auto", params, world, optimizer="muon")


def test_a_live_node_shards_within_itself_only():
    """Under mingpt-torchrun --live the world is one node, whose model the other nodes replicate: auto shards
    within the node (hsdp), and fsdp (over every node) is refused naming hsdp."""
    class Distributed(World):
        distributed = True

    world = Distributed(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), per_node=2)
    params = int(parallel.memory_per_process(world) / parallel.STATE_BYTES_PER_PARAM) * 2
    mode, why = parallel.choose("auto", params, world, live=True)
    assert mode == "hsdp" and "within the node" in why
    assert parallel.choose("auto", 1000, world, live=True)[0] == "ddp"
    assert parallel.choose("hsdp", 1000, world, live=True)[0] == "hsdp"
    with pytest.raises(ConfigError, match="use trainer.parallelism=hsdp"):
        parallel.choose("fsdp", 1000, world, live=True)
