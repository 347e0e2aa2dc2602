"""mingpt-plot: reading metrics.jsonl (the last record of a step wins, restarts found) and drawing it."""

import builtins
import json
import subprocess

import pytest

from launch import BIN, train_here
from mingpt.cli import plot as plot_command
from mingpt.metrics import plot

PNG = b"\x89PNG\r\n\x1a\n"


def progress(step, time, loss=3.0, world_size=1, rate=1000.0):
    """A progress record; 10 steps of 100 tokens take 1 s at the default rate."""
    return {"time": time, "step": step, "train_loss": loss, "lr": 1e-3, "tokens_per_s": rate,
            "world_size": world_size}


def write_metrics(folder, records, tail=""):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return folder


def test_the_last_record_of_a_step_wins_and_a_cut_line_is_skipped(tmp_path):
    records = [progress(10, 1.0, 2.5), progress(20, 2.0, 2.4), {"time": 2.1, "step": 20, "val_loss": 2.6},
               progress(30, 3.0, 2.3),
               # killed after step 30, resumed from the step-20 snapshot: steps 30 and 40 by the new process
               progress(30, 20.0, 2.2), progress(40, 21.0, 2.1), {"time": 21.1, "step": 40, "val_loss": 2.0}]
    run_dir = write_metrics(tmp_path / "run", records, tail='{"time": 22.0, "step": 50, "train_lo')
    data = plot.curves(plot.read_records(str(run_dir)))
    assert data.train_loss == {10: 2.5, 20: 2.4, 30: 2.2, 40: 2.1}
    assert data.val_loss == {20: 2.6, 40: 2.0}
    assert [(m.step, m.kind) for m in data.marks] == [(30, "restart")]


def test_restarts_and_world_size_changes_are_found():
    records = [progress(s, s / 10) for s in (10, 20, 30)]
    records += [progress(33, 3.3)]  # SIGTERM: the process stops at step 33 ...
    records += [progress(s, 10 + s / 10, world_size=2) for s in (40, 50)]  # ... and two processes go on
    records += [{"time": 15.05, "step": 50, "val_loss": 2.0}]  # an evaluation is no restart
    records += [progress(60, 30.0, world_size=2)]  # stopped at a multiple of log_every: only the pause tells
    records += [progress(70, 31.0, world_size=2), progress(80, 32.0, world_size=2)]
    marks = [(m.step, m.kind, m.text) for m in plot.find_marks(records)]
    assert marks == [(33, "restart", "restart"), (33, "world_size_change", "1 -> 2 processes"),
                     (50, "restart", "14 s pause")]


def test_an_uninterrupted_run_has_no_marks():
    records = [progress(s, s / 10 + (0.3 if s > 50 else 0)) for s in range(10, 110, 10)]  # an evaluation
    # The machine 20 times slower for a while (another job): a long interval, but a rate as low.
    records += [progress(110, 31.0, rate=50.0), progress(120, 51.0, rate=50.0), progress(130, 52.0)]
    assert plot.find_marks(records) == []


def test_missing_matplotlib_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    run_dir = write_metrics(tmp_path / "run", [progress(10, 1.0)])
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert plot_command.main([str(run_dir), "-o", str(tmp_path / "loss.png")]) == 2
    err = capsys.readouterr().err
    assert err == 'error: mingpt-plot needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)\n'
    assert not (tmp_path / "loss.png").exists()


