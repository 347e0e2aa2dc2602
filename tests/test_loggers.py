"""trainer.loggers: TensorBoard and W&B (offline) across a killed and restarted job, and start-up errors."""

import importlib
import json
import os
import re
import signal
import struct
import sys
from pathlib import Path

import pytest

from launch import MAIN, SMALL, children, latest_step, metrics, run, standalone, train_here, wait_for
from mingpt.cli import plot as plot_command
from mingpt.metrics import loggers
from mingpt.rundir import RunDir
from mingpt.training.config import Config, TrainerConfig, validate
from mingpt.errors import ConfigError

ENDLESS_STEPS = 100_000_000


def overrides(tmp_path, steps, names, extra=()):
    return [*SMALL, f"trainer.max_steps={steps}", "snapshot.every=20", f"snapshot.dir={tmp_path / 'snap'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", f"trainer.loggers=[{','.join(names)}]", *extra]


def logged_steps(snap) -> list[int]:
    return [m["step"] for m in metrics(snap) if "train_loss" in m]


def kill_with_unsnapshotted_steps(procs, tmp_path, names, machine_dies: bool) -> tuple[int, int]:
    """Train in one process and SIGKILL it while it has logged steps after its newest snapshot: with
    everything it started (W&B's service) where the machine dies, else alone, as when the OOM killer picks
    it. The restart then trains those steps again. Returns (the newest snapshot's step, the last step logged).

    The job is frozen (SIGSTOP) before its files are read, so what they show is what it has when it dies."""
    snap = tmp_path / "snap"
    job = procs.start([sys.executable, MAIN, *overrides(tmp_path, ENDLESS_STEPS, names)], "first")
    wait_for(lambda: latest_step(snap) >= 20, 120, "the first snapshots", [job])
    helpers = children(job.pid)

    def frozen_ahead() -> bool:
        """Freeze the job (its snapshot thread too); true if it has logged steps after its newest snapshot,
        else let it go on."""
        os.kill(job.pid, signal.SIGSTOP)
        if 0 < max(logged_steps(snap), default=0) - latest_step(snap):
            return True
        os.kill(job.pid, signal.SIGCONT)
        return False

    wait_for(frozen_ahead, 120, "steps logged after a snapshot", [job])
    os.killpg(job.pid, signal.SIGKILL) if machine_dies else os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in helpers), 60, "its helpers to exit")
    resumed, last = latest_step(snap), max(logged_steps(snap))
    assert resumed < last, (resumed, last)
    return resumed, last


def test_tensorboard_continues_across_a_kill_and_a_world_size_change(tmp_path, procs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    names = ["jsonl", "tensorboard"]
    resumed, last = kill_with_unsnapshotted_steps(procs, tmp_path, names, machine_dies=True)
    folder = str(tmp_path / "snap" / "tensorboard")
    killed = EventAccumulator(folder, size_guidance={"scalars": 0}, purge_orphaned_data=False)
    killed.Reload()
    tb_last = max(e.step for e in killed.Scalars("loss/train"))
    # metrics.jsonl is written after TensorBoard: a kill between the two leaves it a step behind, never ahead.
    assert tb_last in (last, last + 5), (tb_last, last)
    final = last + 10
    # The same snapshot.dir, now with two processes: a restart and a world-size change.
    run(procs, standalone(2), overrides(tmp_path, final, names), "again")

    seen = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    seen.Reload()
    steps = [e.step for e in seen.Scalars("loss/train")]
    assert steps == list(range(5, final + 1, 5))  # every logged step once, in order, to the end
    # The steps trained again were written twice; TensorBoard shows the second time only, as metrics.jsonl's
    # last record of a step counts.
    raw = EventAccumulator(folder, size_guidance={"scalars": 0}, purge_orphaned_data=False)
    raw.Reload()
    written = [e.step for e in raw.Scalars("loss/train")]
    assert sorted(s for s in set(written) if written.count(s) == 2) == list(range(resumed + 5, tb_last + 1, 5))
    latest = {m["step"]: m["train_loss"] for m in metrics(tmp_path / "snap") if "train_loss" in m}
    assert [e.value for e in seen.Scalars("loss/train")] == pytest.approx([latest[s] for s in steps], rel=1e-6)
    sizes = {e.step: e.value for e in seen.Scalars("perf/world_size")}
    assert sizes[resumed] == 1 and sizes[resumed + 5] == 2 and sizes[final] == 2  # trained again by two

    texts = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in seen.Tensors(tag)]
             for tag in seen.Tags()["tensors"]}
    assert texts["events/restart/text_summary"] == [(resumed, f"resumed from step {resumed} with 2 process(es)")]
    assert texts["events/world_size_change/text_summary"] == [(resumed, f"1 -> 2 processes at step {resumed}")]


