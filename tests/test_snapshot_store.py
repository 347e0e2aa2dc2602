"""The snapshot store's commit protocol, on local disk and on a real S3 server on loopback."""

import io
import json
import logging
import os
import re

import pytest
import torch

from conftest import s3_keys
from mingpt.tokenizers import CharTokenizer
from mingpt.model import GPTConfig
from mingpt.jobenv import JobEnv
import mingpt.checkpoint.store as snapshot_module
from mingpt.checkpoint.load import snapshot_store
from mingpt.checkpoint.lease import LeaseLostError, RunLease
from mingpt.checkpoint.store import SnapshotError, SnapshotStore
from mingpt.checkpoint.writer import SnapshotWriter
from mingpt.storage import explain_storage_error
from mingpt.cli import sample, snapshot


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "snaps")
    server = request.getfixturevalue("s3")
    return f"s3://{server.bucket}/run"


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(64)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1}]}}


MODEL_CONFIG = GPTConfig(vocab_size=2, block_size=4, n_layer=1, n_head=1, n_embd=4).to_dict()
TOKENIZER = CharTokenizer(list("ab")).to_json().encode()


def info(step: int) -> dict:
    return {"samples_seen": step * 8, "model_config": MODEL_CONFIG}


def save(store: SnapshotStore, step: int):
    return store.save(step, state(step), {"tokenizer.json": TOKENIZER}, info(step))


