"""The Hydra application's configuration, for whoever composes it: `train/main.py` (through
@hydra.main), `mingpt-torchrun` (which prepares the data before its node joins) and the tests.

The schema and the model group's options (the presets of mingpt.model, defined once) are registered
in Hydra's ConfigStore; the YAML files live beside the application, in `train/conf/`."""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Dict, get_origin, get_type_hints

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mingpt.errors import ConfigError
from mingpt.model import PRESETS
from mingpt.training.config import Config, ModelConfig, from_hydra, validate


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
    options = {"model": sorted(PRESETS), "data": sorted(path.stem for path in (Path(conf_dir) / "data").glob("*.yaml"))}
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
                raise ConfigError(f"{key}={value} is no {key} option{_did_you_mean(value, options[key])}: the options "
                                  f"are {', '.join(options[key])}")
        elif not _is_setting(key):
            raise ConfigError(f"unknown setting {key}{_did_you_mean(key, _settings(Config))}: `python train/main.py "
                              "--cfg job` lists every setting")


def _is_setting(dotted: str, schema: type = Config) -> bool:
    """Whether `dotted` names a setting of the dataclass `schema`, or a key inside one of its dict settings."""
    head, _, rest = dotted.partition(".")
    hints = {f.name: f.type for f in fields(schema)}
    if head not in hints:
        return False
    kind = get_type_hints(schema)[head]
    if is_dataclass(kind):
        return not rest or _is_setting(rest, kind)
    return not rest or get_origin(kind) in (dict, Dict)  # snapshot.storage_options.client_kwargs....


def _settings(schema: type, prefix: str = "") -> list[str]:
    """Every setting of the dataclass `schema`, dotted."""
    found = []
    for name, kind in get_type_hints(schema).items():
        found += _settings(kind, f"{prefix}{name}.") if is_dataclass(kind) else [f"{prefix}{name}"]
    return found


def _did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


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
