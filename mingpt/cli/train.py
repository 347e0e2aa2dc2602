"""`mingpt-train`: the training application, the same that `python train/main.py` runs, with its Hydra configs
(train/conf, installed as mingpt/conf). Hydra's multirun (-m) is refused: one job per command. See docs/launching.md."""

import logging
import os
import signal
import sys
from collections.abc import Callable
from importlib import metadata

import hydra
from omegaconf import DictConfig

import mingpt
from mingpt.cli import configure_logging
from mingpt.errors import MinGPTError, PeerLeft
from mingpt.jobenv import first_on_its_node, leads_this_generation, worker_name
from mingpt.processes import PR_SET_NAME, prctl
from mingpt.training import app
from mingpt.training.app import CONF_DIR, register
from mingpt.training.config import Config, from_hydra, validate

register()  # the schema and the model presets (mingpt.training.app)
log = logging.getLogger("mingpt")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def run(raw: DictConfig) -> None:
    """The job under Hydra's own main: for its flags (--help, --cfg, --config-dir...) and its settings (hydra.*)."""
    train_job(lambda: from_hydra(raw))


def train_job(settings: Callable[[], Config]) -> None:
    """Train with the Config that `settings` gives; its errors, and training's, as this command reports them."""
    configure_logging(logging.WARNING, "%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    try:
        cfg = settings()
        validate(cfg)
        # torch and the trainer: imported once the settings are sound, so that --help and a bad value are quick.
        from mingpt.training.trainer import train

        log_as_this_process_should()
        train(cfg)
    except PeerLeft as e:  # not this process's failure: mingpt-torchrun's agent restarts it for free
        log.warning("%s", e)
        exit_now(e.exit_code)
    except MinGPTError as e:
        log.error("%s", e)  # redacted by the handler's filter (configure_logging), as every record is
        exit_now(2)
    except Exception:  # a bug or another library's error: its traceback (redacted too), not Hydra's report
        log.exception("unexpected error")
        exit_now(1)


def log_as_this_process_should() -> None:
    """The leader logs the job's progress, the first process of each other node its own data preparation and compile
    caches; the rest, and other libraries (botocore's credential notes), warnings and errors only."""
    if leads_this_generation():
        log.setLevel(logging.INFO)
    elif first_on_its_node():
        for name in ("mingpt.data", "mingpt.training.compile_cache", "mingpt.checkpoint.compiled"):
            logging.getLogger(name).setLevel(logging.INFO)


def exit_now(code: int) -> None:
    """Exit with `code` once the logs are out, by os._exit: teardown during a snapshot upload's C++ call aborts it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def refuse_multirun(args: list[str]) -> None:
    """Exit 2 on Hydra's -m/--multirun, before it writes ./multirun/: its jobs would share this one process."""
    for arg in args:
        if arg in ("-m", "--multirun") or arg.replace(" ", "").lower() == "hydra.mode=multirun":
            print(f"error: {arg} (Hydra multirun) is not supported: run one command per setting instead, e.g. "
                  "`python train/main.py seed=2 snapshot.dir=snapshots/seed2`", file=sys.stderr)
            sys.exit(2)


def check_config(args: list[str]) -> Config:
    """The Config of the command line `args`; exit 2 with one line, before Hydra starts, for what Hydra would refuse
    in many (an unknown setting, a wrong type, a bad YAML file) and a value out of range."""
    try:
        return app.compose_config(CONF_DIR, args)
    except MinGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def print_version(args: list[str]) -> None:
    """--version: mingpt's version (Hydra's flag would print Hydra's own), with torch's and Hydra's, then exit 0."""
    if "--version" in args:
        print(f"mingpt-train {mingpt.__version__} (torch {metadata.version('torch')}, Hydra {hydra.__version__})")
        sys.exit(0)


def main() -> None:
    if (name := worker_name()) is not None:
        prctl(PR_SET_NAME, name.encode())
    try:
        os.getcwd()
    except FileNotFoundError:
        print("error: the current folder no longer exists (it was deleted or moved): change to one that does",
              file=sys.stderr)
        sys.exit(2)
    print_version(sys.argv[1:])
    refuse_multirun(sys.argv[1:])
    cfg = check_config(sys.argv[1:])
    try:
        if any(arg.startswith("-") or arg.lstrip("+~").startswith("hydra") for arg in sys.argv[1:]):
            run()
        else:  # settings alone: the Config composed above is the job's (Hydra's main would compose it twice more)
            train_job(lambda: cfg)
    except KeyboardInterrupt as e:  # SIGTERM before training, or a second Ctrl-C cutting the first one's stop short
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"interrupted ({signal.Signals(signum).name}): the last snapshot may not have been written; run the "
              "same command to resume from the newest committed snapshot", file=sys.stderr)
        exit_now(128 + signum)  # 130, 143: as shells report a process that the signal ended
    except (ValueError, OSError) as e:  # Hydra's, before the application runs (which reports its own): its flags
        print(f"error: {e}; see --hydra-help", file=sys.stderr)
        sys.exit(2)
