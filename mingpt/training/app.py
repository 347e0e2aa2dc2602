"""The Hydra application's configuration, for whoever composes it: `train/main.py`, `mingpt-torchrun` (to prepare data
before joining) and the tests."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mingpt.errors import ConfigError
from mingpt.shape import PRESETS
from mingpt.tokenizers.base import lone_surrogate
from mingpt.training.config import Config, ModelConfig, check_known, from_hydra, validate


# The application's Hydra configs: train/conf, which mingpt/conf links to (and an installed package carries).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def register() -> None:
    """Put the schema and the model presets into Hydra's ConfigStore (again is harmless)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for preset in PRESETS:  # model=gpt-mini: the config group's options are the model's presets
        store.store(group="model", name=preset, node=ModelConfig(name=preset))


# Hydra's own flags that take a value (hydra/_internal/utils.py's parser), and the config ones among them.
VALUED_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c", "--package",
                "-p", "--experimental-rerun"}


@dataclass
class Command:
    """An application's command line as Hydra reads it: where its configs are, and the overrides."""

    conf_dir: Path  # the primary config folder (--config-path, else the application's)
    name: str = "config"  # --config-name
    searchpath: list[str] = field(default_factory=list)  # where else Hydra looks: --config-dir, hydra.searchpath
    overrides: list[str] = field(default_factory=list)  # the settings and group options, without hydra.searchpath

    @property
    def folders(self) -> list[Path]:
        """Not the packages of a pkg:// entry."""
        return [self.conf_dir] + [Path(entry.removeprefix("file://")) for entry in self.searchpath
                                  if "://" not in entry.removeprefix("file://")]


def read_command(conf_dir: Path, args: list[str]) -> Command:
    """`args` split into Hydra's flags (those about configs kept) and the overrides."""
    command = Command(Path(conf_dir))
    args = list(args)
    while args:
        arg = args.pop(0)
        flag, equals, value = arg.partition("=")
        if not arg.startswith("-"):
            if flag.lstrip("+") == "hydra.searchpath":  # a list of folders (file://, or plain) and packages (pkg://)
                command.searchpath += [e.strip().strip("'\"") for e in value.strip("[]").split(",") if e.strip()]
            else:
                command.overrides.append(arg)
            continue
        if flag not in VALUED_FLAGS:
            continue
        if not equals:
            value = args.pop(0) if args else ""
        if flag in ("--config-path", "-cp") and value:  # Hydra: relative to the file of @hydra.main (mingpt.cli.train)
            command.conf_dir = CONF_DIR.parent / "cli" / value
        elif flag in ("--config-name", "-cn") and value:
            command.name = value
        elif flag in ("--config-dir", "-cd") and value:
            command.searchpath.append(f"file://{Path(value).resolve()}")
    return command


def group_options(command: Command) -> dict[str, list[str]]:
    """Every config group's options, in every folder Hydra searches."""
    options: dict[str, set[str]] = {"model": set(PRESETS), "data": set(), "recipe": set()}
    for folder in command.folders:
        for group in (path for path in Path(folder).glob("*") if path.is_dir()):
            options.setdefault(group.name, set()).update(path.stem for path in group.glob("*.yaml"))
    return {group: sorted(names) for group, names in options.items()}


# Hydra settings (train/conf/config.yaml's) that would move relative snapshot and data folders, and Hydra's output.
FIXED_HYDRA = {"hydra.job.chdir", "hydra.run.dir", "hydra.output_subdir", "hydra.sweep.dir", "hydra.sweep.subdir",
               "hydra.runtime.output_dir"}


def check_overrides(conf_dir: Path, args: list[str]) -> None:
    """ConfigError, in one line with the closest match, for an unknown setting or group option, or a deleted one
    (`~key`), where Hydra's own errors would advise `+key`. The rest is left to Hydra."""
    command = read_command(conf_dir, args)
    options = group_options(command)
    parser = OverridesParser.create()
    for arg in command.overrides:
        not_text = lone_surrogate(arg)
        if not_text:  # Hydra's parser would say LexerNoViableAltException
            raise ConfigError(f"the setting {arg!r} is not UTF-8 text: {not_text}")
        if not ("=" in arg or arg.startswith("~")):
            continue
        try:
            [override] = parser.parse_overrides([arg])
        except HydraException:
            continue
        key = override.key_or_group
        if key.lstrip("+~") in FIXED_HYDRA:
            raise ConfigError(f"{arg}: the application keeps {key.lstrip('+~')} as it is (Hydra writes nothing and "
                              "never changes the working folder, so relative paths mean what they say)")
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


def compose_config(conf_dir: Path, args: list[str]) -> Config:
    """The validated Config for the command line `args`; ConfigError, in Hydra's words, for what Hydra refuses."""
    register()
    check_overrides(conf_dir, args)
    command = read_command(conf_dir, args)
    # Hydra's compose API has no flags: --config-dir joins hydra.searchpath.
    searchpath = [f"hydra.searchpath=[{','.join(command.searchpath)}]"] if command.searchpath else []
    overrides = command.overrides + searchpath
    try:
        with initialize_config_dir(config_dir=str(command.conf_dir.resolve()), version_base="1.3"):
            raw = compose(config_name=command.name, overrides=overrides)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:  # the last: a user's YAML file
        why = f"{e}: {str(e.__cause__).splitlines()[0]}" if e.__cause__ and str(e.__cause__) else str(e)
        raise ConfigError(" ".join(why.split())) from None
    cfg = from_hydra(raw)
    validate(cfg)
    return cfg