@pytest.mark.slow
def test_wandb_offline_run_resumes_with_the_same_id(tmp_path, procs, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the processes inherit it: nothing goes to the network
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    names = ["jsonl", "wandb"]
    snap, state_file = tmp_path / "snap", tmp_path / "snap" / "wandb_run.json"
    job = procs.start([sys.executable, MAIN, *overrides(tmp_path, ENDLESS_STEPS, names)], "first")
    wait_for(lambda: latest_step(snap) >= 40, 120, "the step-40 snapshot", [job])
    job.send_signal(signal.SIGTERM)  # stops with a snapshot; W&B finishes its run
    assert job.wait(timeout=60) == 0
    stopped = latest_step(snap)
    before = json.loads(state_file.read_text())
    assert before["last_step"] == stopped
    # The newest snapshot damaged: the restart falls back to the one before and trains steps W&B has again.
    (snap / f"step-{stopped:09d}" / "model.pt").write_bytes(b"damaged")
    final = stopped + 10
    text = run(procs, [sys.executable, MAIN], overrides(tmp_path, final, names), "again")
    resumed = int(re.search(r"resumed from \S+: step (\d+)", text)[1])
    assert resumed < stopped

    after = json.loads(state_file.read_text())
    assert after == {"run_id": before["run_id"], "last_step": final, "restarts": 1}
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{before['run_id']}") for r in runs), runs
    first, second = (wandb_records(r / f"run-{before['run_id']}.wandb") for r in runs)
    assert {r.run.run_id for r in first + second if r.WhichOneof("record_type") == "run"} == {before["run_id"]}
    # Each step once: the second process logs only the steps after the first one's last.
    logged = lambda last: sorted({*range(5, last + 1, 5), last})  # every log_every steps, and where it stopped
    assert history_steps(first) == logged(stopped)
    assert history_steps(second) == [s for s in logged(final) if s > stopped]
    assert ("restarts", "1") in summary_items(second)


def test_unknown_and_repeated_loggers_are_config_errors():
    with pytest.raises(ConfigError, match="unknown logger 'tensorbord'; choose from jsonl, tensorboard, wandb"):
        validate(Config(trainer=TrainerConfig(loggers=["jsonl", "tensorbord"])))
    with pytest.raises(ConfigError, match="names jsonl twice"):
        validate(Config(trainer=TrainerConfig(loggers=["jsonl", "jsonl"])))
    validate(Config(trainer=TrainerConfig(loggers=[])))  # no metrics at all is a choice


def test_a_logger_not_installed_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r'the wandb package is not installed: pip install -e "\.\[wandb\]"'):
        validate(Config(trainer=TrainerConfig(loggers=["jsonl", "wandb"])))
    validate(Config(trainer=TrainerConfig(loggers=["jsonl", "tensorboard"])))


def test_a_logger_that_cannot_be_imported_at_start_is_a_config_error(monkeypatch, tmp_path):
    real = importlib.import_module

    def failing(name, *args):
        if name == "tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[tensorboard\]"'):
        loggers.TensorBoardLogger(RunDir(str(tmp_path)), {}).start(0)


def test_tensorboard_for_a_snapshot_dir_in_s3_writes_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = RunDir("s3://bucket/runs/a")
    logger = loggers.TensorBoardLogger(store, {})
    assert logger.folder == str(tmp_path / "tensorboard" / "bucket" / "runs" / "a")
    logger.start(0)
    logger.log(5, {"train_loss": 2.0, "mfu": float("nan")})
    logger.close()
    assert list((tmp_path / "tensorboard" / "bucket" / "runs" / "a").glob("events.out.tfevents.*"))


def test_metrics_jsonl_is_written_after_the_other_loggers(tmp_path):
    """A process killed between two loggers leaves metrics.jsonl behind the others, never ahead of them."""
    fan_out = loggers.Loggers(["jsonl", "tensorboard"], RunDir(str(tmp_path)), {}, leader=True)
    assert [type(logger) for logger in fan_out.loggers] == [loggers.TensorBoardLogger, loggers.JsonlLogger]


def test_a_logger_that_fails_while_training_is_dropped_with_one_warning(caplog):
    class Broken(loggers.Logger):
        def log(self, step, record):
            raise OSError("disk full")

    kept = []

    class Kept(loggers.Logger):
        def log(self, step, record):
            kept.append(step)

    fan_out = loggers.Loggers([], None, {}, leader=True)
    fan_out.loggers = [Broken(), Kept()]
    for step in (5, 10):
        fan_out.log(step, {"train_loss": 1.0})
    assert kept == [5, 10]
    assert [r.getMessage() for r in caplog.records] == [
        "Broken failed (OSError: disk full); it logs nothing more in this process"]


# -- reading W&B's offline run files ------------------------------------------------------------------
# A .wandb file is a 7-byte header (":W&B", 2 magic bytes, a version) and then LevelDB's log format:
# 32 KiB blocks of chunks (crc32 4 bytes, length 2, type 1: full, first, middle, last), each record a
# wandb_internal_pb2.Record. W&B ships no Python reader for it any more.

BLOCK = 32 * 1024


def wandb_records(path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4) and pos <= len(data):  # a whole record (a killed writer may leave half of one)
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        elif kind == 0:
            pending = b""
    return records


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # a name with a slash is stored as its parts


def history_steps(records) -> list[int]:
    steps = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item_key(item): item.value_json for item in record.history.item}
            if "loss/train" in items:
                steps.append(int(items["_step"]))
    return steps


def summary_items(records) -> list[tuple[str, str]]:
    return [(item_key(item), item.value_json) for record in records if record.WhichOneof("record_type") == "summary"
            for item in record.summary.update]


def test_a_fifo_in_place_of_metrics_jsonl_neither_blocks_nor_stops_the_run(tmp_path, caplog, capsys):
    """Opening a FIFO for appending blocks until a reader comes, which none ever does: the logger is
    dropped with a warning instead, training finishes, and mingpt-plot says what is wrong."""
    (tmp_path / "snap").mkdir()
    os.mkfifo(tmp_path / "snap" / "metrics.jsonl")
    log = train_here(tmp_path, "trainer.max_steps=10")
    assert "done: step 10" in log
    assert re.search(r"JsonlLogger failed .*metrics.jsonl is not a regular file \(other\)", caplog.text)
    assert plot_command.main([str(tmp_path / "snap"), "--out", str(tmp_path / "plot.png")]) == 2
    assert "metrics.jsonl is not a regular file" in capsys.readouterr().err
