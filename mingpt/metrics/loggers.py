"""Where the trainer's metrics go: metrics.jsonl, TensorBoard, Weights & Biases (`trainer.loggers`); the leader logs.
A restarted job continues the same TensorBoard and W&B run; the steps it trains again after resuming from an older
snapshot are not logged twice (TensorBoard purges its events from that step on, W&B keeps the first ones)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import time
import uuid
from typing import Any, Sequence

from mingpt.errors import ConfigError
from mingpt.rundir import RunDir
from mingpt.storage import check_regular_file, parse_json, redact, replace_atomically

log = logging.getLogger(__name__)

# Logger name -> (the package it needs, the pip extra that installs it).
PACKAGES = {"jsonl": (None, None), "tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}

# Record keys -> dashboard names; the "loss/" and "perf/" prefixes make sections in both dashboards.
TAGS = {"train_loss": "loss/train", "val_loss": "loss/val", "lr": "lr", "tokens_per_s": "perf/tokens_per_s",
        "mfu": "perf/mfu", "peak_memory_mb": "perf/peak_memory_mb", "world_size": "perf/world_size",
        "hellaswag_acc": "eval/hellaswag_acc", "hellaswag_acc_norm": "eval/hellaswag_acc_norm",
        "hellaswag_examples": "eval/hellaswag_examples"}


def check_loggers(names: Sequence[str]) -> None:
    """ConfigError for an unknown or repeated name, or a missing package; cheap (no import), for config validation."""
    for name in names:
        if name not in PACKAGES:
            raise ConfigError(f"trainer.loggers: unknown logger {name!r}; choose from {', '.join(PACKAGES)}")
        if list(names).count(name) > 1:
            raise ConfigError(f"trainer.loggers names {name} twice; name each logger once")
        package, extra = PACKAGES[name]
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(_missing(name, package, extra))


def _missing(name: str, package: str, extra: str) -> str:
    return (f"trainer.loggers includes {name}, but the {package} package is not installed: "
            f"pip install -e \".[{extra}]\" (or pip install {package}), or remove {name} from trainer.loggers")


def _import(name: str) -> Any:
    """The package of logger `name`; ConfigError naming the extra if it cannot be imported."""
    package, extra = PACKAGES[name]
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ConfigError(f"{_missing(name, package, extra)} ({e})") from None


def _numbers(record: dict) -> dict[str, float]:
    """The record's finite numbers under their dashboard names (MFU is NaN where no peak is known)."""
    return {TAGS.get(key, key): float(value) for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class Logger:
    """The interface: `start` once resumed, `log` a record, `mark` an event ("restart", "world_size_change"), `flush`
    at every snapshot (what must survive a crash), `close` at the end; each does nothing unless a logger needs it."""

    def start(self, step: int) -> None:
        pass

    def log(self, step: int, record: dict) -> None:
        pass

    def mark(self, step: int, kind: str, text: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Loggers(Logger):
    """The loggers of `trainer.loggers`, called in turn. One that fails while training is dropped with a warning (a
    convenience must not stop a job); one failing to start (a W&B login missing) stops it before its first step."""

    def __init__(self, names: Sequence[str], run: RunDir, config: dict, leader: bool):
        check_loggers(names)
        makers = {"jsonl": JsonlLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}
        # metrics.jsonl last: killed between two loggers, it claims no step the others lack (restarts read it).
        ordered = sorted(names, key=lambda name: name == "jsonl")
        self.loggers: list[Logger] = [makers[name](run, config) for name in ordered] if leader else []

    def start(self, step: int) -> None:
        for logger in self.loggers:
            logger.start(step)

    def log(self, step: int, record: dict) -> None:
        self._each("log", step, record)

    def mark(self, step: int, kind: str, text: str) -> None:
        self._each("mark", step, kind, text)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args) -> None:
        for logger in list(self.loggers):
            try:
                getattr(logger, method)(*args)
            except Exception as e:
                log.warning("%s failed (%s: %s); it logs nothing more in this process",
                            type(logger).__name__, type(e).__name__, redact(e))
                self.loggers.remove(logger)


class JsonlLogger(Logger):
    """Appends one JSON line per record to metrics.jsonl beside the snapshots: to a local file at once; to an object
    store, which rewrites a file to append to it, in batches at each snapshot and at the end."""

    def __init__(self, run: RunDir, config: dict):
        self.path = run.metrics
        self.fs = run.fs
        self.batched = not run.local
        self.pending: list[str] = []

    def log(self, step: int, record: dict) -> None:
        self.pending.append(json.dumps({"time": round(time.time(), 3), "step": step, **record}) + "\n")
        if not self.batched:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        check_regular_file(self.fs, self.path)  # not a hiccup: the logger is dropped
        try:
            with self.fs.open(self.path, "a") as f:
                f.write("".join(self.pending))
            self.pending.clear()
        except Exception as e:  # metrics are a convenience; a storage hiccup must not stop training
            log.warning("could not append to %s: %s", redact(self.path), redact(e))

    def close(self) -> None:
        self.flush()


class TensorBoardLogger(Logger):
    """Event files in <snapshot.dir>/tensorboard/ (a local folder where it is not local). Each start's new event file
    first tells TensorBoard to drop the events from the resumed step on, so steps trained again appear once."""

    def __init__(self, run: RunDir, config: dict):
        self.folder = run.tensorboard()
        if not run.local:  # SummaryWriter appends to its file; object stores cannot append
            log.info("TensorBoard: %s is not a local folder; event files go to %s on this machine",
                     run.url, self.folder)
        self.writer = None

    def start(self, step: int) -> None:
        tensorboard = _import("tensorboard")  # a clear error if missing; SummaryWriter needs it
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.folder, purge_step=step + 1)
        log.info("TensorBoard %s: tensorboard --logdir %s", tensorboard.__version__, self.folder)

    def log(self, step: int, record: dict) -> None:
        for tag, value in _numbers(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a few hundred bytes: written now, so a killed process loses nothing

    def mark(self, step: int, kind: str, text: str) -> None:
        self.writer.add_text(f"events/{kind}", text, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbLogger(Logger):
    """One W&B run per snapshot.dir, whose wandb_run.json keeps its id, last step logged and event counts, so that a
    restarted job resumes it (offline too) and logs only later steps. The last step is recorded at snapshots only:
    W&B's service drops its buffer when the process dies, and steps recorded sooner would leave a gap."""

    def __init__(self, run: RunDir, config: dict):
        self.fs, self.path = run.fs, run.wandb_state
        self.name = run.url.rsplit("/", 1)[-1]
        self.config = config
        self.run = None
        self.state: dict = {}
        self.logged_before = -1  # the last step an earlier process logged
        self.dirty = False

    def start(self, step: int) -> None:
        wandb = _import("wandb")
        self.state = self._read_state() or {"run_id": uuid.uuid4().hex[:12], "last_step": -1}
        self.logged_before = self.state["last_step"]
        try:
            # WANDB_MODE=offline, WANDB_DIR, WANDB_ENTITY and the login are W&B's own settings.
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mingpt"), id=self.state["run_id"],
                                  resume="allow", name=self.name, config=self.config)
        except Exception as e:
            raise ConfigError(f"wandb.init failed ({type(e).__name__}: {redact(e)}); run `wandb login`, or set "
                              "WANDB_MODE=offline and `wandb sync` later") from None
        self._write_state()  # the id is known before the first step, so a crash cannot lose it
        log.info("W&B run %s (project %s, %s)", self.run.id, self.run.project, self.run.url or "offline")

    def log(self, step: int, record: dict) -> None:
        if step <= self.logged_before:
            return  # trained again after a restart: W&B has this step already
        self.run.log(_numbers(record), step=step)
        self.state["last_step"] = step
        self.dirty = True

    def mark(self, step: int, kind: str, text: str) -> None:
        count = self.state.get(f"{kind}s", 0) + 1
        self.state[f"{kind}s"] = count
        self.run.summary.update({f"{kind}s": count, f"last_{kind}": text, f"last_{kind}_step": step})
        self._write_state()

    def flush(self) -> None:
        if self.dirty:
            self._write_state()

    def close(self) -> None:
        if self.run is not None:
            self.flush()
            self.run.finish()
            self.run = None

    def _read_state(self) -> dict | None:
        try:
            check_regular_file(self.fs, self.path)
            state = parse_json(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("%s is damaged (%s): starting a new W&B run", redact(self.path), e)
            return None
        if isinstance(state, dict) and isinstance(state.get("run_id"), str) and isinstance(state.get("last_step"), int):
            return state
        log.warning("%s is not a W&B run record: starting a new W&B run", redact(self.path))
        return None

    def _write_state(self) -> None:
        replace_atomically(self.fs, self.path, json.dumps(self.state).encode())
        self.dirty = False
