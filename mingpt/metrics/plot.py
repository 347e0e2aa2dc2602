"""A run's loss from its metrics.jsonl, as a picture (`mingpt-plot`): losses and tokens/s against step, a line at each
restart or world-size change; below, where recorded, HellaSwag's acc_norm against GPT-2 124M's, and each process's own
time per step (mingpt.training.stragglers), so that a slow one stands out. Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from mingpt.errors import MinGPTError
from mingpt.rundir import RunDir
from mingpt.storage import check_regular_file, explain_storage_error, parse_json


@dataclass
class Mark:
    step: int
    text: str
    kind: str  # "restart" or "world_size_change"


@dataclass
class Curves:
    """What the picture shows. A step logged twice (trained again after a restart) keeps its last record."""

    train_loss: dict[int, float] = field(default_factory=dict)
    val_loss: dict[int, float] = field(default_factory=dict)
    tokens_per_s: dict[int, float] = field(default_factory=dict)
    hellaswag: dict[int, float] = field(default_factory=dict)  # acc_norm
    marks: list[Mark] = field(default_factory=list)
    own_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # process -> step -> its own ms a step


def read_records(run: str) -> list[dict]:
    """The records of RUN/metrics.jsonl in file order, skipping a line cut short (a process killed while writing it)."""
    folder = RunDir(run)
    url = folder.url_of(RunDir.METRICS)
    try:
        check_regular_file(folder.fs, folder.metrics)
        text = folder.fs.cat_file(folder.metrics).decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise MinGPTError(f"{url} does not exist: RUN must be a snapshot.dir that a job with "
                          "jsonl in trainer.loggers (the default) has trained into") from None
    except Exception as e:
        raise MinGPTError(f"cannot read {url}: {explain_storage_error(e, setting='RUN')}") from None
    records = []
    for line in text.splitlines():
        try:
            record = parse_json(line)
        except ValueError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= LARGEST:
            records.append(record)
    return records


LARGEST = 1e15  # what no step, loss, rate or time of a run reaches: a larger number is not one a run wrote


def _number(value) -> float | None:
    """`value` where it is a finite number a run could have written (no bool, NaN or absurd size), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and abs(value) <= LARGEST else None


def curves(records: list[dict]) -> Curves:
    result = Curves()
    for record in records:  # in file order, so a later record of a step replaces an earlier one
        for key, curve in (("train_loss", result.train_loss), ("val_loss", result.val_loss),
                           ("tokens_per_s", result.tokens_per_s), ("hellaswag_acc_norm", result.hellaswag)):
            if _number(record.get(key)) is not None:
                curve[record["step"]] = float(record[key])
        times = record.get("process_times")
        for process in times if isinstance(times, list) else []:
            parts = [_number(process.get(part)) for part in ("data_ms", "compute_ms")] if isinstance(process, dict) \
                else [None]
            if None not in parts and "process" in process:  # else not a record this version wrote
                result.own_ms.setdefault(str(process["process"]), {})[record["step"]] = sum(parts)
    result.marks = find_marks(records)
    return result


def find_marks(records: list[dict]) -> list[Mark]:
    """Restarts and world-size changes, seen in the progress records (those with a train loss): a step that does not
    move forward (resumed from an older snapshot), a record off the usual stride (a process logs where it stops), or a
    pause the throughput does not account for (labelled with its length). Each is drawn where training went on from."""
    progress = [r for r in records if "train_loss" in r]
    steps = [r["step"] for r in progress]
    strides = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    stride = statistics.mode(strides) if strides else 0
    per_step = _tokens_per_step(progress)
    marks = []
    for before, after in zip(progress, progress[1:]):
        at = min(before["step"], after["step"])
        pause = _unexplained_pause(before, after, per_step)
        if after["step"] <= before["step"] or (stride and before["step"] % stride != 0):
            marks.append(Mark(at, text="restart", kind="restart"))
        elif pause:
            marks.append(Mark(at, text=f"{pause:.0f} s pause", kind="restart"))
        old, new = before.get("world_size"), after.get("world_size")
        if old is not None and new is not None and old != new:
            marks.append(Mark(at, text=f"{old} -> {new} processes", kind="world_size_change"))
    return marks


def _tokens_per_step(progress: list[dict]) -> float | None:
    """Tokens one step trains: the median (unmoved by restarts) of tokens/s times each record's time less `other_s`."""
    estimates = [(b["time"] - a["time"] - _other(b)) * b["tokens_per_s"] / (b["step"] - a["step"])
                 for a, b in zip(progress, progress[1:]) if b["step"] > a["step"] and _timed(a, b)]
    return statistics.median(estimates) if estimates else None


def _unexplained_pause(before: dict, after: dict, per_step: float | None) -> float:
    """Seconds between two records that training at the later one's rate does not explain (slowness does), else 0."""
    if per_step is None or after["step"] <= before["step"] or not _timed(before, after):
        return 0.0
    elapsed = after["time"] - before["time"]
    training = (after["step"] - before["step"]) * per_step / after["tokens_per_s"] + _other(after)
    return elapsed - training if elapsed > 1.5 * training and elapsed - training > 1.0 else 0.0


