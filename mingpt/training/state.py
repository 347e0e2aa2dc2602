"""The run state: model, optimizer, loss scaler, step and examples seen, one object for every kind of replica. Its
tensors go only through torch's state-dict API, which knows whole replicas and shards alike, so that every
parallelism takes one path. What a snapshot must match to be trained on is here too."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from mingpt.checkpoint.store import Snapshot, SnapshotError
from mingpt.model import GPTConfig
from mingpt.tokenizers import Tokenizer, tokenizer_from_dict
from mingpt.storage import parse_json
from mingpt.training.optimizer import MuonAdamW

RECENT = 64  # steps whose samples' digests the state carries (TrainState.ledger)

# The parts of GPTConfig that decide the shape of the weights.
SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "tie_weights", "rotary", "norm",
              "qk_norm", "mlp")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # the data cursor: examples consumed from the global stream (mingpt.data.sampler)
    # (step, digest of its samples) of the last RECENT steps: whoever resumes logs what a dead metrics writer did not.
    ledger: list[tuple[int, str]] = field(default_factory=list)

    def advance(self, examples: int, digest: str) -> None:
        """One step taken, over `examples` examples whose digest is `digest`."""
        self.step += 1
        self.samples_seen += examples
        self.ledger = [*self.ledger[1 - RECENT:], (self.step, digest)]

    def saved(self) -> dict:
        """These fields, as a memory tier's description and a heal carry them."""
        return asdict(self)

    def restore(self, saved: dict) -> None:
        """From `saved()`'s, or a snapshot's manifest, which has no ledger (it commits after its steps are logged)."""
        self.step, self.samples_seen = saved["step"], saved["samples_seen"]
        self.ledger = [(int(step), str(digest)) for step, digest in saved.get("ledger", ())]


@dataclass
class Replica:
    """What a snapshot saves and restores, in every process (each its shard where the model is sharded)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | MuonAdamW  # AdamW, or Muon and AdamW (mingpt.training.optimizer)
    scaler: torch.amp.GradScaler | None  # fp16 only: the loss scale it found is part of the state
    state: TrainState

    _tensors: tuple[dict, dict] | None = field(default=None, init=False, repr=False)

    def state_dict(self) -> dict:
        """{model, optimizer, scaler}, keyed by parameter name: the live tensors, made once (on the training thread:
        FSDP's state-dict hooks swap the model's parameters) and current until `load` replaces them."""
        if self._tensors is None:
            self._tensors = get_state_dict(self.model, self.optimizer)
        model, optimizer = self._tensors
        return {"model": model, "optimizer": optimizer,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load(self, state: dict, whole: bool, train: dict) -> list[str]:
        """Restore from `state` (`whole`: every tensor whole, which each process cuts its shard from) and `train`;
        returns the optimizer settings that differed from this run's config, which win over the saved ones."""
        configured = [{key: value for key, value in group.items() if key != "params"}
                      for group in self.optimizer.param_groups]
        options = StateDictOptions(full_state_dict=whole)
        # One at a time: torch's set_state_dict of both at once hangs (broadcast_from_rank0).
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._tensors = None  # the optimizer's state is new tensors now
        self.state.restore(train)
        return _apply_configured(self.optimizer, configured)

    def read(self, snapshot: Snapshot) -> tuple[dict, bool]:
        """(state, whole) for `load`: shards as DCP plans, in this process's layout; model.pt and optimizer.pt whole."""
        if snapshot.sharded:
            from mingpt.checkpoint.sharded import read_shards  # DCP: imported where it is used

            state = self.state_dict()
            del state["scaler"]  # fp16 is never sharded
            self._tensors = None  # DCP reads into these dicts, and may put new values in them
            read_shards(snapshot, state)
            return state, False
        optimizer = snapshot.load_tensors("optimizer.pt")
        optimizer = _keyed_by_name(optimizer, self.model, self.optimizer)
        scaler = snapshot.load_tensors("scaler.pt") if "scaler.pt" in snapshot.manifest["files"] else None
        return {"model": snapshot.load_tensors("model.pt"), "optimizer": optimizer, "scaler": scaler}, True