def test_a_folder_without_metrics_is_an_error(tmp_path, capsys):
    assert plot_command.main([str(tmp_path / "nothing"), "-o", str(tmp_path / "loss.png")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("output", ["loss.txt", "noext", "folder"])
def test_an_output_that_is_no_picture_name_is_one_line(tmp_path, capsys, output):
    """matplotlib refused .txt with a traceback, and wrote noext.png or folder.png where the user named another."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 4.0}) + "\n")
    assert plot_command.main([str(tmp_path), "-o", str(tmp_path / output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"-o {tmp_path / output}: give a file name ending in .png" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "metrics.jsonl"]


def test_plot_reads_a_run_in_s3(tmp_path, s3, capsys):
    import boto3

    lines = "".join(json.dumps(progress(s, s / 10)) + "\n" for s in (10, 20, 30)).encode()
    boto3.client("s3", endpoint_url=s3.endpoint).put_object(Bucket=s3.bucket, Key="run/metrics.jsonl", Body=lines)
    out = tmp_path / "s3.png"
    assert plot_command.main([f"s3://{s3.bucket}/run", "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG)


@pytest.mark.multiproc
def test_mingpt_plot_draws_a_restarted_run(tmp_path):
    """A real run that stopped off its logging stride (as a stop request makes it) and was resumed, then the
    command as a user types it."""
    snap = tmp_path / "snap"
    args = ["trainer.eval_every=20", "snapshot.every=20"]
    stopped = 23
    train_here(tmp_path, *args, f"trainer.max_steps={stopped}")
    train_here(tmp_path, *args, f"trainer.max_steps={stopped + 30}")

    data = plot.curves(plot.read_records(str(snap)))
    assert [m.kind for m in data.marks] == ["restart"] and data.marks[0].step == stopped
    assert max(data.train_loss) == stopped + 30 and data.val_loss
    done = subprocess.run([str(BIN / "mingpt-plot"), str(snap)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path / 'loss.png'}\n"
    picture = (tmp_path / "loss.png").read_bytes()
    assert picture.startswith(PNG) and len(picture) > 10_000


def test_each_processs_own_time_is_read_and_drawn_below(tmp_path):
    times = lambda step, slow: {"step": step, "process_times": [
        {"process": "a pid 1", "data_ms": 1.0, "compute_ms": 20.0, "sync_ms": 30.0},
        {"process": "b pid 2", "data_ms": 1.0, "compute_ms": slow, "sync_ms": 10.0}]}
    records = [{"step": 20, "train_loss": 3.0}, times(20, 20.0), times(40, 45.0), {"step": 60, "process_times": "?"}]
    data = plot.curves(records)
    assert data.own_ms == {"a pid 1": {20: 21.0, 40: 21.0}, "b pid 2": {20: 21.0, 40: 46.0}}
    plot.draw(data, "run", str(tmp_path / "loss.png"), plot.pyplot())
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG)


def test_steps_are_whole_numbers_close_marks_share_a_label_and_the_output_folder_is_made(tmp_path, capsys):
    short = plot.curves([progress(1, 1.0), progress(2, 2.0), progress(3, 3.0)])
    fig = plot.figure(short, "run", plot.pyplot())
    ticks = fig.axes[0].get_xticks()
    assert len(ticks) and all(float(tick).is_integer() for tick in ticks)  # 1, 2, 3: never 1.5
    # Five restarts within 10 of 1000 steps, then one far away: two labels, the first standing for five.
    marks = [plot.Mark(step, "restart", "restart") for step in (500, 502, 504, 506, 508, 900)]
    data = plot.Curves(train_loss={10 * i: 3.0 for i in range(1, 101)}, marks=marks)
    texts = [t.get_text().strip() for t in plot.figure(data, "run", plot.pyplot()).axes[0].texts]
    assert texts == ["restart (+4 more)", "restart"]
    run = write_metrics(tmp_path / "run", [progress(10 * i, float(i)) for i in range(1, 101)])
    assert plot_command.main([str(run), "-o", str(tmp_path / "new" / "folder" / "loss.png")]) == 0
    assert (tmp_path / "new" / "folder" / "loss.png").read_bytes().startswith(PNG)


def test_non_finite_and_absurd_numbers_are_not_drawn_and_the_rest_is(tmp_path, capsys):
    """Infinity and NaN (which Python's json reads), 1e400, absurd sizes and the wrong types in any field
    leave their point out; the rest of the run is drawn."""
    lines = [json.dumps(progress(10 * i, float(i))) for i in range(1, 11)] + [
        '{"time": 11.0, "step": 110, "train_loss": 2.9, "tokens_per_s": Infinity, "world_size": 1}',
        '{"time": NaN, "step": 120, "train_loss": NaN, "tokens_per_s": -Infinity, "world_size": 1}',
        '{"time": 13.0, "step": 130, "train_loss": 1e400, "val_loss": 1e300, "tokens_per_s": 1e308}',
        '{"time": 14.0, "step": 140, "train_loss": true, "other_s": Infinity, "tokens_per_s": 1000.0}',
        '{"time": 15.0, "step": 1e400, "train_loss": 2.5}',
        '{"time": 16.0, "step": 100000000000000000000000, "train_loss": 2.5}',
        '{"step": 150, "process_times": [{"process": "a", "data_ms": Infinity, "compute_ms": 1.0}, 7]}',
        '{"step": 160, "process_times": [{"process": "a", "data_ms": 1.0, "compute_ms": 2.0}]}',
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    data = plot.curves(plot.read_records(str(run)))
    assert sorted(data.train_loss) == [10 * i for i in range(1, 12)] and data.val_loss == {}
    assert sorted(data.tokens_per_s) == [10 * i for i in range(1, 11)] + [140]
    assert data.own_ms == {"a": {160: 3.0}}
    assert plot_command.main([str(run), "-o", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG)