def _other(record: dict) -> float:
    """Seconds of evaluation and snapshots that a record's tokens/s leaves out."""
    other = _number(record.get("other_s"))
    return other if other is not None and other >= 0 else 0.0


def _timed(a: dict, b: dict) -> bool:
    numbers = [_number(x) for x in (a.get("time"), b.get("time"), b.get("tokens_per_s"))]
    return None not in numbers and numbers[2] > 0


LABEL_GAP = 0.025  # of the steps drawn: a label's width, at the picture's size and font


def pyplot():
    """matplotlib.pyplot, drawing to files only (no display needed); ImportError if not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def draw(data: Curves, title: str, out: str, plt) -> None:
    """Write the picture to `out` (PNG, or any format matplotlib knows by the name's ending) with `plt` (pyplot)."""
    fig = figure(data, title, plt)
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)


def figure(data: Curves, title: str, plt):
    """The picture the module docstring describes."""
    from matplotlib.ticker import MaxNLocator

    ratios = [3] + [1.6] * bool(data.hellaswag) + [1.3] * bool(data.own_ms)
    fig, axes = plt.subplots(len(ratios), 1, figsize=(8, 4.5 + 1.5 * sum(ratios[1:])), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": ratios})
    loss_axis, *below = axes[:, 0]
    if data.hellaswag:
        _draw_hellaswag(below.pop(0), data.hellaswag)
    if data.own_ms:
        _draw_processes(below.pop(0), data.own_ms)
    rate_axis = loss_axis.twinx()
    if data.tokens_per_s:
        steps = sorted(data.tokens_per_s)
        rate_axis.plot(steps, [data.tokens_per_s[s] for s in steps], color="0.6", lw=0.8, label="tokens/s")
        rate_axis.set_ylim(bottom=0, top=1.15 * max(data.tokens_per_s.values()))
    rate_axis.set_ylabel("tokens/s")
    loss_axis.set_zorder(rate_axis.get_zorder() + 1)  # losses drawn over the throughput
    loss_axis.patch.set_visible(False)
    for name, points, style in (("train loss", data.train_loss, "-"), ("val loss", data.val_loss, "o-")):
        if points:
            steps = sorted(points)
            loss_axis.plot(steps, [points[s] for s in steps], style, lw=1.2, ms=3, label=name)
    _draw_marks(loss_axis, data)
    loss_axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: never 2.5
    axes[-1, 0].set_xlabel("step")
    loss_axis.set_ylabel("loss")
    loss_axis.set_title(title, fontsize=10)
    loss_axis.grid(alpha=0.3)
    lines, labels = [], []
    for axis in (loss_axis, rate_axis):
        more_lines, more_labels = axis.get_legend_handles_labels()
        lines, labels = lines + more_lines, labels + more_labels
    loss_axis.legend(lines, labels, loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def _draw_marks(axis, data: Curves) -> None:
    """A line at each mark; one label (saying how many more it stands for) per LABEL_GAP, so that none overlap."""
    at_step: dict[int, list] = {}  # a restart and a world-size change at one step share a line and a label
    for mark in data.marks:
        at_step.setdefault(mark.step, []).append(mark)
    drawn = [*data.train_loss, *data.val_loss, *at_step] or [0]
    gap = LABEL_GAP * max(max(drawn) - min(drawn), 1)
    steps = sorted(at_step)
    color = {step: "tab:red" if any(mark.kind == "restart" for mark in at_step[step]) else "tab:purple"
             for step in steps}
    for step in steps:
        axis.axvline(step, color=color[step], ls="--" if color[step] == "tab:red" else ":", lw=1)
    labelled = None
    for step in steps:
        if labelled is not None and step - labelled < gap:
            continue
        labelled = step
        near = sum(1 for other in steps if step < other < step + gap)
        text = ", ".join(mark.text for mark in at_step[step]) + (f" (+{near} more)" if near else "")
        axis.annotate(" " + text, (step, 0.98), rotation=90, va="top", xycoords=("data", "axes fraction"),
                      fontsize=7, color=color[step])


# GPT-2 124M's HellaSwag acc_norm under lm-evaluation-harness (as llm.c quotes it): recipe gpt2-fineweb-edu's target.
GPT2_124M_ACC_NORM = 0.3114


def _draw_hellaswag(axis, acc_norm: dict[int, float]) -> None:
    steps = sorted(acc_norm)
    axis.plot(steps, [acc_norm[s] for s in steps], "o-", color="tab:green", lw=1.2, ms=3, label="hellaswag acc_norm")
    axis.axhline(GPT2_124M_ACC_NORM, color="0.4", ls="--", lw=1, label=f"GPT-2 124M ({GPT2_124M_ACC_NORM:.4f})")
    axis.set_ylabel("hellaswag")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right", fontsize=7)


def _draw_processes(axis, own_ms: dict[str, dict[int, float]]) -> None:
    """Each process's own time a step (data and computing), a line per process: a straggler lies above."""
    for process in sorted(own_ms):
        steps = sorted(own_ms[process])
        axis.plot(steps, [own_ms[process][s] for s in steps], lw=0.9, label=process)
    axis.set_ylim(bottom=0)
    axis.set_ylabel("own ms a step")
    axis.grid(alpha=0.3)
    if len(own_ms) <= 8:
        axis.legend(loc="upper right", fontsize=7)
