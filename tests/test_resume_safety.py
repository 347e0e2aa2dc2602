"""The trainer and the sample command, run as users run them, against damaged snapshots and
changed settings: they fall back, replace what is damaged, keep what is good, and say so."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from launch import MAIN, SMALL, env, manifests


def app(tmp_path, *overrides, timeout=180):
    args = [sys.executable, MAIN, *SMALL, "snapshot.every=10", f"snapshot.dir={tmp_path / 'snap'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", *overrides]
    result = subprocess.run(args, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def verify(folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mingpt.cli.snapshot", "verify", str(folder)],
                          capture_output=True, text=True, timeout=120)


def test_a_newest_manifest_naming_a_file_outside_its_folder_is_skipped_and_replaced(tmp_path):
    assert app(tmp_path, "trainer.max_steps=20").returncode == 0
    manifest_path = tmp_path / "snap" / "step-000000020" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["../../../../etc/passwd"] = {"bytes": 1, "sha256": "00"}
    manifest_path.write_text(json.dumps(manifest))

    sampled = subprocess.run([sys.executable, "-m", "mingpt.cli.sample", str(tmp_path / "snap"), "--max-new-tokens", "5"],
                             capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0 and "step 10)" in sampled.stderr, sampled.stderr
    assert "passwd" in sampled.stderr and "never hold" in sampled.stderr  # the reason, in one warning
    listed = verify(tmp_path / "snap")
    assert listed.returncode == 1 and "passwd" in listed.stdout

    result = app(tmp_path, "trainer.max_steps=30")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step-000000020 is damaged" in result.stderr and "resumed from" in result.stderr
    assert "step-000000010: step 10" in result.stderr
    assert verify(tmp_path / "snap").returncode == 0  # step 20 committed anew, the damaged one gone
    assert [m["step"] for m in manifests(tmp_path / "snap")] == [10, 20, 30]


def test_training_over_damaged_snapshots_ends_with_a_verified_one(tmp_path):
    """The issue's repro: truncate every model.pt, train on with keep=2."""
    assert app(tmp_path, "trainer.max_steps=30", "snapshot.keep=2").returncode == 0
    for path in (tmp_path / "snap").glob("step-*/model.pt"):
        with open(path, "r+b") as f:
            f.truncate(1000)
    result = app(tmp_path, "trainer.max_steps=30", "snapshot.keep=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: step 30" in result.stderr and "resumed" not in result.stderr  # nothing loadable: from scratch
    listed = verify(tmp_path / "snap")
    assert listed.returncode == 0, listed.stdout
    rows = [line for line in listed.stdout.splitlines() if line.startswith("step-")]
    assert len(rows) == 2 and all("verified" in row for row in rows)


def test_changed_optimizer_settings_apply_on_resume_and_are_logged(tmp_path):
    assert app(tmp_path, "trainer.max_steps=10", "trainer.beta2=0.99", "trainer.weight_decay=0.1").returncode == 0
    result = app(tmp_path, "trainer.max_steps=20", "trainer.beta2=0.95", "trainer.weight_decay=0.01")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer betas: (0.9, 0.99) in the snapshot, (0.9, 0.95) in the config: using the config" in result.stderr
    assert "optimizer weight_decay: 0.1 in the snapshot, 0.01 in the config" in result.stderr
    assert "trainer.beta2: 0.99 -> 0.95" in result.stderr  # the settings diff
    saved = torch.load(tmp_path / "snap" / "step-000000020" / "optimizer.pt", weights_only=True)
    decay, no_decay = saved["param_groups"]
    assert decay["betas"] == no_decay["betas"] == (0.9, 0.95)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("override", ["snapshot.dir=foo://bucket/run", "snapshot.lease_timeout_s=0"])
def test_bad_snapshot_settings_are_one_line_errors(tmp_path, override):
    result = app(tmp_path, "trainer.max_steps=5", override, timeout=120)
    assert result.returncode == 2
    key = override.split("=")[0]
    assert key in result.stderr or "foo" in result.stderr


def test_the_fp16_loss_scale_is_saved_and_restored(tmp_path, corpus_file, monkeypatch):
    """fp16 needs a GPU; the GradScaler's state handling is the same on the CPU, so run it there."""
    from contextlib import nullcontext

    import mingpt.training.trainer as trainer_module
    from mingpt.training.config import Config
    from mingpt.data.prepared import PreparedData
    from mingpt.data.prepare import PrepareConfig, prepare
    from mingpt.training.distributed import World
    from mingpt.checkpoint.store import SnapshotStore

    cfg = Config()
    cfg.model.name, cfg.data.block_size, cfg.seed = "gpt-nano", 16, 1
    cfg.trainer.max_steps, cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size = 3, 4, 4
    cfg.trainer.eval_every, cfg.trainer.eval_samples = 0, 4
    cfg.snapshot.async_save = False
    data = PreparedData(prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prepared")))
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    store = SnapshotStore(str(tmp_path / "snap"))

    def make(init_scale: float):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        monkeypatch.setattr(trainer_module, "autocast_for", lambda precision, device: (nullcontext(), scaler))
        return trainer_module.Trainer(cfg, world, store, data, cfg.model.build(data.vocab_size, 16))

    make(init_scale=37.0).run(trainer_module.StopFlag())
    assert "scaler.pt" in store.latest().manifest["files"]
    resumed = make(init_scale=65536.0)
    resumed.resume()
    assert resumed.replica.state.step == 3 and resumed.replica.scaler.get_scale() == 37.0


def test_ctrl_c_while_sampling_ends_with_one_line(tmp_path):
    assert app(tmp_path, "trainer.max_steps=5").returncode == 0
    # Endless: a sample ends early where the model writes end-of-text, so ask for endlessly many samples.
    sampling = subprocess.Popen([sys.executable, "-m", "mingpt.cli.sample", str(tmp_path / "snap"), "--prompt", "a",
                                 "--max-new-tokens", "1000", "--num-samples", "100000000"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env())
    try:
        assert sampling.stdout.read(20)  # text is streaming
        sampling.send_signal(signal.SIGINT)
        _, err = sampling.communicate(timeout=60)
    finally:
        sampling.kill()
    assert sampling.returncode == 130 and "interrupted" in err.decode() and "Traceback" not in err.decode()


def test_a_snapshot_from_before_end_of_text_tokens_is_explained(tmp_path):
    """A run made by an older version: its tokenizer has no end-of-text id, its model one id fewer."""
    import hashlib

    assert app(tmp_path, "trainer.max_steps=10").returncode == 0
    folder = tmp_path / "snap" / "step-000000010"
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    del tokenizer["eot"]
    data = json.dumps(tokenizer).encode()
    (folder / "tokenizer.json").write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    result = app(tmp_path, "trainer.max_steps=20")
    assert result.returncode == 2
    assert "made before tokenizers reserved an end-of-text token" in result.stderr and "mingpt-sample" in result.stderr