def corrupt(store: SnapshotStore, step: int, how: str) -> None:
    path = f"{store.path}/step-{step:09d}/model.pt"
    data = store.fs.cat_file(path)
    if how == "truncated":
        store.fs.pipe_file(path, data[: len(data) // 2])
    elif how == "bit-flipped":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        store.fs.pipe_file(path, bytes(flipped))
    else:
        store.fs.rm_file(path)


def test_save_commits_with_a_manifest_that_verifies(store_url):
    store = SnapshotStore(store_url)
    snap = save(store, 10)
    latest = store.latest()
    assert latest.step == 10 and latest.manifest["samples_seen"] == 80
    assert set(latest.manifest["files"]) == {"model.pt", "optimizer.pt", "tokenizer.json"}
    loaded = latest.load_tensors("model.pt")
    assert torch.equal(loaded["w"], state(10)["model"]["w"])
    assert snap.url == f"{store_url}/step-000000010"


@pytest.mark.parametrize("how", ["truncated", "bit-flipped", "missing"])
def test_damaged_newest_snapshot_falls_back_to_the_one_before(store_url, how, caplog):
    store = SnapshotStore(store_url, keep=3)
    save(store, 10)
    save(store, 20)
    corrupt(store, 20, how)
    with caplog.at_level(logging.WARNING):
        latest = store.latest()
    assert latest.step == 10
    assert "step-000000020" in caplog.text and "damaged" in caplog.text
    with pytest.raises(SnapshotError, match="damaged"):
        store.get("step-000000020").load_tensors("model.pt")


class _TornFile:
    """A file whose first write lands half and then fails, as when the process dies mid-write.
    What was written is kept (closed, and on S3 uploaded), the worst case for the reader."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(bytes(data)[: len(data) // 2])
        raise ConnectionError("injected: the process died in the middle of this file")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def write_via_open(fs, path, data):
    with fs.open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["before", "midway"])
@pytest.mark.parametrize("fail_at", range(4))  # model.pt, optimizer.pt, tokenizer.json, manifest.json
def test_a_save_cut_short_at_any_write_leaves_the_previous_snapshot_loadable(store_url, fail_at, how, monkeypatch):
    store = SnapshotStore(store_url)
    save(store, 10)
    real_open = store.fs.open
    writes = []

    def failing_open(path, mode="rb", **kw):
        if "w" in mode:
            writes.append(path)
            if len(writes) == fail_at + 1:
                if how == "before":
                    raise ConnectionError("injected: the process died before this file")
                return _TornFile(real_open(path, mode, **kw))
        return real_open(path, mode, **kw)

    # Payloads go through open_exclusive, the manifest through create_exclusive: route both
    # through fs.open, so that the fault lands there.
    monkeypatch.setattr(store.fs, "open", failing_open)  # the fs object is shared: patch, then undo
    monkeypatch.setattr(snapshot_module, "open_exclusive", lambda fs, path: fs.open(path, "wb"))
    monkeypatch.setattr(snapshot_module, "create_exclusive", write_via_open)
    with pytest.raises(ConnectionError):
        save(store, 20)
    monkeypatch.undo()
    assert writes[-1].endswith(["model.pt", "optimizer.pt", "tokenizer.json", "manifest.json"][fail_at])
    assert [s.step for s in store.committed()] == [10]  # a torn manifest is damaged, never a commit
    assert store.latest().step == 10
    save(store, 30)  # the next commit removes the debris left by the failed step 20
    assert [s.step for s in store.committed()] == [10, 30]
    if fail_at == 3 and how == "midway":  # (only a hand copy can tear a manifest: commits write it whole)
        assert [name for name, _ in store.scan().damaged] == ["step-000000020"]  # reported, until retention
        save(store, 40)
        save(store, 50)
        assert store._folder_names() == ["step-000000030", "step-000000040", "step-000000050"]
    else:
        assert store._folder_names() == ["step-000000010", "step-000000030"]


def test_the_store_asks_the_lease_whether_a_commit_it_finds_is_its_to_keep(store_url):
    """A commit at a step this job saves is kept where it was there before this job claimed the run (the one it
    resumes from); one that another job made since stops this job, which writes nothing more and does not mark
    the run released. The lease decides; the store only asks."""
    save(SnapshotStore(store_url), 10)  # by a job before this one
    store = SnapshotStore(store_url)
    with store.claim(60, JobEnv()) as lease:
        assert save(store, 10).manifest.get("writer") is None  # kept as it was
        other = SnapshotStore(store_url)
        other.lease = RunLease(other.run, 60, job="someone-else")  # writing beside this job, without a claim
        save(other, 20)
        with pytest.raises(LeaseLostError, match=r"step-000000020 was committed by job someone-else .*, not by this job"):
            save(store, 20)
        assert lease.lost
    assert lease.current().record["released"] is False


def test_retention_keeps_the_newest_n(store_url):
    store = SnapshotStore(store_url, keep=2)
    for step in (10, 20, 30, 40):
        save(store, step)
    assert [s.step for s in store.committed()] == [30, 40]
    assert store._folder_names() == ["step-000000030", "step-000000040"]


def test_a_committed_snapshot_is_never_overwritten(store_url):
    store = SnapshotStore(store_url)
    first = save(store, 10)
    again = store.save(10, {"model": {"w": torch.ones(2)}}, {"tokenizer.json": TOKENIZER}, info(0))
    assert again.manifest == first.manifest
    assert torch.equal(store.latest().load_tensors("model.pt")["w"], state(10)["model"]["w"])


class _Evil:
    """Unpickling this would create a file: the attack a malicious payload carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_malicious_pickle_is_refused_and_never_runs(store_url, tmp_path, capsys):
    store = SnapshotStore(store_url)
    marker = tmp_path / "pwned"
    # A well-formed torch file whose pickle would call open(marker, "w"), with a matching manifest.
    buffer = io.BytesIO()
    torch.save({"w": _Evil(str(marker))}, buffer)
    files = {"model.pt": buffer.getvalue(), "tokenizer.json": CharTokenizer(list("ab")).to_json().encode()}
    config = GPTConfig(vocab_size=2, block_size=4, n_layer=1, n_head=1, n_embd=4).to_dict()
    store.save(10, {}, files, {"samples_seen": 0, "model_config": config})
    with pytest.raises(SnapshotError, match="refusing to load model.pt.*weights_only"):
        store.latest().load_tensors("model.pt")
    assert not marker.exists()
    # The sample command refuses it too, with a message and no traceback.
    assert sample.main([store_url, "--max-new-tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: refusing to load model.pt") and err.count("\n") == 1, err
    assert not marker.exists()


def test_writer_counts_consecutive_failures(tmp_path, caplog, monkeypatch):
    store = SnapshotStore(str(tmp_path / "snaps"))
    writer = SnapshotWriter(store, async_save=True, max_failures=2)

    def storage_down(*args, **kwargs):
        raise ConnectionError("storage is down")

    monkeypatch.setattr(snapshot_module, "open_exclusive", storage_down)
    writer.save(10, state(10), {"tokenizer.json": TOKENIZER}, info(10))
    writer.wait()  # one failure: logged, the job goes on, but it must not end "done" on it
    assert writer.failures == 1 and "SNAPSHOT FAILED at step 10" in caplog.text
    writer.check()
    with pytest.raises(SnapshotError, match="the last snapshot could not be written.*storage is down"):
        writer.check(final=True)
    monkeypatch.undo()
    writer.save(20, state(20), {"tokenizer.json": TOKENIZER}, info(20))
    writer.wait()
    assert writer.failures == 0 and store.latest().step == 20  # a success resets the count
    writer.check(final=True)
    monkeypatch.setattr(snapshot_module, "open_exclusive", storage_down)
    writer.save(30, state(30), {"tokenizer.json": TOKENIZER}, info(30))
    writer.save(40, state(40), {"tokenizer.json": TOKENIZER}, info(40))  # waits for 30 (failed), then tries 40
    writer.wait()
    monkeypatch.undo()
    assert writer.failed_too_often
    with pytest.raises(SnapshotError, match="2 snapshots in a row could not be written.*storage is down"):
        writer.check()
    assert [s.step for s in store.committed()] == [20]


def test_a_damaged_commit_of_the_same_step_is_replaced_not_kept(store_url):
    store = SnapshotStore(store_url)
    save(store, 10)
    save(store, 20)
    corrupt(store, 20, "bit-flipped")
    assert store.latest().step == 10  # a resumed run falls back, trains to 20 again, and saves it
    save(store, 20)
    assert store.latest().step == 20
    assert torch.equal(store.latest().load_tensors("model.pt")["w"], state(20)["model"]["w"])
    [aside] = store.scan().aside  # the damaged commit, whole, under another name: never lost
    assert aside.startswith("step-000000020.damaged-")
    assert sorted(store.fs.ls(f"{store.path}/{aside}", detail=False)) == \
        sorted(f"{store.path}/{aside}/{name}" for name in ("manifest.json", "model.pt", "optimizer.pt", "tokenizer.json"))


def test_s3_errors_at_start_name_the_cause_and_never_the_secret(s3, monkeypatch):
    from s3server import SECRET_KEY

    with pytest.raises(SnapshotError, match="bucket does not exist"):
        SnapshotStore(f"s3://no-such-bucket-{s3.bucket}/run").check_writable()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    with pytest.raises(SnapshotError, match="access denied.*credentials") as denied:
        SnapshotStore(f"s3://{s3.bucket}/run", storage_options={"skip_instance_cache": True}).check_writable()
    assert SECRET_KEY not in str(denied.value)
    options = {"key": "AKIAWRONGKEY", "secret": SECRET_KEY, "skip_instance_cache": True}
    with pytest.raises(SnapshotError) as e:
        SnapshotStore(f"s3://{s3.bucket}/run", storage_options=options).check_writable()
    assert SECRET_KEY not in str(e.value)


def test_unreachable_endpoint_is_explained(monkeypatch, closed_port):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{closed_port}")
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    options = {"skip_instance_cache": True, "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(SnapshotError, match="cannot reach the storage endpoint.*AWS_ENDPOINT_URL_S3"):
        SnapshotStore("s3://some-bucket/run", storage_options=options).check_writable()


def test_retention_on_s3_leaves_only_the_newest_objects(s3):
    store = SnapshotStore(f"s3://{s3.bucket}/run", keep=2)
    for step in (1, 2, 3):
        save(store, step)
    keys = s3_keys(s3, "run/")
    assert {k.split("/")[1] for k in keys} == {"step-000000002", "step-000000003"}
    assert sum(k.endswith("manifest.json") for k in keys) == 2


def test_explain_storage_error_fallback_names_the_setting():
    assert "snapshot.dir" in explain_storage_error(OSError("disk full"))


def test_snapshot_command_lists_and_verifies(store_url, capsys):
    store = SnapshotStore(store_url, keep=5)
    for step in (10, 20, 30):
        save(store, step)
    corrupt(store, 20, "bit-flipped")
    if store.local:
        store.fs.makedirs(f"{store.path}/step-000000040")
    store.fs.pipe_file(f"{store.path}/step-000000040/model.pt", b"half an upload")  # debris
    assert snapshot.main(["list", store_url]) == 0
    listed = capsys.readouterr().out
    rows = {line.split()[0]: line for line in listed.splitlines() if line.startswith("step-")}
    assert set(rows) == {"step-000000010", "step-000000020", "step-000000030", "step-000000040"}
    assert "debris" in rows["step-000000040"] and "committed" in rows["step-000000010"]
    assert snapshot.main(["verify", store_url]) == 1  # one is damaged
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("step-")}
    assert "verified" in rows["step-000000030"] and "verified" in rows["step-000000010"]
    assert "damaged" in rows["step-000000020"] and "model.pt" in rows["step-000000020"]
    assert "debris" in rows["step-000000040"]
    # One snapshot's folder: that snapshot alone, and its exit status.
    assert snapshot.main(["verify", f"{store_url}/step-000000030"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("step-")] == \
        ["step-000000030"]
    assert snapshot.main(["verify", f"{store_url}/step-000000020/"]) == 1


def test_snapshot_command_refuses_what_is_no_folder_with_exit_2(tmp_path, capsys):
    (tmp_path / "a-file").write_text("not snapshots")
    assert snapshot.main(["verify", str(tmp_path / "a-file")]) == 2
    assert "a-file is a file; give a run folder" in capsys.readouterr().err
    assert snapshot.main(["list", str(tmp_path / "nothing")]) == 2
    assert "nothing does not exist" in capsys.readouterr().err


# -- manifests that cannot be trusted --------------------------------------------------------------

def _with(manifest: dict, **changes) -> dict:
    manifest = json.loads(json.dumps(manifest))
    for key, value in changes.items():
        if value is DROP:
            manifest.pop(key)
        else:
            manifest[key] = value
    return manifest


DROP = object()
# name -> (a change to a good manifest, words of the reason given)
BAD_MANIFESTS = {
    "escaping-name": (lambda m: _with(m, files={**m["files"], "../../../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}),
                      "'../../../../etc/passwd' that snapshots never hold"),
    "entry-not-object": (lambda m: _with(m, files={**m["files"], "model.pt": "big"}), "entry of model.pt"),
    "no-model-config": (lambda m: _with(m, model_config=DROP), "model_config is unusable"),
    "no-samples-seen": (lambda m: _with(m, samples_seen=DROP), "no samples_seen"),
    "unknown-config-key": (lambda m: _with(m, model_config={**m["model_config"], "n_wings": 2}), "n_wings"),
    "wrong-step": (lambda m: _with(m, step=999), "says step 999"),
    "not-json": (lambda m: "{not json", "not valid JSON"),
    "nested-thousands-deep": (lambda m: "[" * 30_000 + "]" * 30_000, "not valid JSON"),  # json's RecursionError
}


def plant_manifest(store: SnapshotStore, name: str, manifest) -> None:
    """Copy step 10's payload into folder `name` and give it `manifest`, as a hand edit or a bad copy would."""
    if store.local:
        store.fs.makedirs(f"{store.path}/{name}", exist_ok=True)
    for filename in ("model.pt", "optimizer.pt", "tokenizer.json"):
        store.fs.pipe_file(f"{store.path}/{name}/{filename}", store.fs.cat_file(f"{store.path}/step-000000010/{filename}"))
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    store.fs.pipe_file(f"{store.path}/{name}/manifest.json", text.encode())


@pytest.mark.parametrize("case", BAD_MANIFESTS)
def test_an_untrustworthy_manifest_is_damaged_with_a_reason_and_the_store_falls_back(store_url, case, caplog):
    store = snapshot_store(store_url)  # knows what a model's snapshot holds: files, model_config, samples_seen
    good = save(store, 10).manifest
    change, reason = BAD_MANIFESTS[case]
    plant_manifest(store, "step-000000020", change(_with(good, step=20)))
    with caplog.at_level(logging.WARNING):
        assert store.latest().step == 10
    assert "step-000000020 is damaged" in caplog.text and reason in caplog.text
    with pytest.raises(SnapshotError, match=re.escape(reason)):
        store.get("step-000000020")


def test_a_folder_named_like_a_snapshot_but_not_one_is_damaged(store_url):
    store = SnapshotStore(store_url)
    save(store, 10)
    plant_manifest(store, "step-abc", save(store, 20).manifest)
    assert store.latest().step == 20
    assert store.scan().damaged == [("step-abc", "not a snapshot name (step- and 9 digits)")]
    with pytest.raises(SnapshotError, match="not a snapshot"):
        store.get("step-abc")


@pytest.mark.parametrize("planted", ["fifo", "dev-zero"])
def test_a_payload_that_is_not_a_regular_file_is_never_read(tmp_path, planted, capsys, caplog):
    """A FIFO would block the reader for good; /dev/zero would fill memory. Both must be 'damaged'."""
    store = SnapshotStore(str(tmp_path / "snaps"))
    save(store, 10)
    save(store, 20)
    target = tmp_path / "snaps" / "step-000000020" / "model.pt"
    target.unlink()
    os.mkfifo(target) if planted == "fifo" else target.symlink_to("/dev/zero")
    assert snapshot.main(["verify", str(tmp_path / "snaps")]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step-000000020"))
    assert "damaged" in row and "model.pt is not a regular file" in row
    assert sample.main([str(tmp_path / "snaps"), "--max-new-tokens", "3"]) == 2
    assert "step-000000020 is damaged: model.pt is not a regular file; falling back" in caplog.text
    # (this store's step 10 holds a stand-in state dict, not a GPT: said in one line)
    assert "step-000000010: model.pt does not fit its model_config" in capsys.readouterr().err


def test_snapshot_command_names_each_damaged_manifest_and_fails(store_url, capsys):
    store = SnapshotStore(store_url, keep=100)
    good = save(store, 10).manifest
    for step, (change, _) in enumerate(BAD_MANIFESTS.values(), start=2):
        plant_manifest(store, f"step-{step * 10:09d}", change(_with(good, step=step * 10)))
    for command in ("list", "verify"):
        assert snapshot.main([command, store_url]) == 1
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if line.startswith("step-")]
        assert sum("damaged" in row for row in rows) == len(BAD_MANIFESTS)
        for (_, reason) in BAD_MANIFESTS.values():
            assert any(reason in row for row in rows), (reason, out)


# -- retention and durability -------------------------------------------------------------------------

def test_damaged_snapshots_are_never_started_over_nor_count_toward_keep(store_url):
    """Every snapshot damaged: a run starting over would replace them step by step, so none starts (a truncation
    may be a copy still under way). Beside newer commits, damaged ones never count toward keep: they go last."""
    store = SnapshotStore(store_url, keep=2)
    for step in (10, 20, 30):
        save(store, step)  # keep=2: 20 and 30 stay
    for step in (20, 30):
        corrupt(store, step, "truncated")
    with pytest.raises(SnapshotError, match=r"every snapshot in .* is damaged \(step-000000020, step-000000030"):
        store.latest()
    assert [s.step for s in store.committed()] == [20, 30]  # (their manifests are whole: their files are not)
    save(store, 40)  # the only good one: the damaged two stay, for inspection
    assert store.latest().step == 40 and [s.step for s in store.committed()] == [20, 30, 40]
    save(store, 50)
    assert [s.step for s in store.committed()] == [40, 50]


def test_a_local_commit_is_on_the_disk_before_its_manifest_appears(tmp_path, monkeypatch):
    """fsync of every payload file and of the folder, then the manifest written under a temporary
    name, fsynced, and linked into place: a power cut never leaves a manifest without its bytes."""
    events = []
    real_fsync, real_link = os.fsync, os.link

    def note(kind: str, path: str) -> None:  # this test's files only: os is the test process's, other threads use it
        if path.startswith(str(tmp_path)):
            events.append((kind, path))

    monkeypatch.setattr(os, "fsync", lambda fd: (note("fsync", os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "link", lambda src, dst: (note("link", dst), real_link(src, dst)))
    store = SnapshotStore(str(tmp_path / "snaps"))
    save(store, 10)
    folder = str(tmp_path / "snaps" / "step-000000010")
    link = events.index(("link", f"{folder}/manifest.json"))
    synced = [path for kind, path in events[:link] if kind == "fsync"]
    for name in ("model.pt", "optimizer.pt", "tokenizer.json"):
        assert f"{folder}/{name}" in synced
    assert synced.index(folder) > max(synced.index(f"{folder}/{n}") for n in ("model.pt", "optimizer.pt"))
    assert re.fullmatch(rf"{folder}/\.manifest\.json\.tmp-\w+", synced[-1])  # the manifest's own bytes
    assert ("fsync", folder) in events[link:]  # and the link itself


def test_payloads_and_manifests_are_created_exclusively(store_url):
    """A writer that lost the run mid-save must not overwrite what the new holder wrote."""
    from mingpt.storage import create_exclusive, open_exclusive

    store = SnapshotStore(store_url)
    save(store, 10)
    folder = f"{store.path}/step-000000010"
    with pytest.raises(FileExistsError):
        with open_exclusive(store.fs, f"{folder}/model.pt") as f:
            f.write(b"someone else's bytes")
    with pytest.raises(FileExistsError):
        create_exclusive(store.fs, f"{folder}/manifest.json", b"{}")
    store.latest().verify()  # untouched
