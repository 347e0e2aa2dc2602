"""The Hydra application's configuration, for whoever composes it: `train/main.py` (through
@hydra.main), `mingpt-torchrun` (which prepares the data before its node joins) and the tests.

The schema and the model group's options (the presets of mingpt.model, defined once) are registered
in Hydra's ConfigStore; the YAML files live beside the application, in `train/conf/`."""

from __future__ import annotations

import difflib
from functools import reduce
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mingpt.errors import ConfigError
from mingpt.shape import PRESETS
from mingpt.training.config import Config, ModelConfig, check_known, from_hydra, validate


# The application's Hydra configs: train/conf, which mingpt/conf links to (and an installed package carries).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def register() -> None:
    """Put the schema and the model presets into Hydra's ConfigStore (again is harmless)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for preset in PRESETS:  # model=gpt-mini: the config group's options are the model's presets
        store.store(group="model", name=preset, node=ModelConfig(name=preset))


def check_overrides(conf_dir: Path, args: list[str]) -> None:
    """ConfigError, in one line with the closest match, for a setting or a group option that does not
    exist, or a setting deleted (`~key`): Hydra's own errors for these take seven lines and advise `+key`.
    What Hydra's parser cannot read, Hydra's flags, and `hydra.*` are left to Hydra."""
    options = {"model": sorted(PRESETS), **{group: sorted(path.stem for path in (Path(conf_dir) / group).glob("*.yaml"))
                                             for group in ("data", "recipe")}}
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or not ("=" in arg or arg.startswith("~")):
            continue
        try:
            [override] = parser.parse_overrides([arg])
        except HydraException:
            continue
        key = override.key_or_group
        if key == "hydra" or key.startswith("hydra."):
            continue
        if override.is_delete():
            raise ConfigError(f"{arg}: settings cannot be deleted; give the value you want instead ({key}=VALUE)")
        if key in options and override.package is None:
            value = str(override.value())
            if value not in options[key]:
                close = difflib.get_close_matches(value, options[key], n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"{key}={value} is no {key} option{hint}: the options are {', '.join(options[key])}")
        else:  # the key as Hydra would nest it, checked as from_hydra checks what Hydra composed
            nested: dict = {}
            reduce(lambda level, part: level.setdefault(part, {}), key.split("."), nested)
            check_known(nested)


def compose_config(conf_dir: Path, overrides: list[str]) -> Config:
    """The validated Config that the application in `conf_dir`'s folder runs with under `overrides`;
    ConfigError, in Hydra's words, for what Hydra refuses."""
    register()
    check_overrides(conf_dir, overrides)
    try:
        with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
            raw = compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    cfg = from_hydra(raw)
    validate(cfg)
    return cfg