def check_compatible(snapshot: Snapshot, model_config: GPTConfig, tokenizer: Tokenizer, optimizer: str) -> None:
    """SnapshotError unless this run's model, tokenizer and optimizer can train on from `snapshot`."""
    try:
        saved_tokenizer = tokenizer_from_dict(parse_json(snapshot.read("tokenizer.json")))
        saved_model = GPTConfig(**snapshot.manifest.get("model_config"))
    except (TypeError, ValueError) as e:  # not JSON, a tokenizer of no known kind, an unusable model_config
        raise SnapshotError(f"snapshot {snapshot.url} does not describe its model and tokenizer ({e})") from None
    if saved_tokenizer.eot_id is None and tokenizer.eot_id is not None:
        raise SnapshotError(
            f"snapshot {snapshot.url} was made before tokenizers reserved an end-of-text token, which prepared "
            f"data now ends every document with ({saved_tokenizer.vocab_size} ids then, {tokenizer.vocab_size} now), "
            "so it cannot train on: sample it with mingpt-sample, or start a new run in another snapshot.dir"
        )
    saved, wanted = saved_model.to_dict(), model_config.to_dict()
    diffs = [f"{k}={saved.get(k)!r} (config asks for {wanted[k]!r})" for k in SHAPE_KEYS if saved.get(k) != wanted[k]]
    if diffs:
        arch = f" (model.arch={saved_model.arch})" if saved_model.arch not in ("custom", model_config.arch) else ""
        raise SnapshotError(
            f"snapshot {snapshot.url} was made with a different model: {', '.join(diffs)}. "
            f"Use the settings of that run{arch}, or a new snapshot.dir to start a new run"
        )
    saved_optimizer = snapshot.manifest.get("optimizer", "adamw")  # none recorded: made before Muon, so AdamW's
    if saved_optimizer != optimizer:
        raise SnapshotError(
            f"snapshot {snapshot.url} was trained with trainer.optimizer={saved_optimizer} (config asks for "
            f"{optimizer}), whose state the other cannot take over. Use trainer.optimizer={saved_optimizer}, or a "
            "new snapshot.dir to start a new run"
        )
    if saved_tokenizer.to_dict() != tokenizer.to_dict():
        raise SnapshotError(
            f"snapshot {snapshot.url} was made with another tokenizer ({saved_tokenizer.describe()}) than "
            f"the data now gives ({tokenizer.describe()}); use the data settings of that run, or a new snapshot.dir"
        )


def changed_settings(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for each setting that differs between two `Config.to_dict()` trees."""
    changed = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += changed_settings(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changed


def to_cpu(obj):
    """A copy of `obj` (nested dicts and lists) whose tensors are on the CPU, shards still placed in the whole."""
    if isinstance(obj, DTensor):
        return DTensor.from_local(to_cpu(obj.to_local()), obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    return obj


def _apply_configured(optimizer: torch.optim.Optimizer, configured: list[dict]) -> list[str]:
    """Loading brings back the saved betas, weight decay, ...; this run's config wins. What differed."""
    changed = {}  # one line per setting, whatever the number of groups
    for group, wanted in zip(optimizer.param_groups, configured):
        for key, value in wanted.items():
            saved = group.get(key)
            saved = tuple(saved) if isinstance(value, tuple) and isinstance(saved, list) else saved  # as JSON keeps it
            if key != "lr" and saved != value:  # lr is set every step from the schedule
                changed[key] = f"optimizer {key}: {saved} in the snapshot, {value} in the config: using the config"
            group[key] = value
    return list(changed.values())


def _keyed_by_name(saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state dict keyed by parameter name (as torch's state-dict API wants), also where it was written
    keyed by index, before the state went through get_state_dict."""
    if not any(isinstance(p, int) for group in saved["param_groups"] for p in group["params"]):
        return saved
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[index]: state for index, state in saved["state"].items()},
            "param_groups": [{**group, "params": [order[index] for index in group["params"]]}
                             for group in saved["param_groups"]]}
