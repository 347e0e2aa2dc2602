"""The Hydra application's configuration, for whoever composes it: `train/main.py` (through
@hydra.main), `mingpt-torchrun` (which prepares the data before its node joins) and the tests.

The schema and the model group's options (the presets of mingpt.model, defined once) are registered
in Hydra's ConfigStore; the YAML files live beside the application, in `train/conf/`."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
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


def compose_config(conf_dir: Path, overrides: list[str]) -> Config:
    """The validated Config that the application in `conf_dir`'s folder runs with under `overrides`;
    ConfigError, in Hydra's words, for what Hydra refuses."""
    register()
    try:
        with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
            raw = compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    cfg = from_hydra(raw)
    validate(cfg)
    return cfg
