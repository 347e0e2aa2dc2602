"""Reading a trained model back: what `mingpt-sample`, `mingpt-export`, `model.init_from` and a resume share. Only the
files a model needs are read. What a model's snapshot must hold (`snapshot_problem`) is said here: the store knows files
only."""

from __future__ import annotations

import torch

from mingpt.checkpoint.store import INDEX, MANIFEST, STATE_DIR, Snapshot, SnapshotError, SnapshotStore
from mingpt.errors import MinGPTError
from mingpt.model import GPT, GPTConfig
from mingpt.storage import explain_storage_error, parse_json, redact
from mingpt.tokenizers import Tokenizer, tokenizer_from_dict


def snapshot_problem(manifest: dict) -> str | None:
    """Why a committed manifest does not describe a model's snapshot, in a few words; None when it does."""
    files = manifest["files"]
    if "tokenizer.json" not in files or ("model.pt" in files) == (INDEX in files):
        return f"the manifest does not list tokenizer.json and either model.pt or {STATE_DIR}/"
    samples = manifest.get("samples_seen")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        return "the manifest has no samples_seen count"
    try:
        config = GPTConfig(**manifest.get("model_config"))
    except (TypeError, ValueError) as e:  # not a dict, unknown or missing keys, bad values
        return f"the manifest's model_config is unusable ({e})"
    weights = sum(entry["bytes"] for name, entry in files.items()
                  if name == "model.pt" or name.startswith(f"{STATE_DIR}/"))
    if 2 * config.least_parameters() > weights:  # checked before a model of that shape is allocated
        return (f"the manifest's model_config describes at least {config.least_parameters():,} parameters, more "
                f"than its weights' {weights:,} bytes hold")
    return None


def index_problem(snapshot: Snapshot) -> str | None:
    """Why a sharded snapshot's DCP index cannot be read, or None: so `verify` skips it before DCP reads it."""
    if not snapshot.sharded:
        return None
    from mingpt.checkpoint.sharded import read_index  # DCP: imported for a sharded snapshot only

    try:
        read_index(snapshot)
    except SnapshotError as e:
        return str(e)
    return None


def snapshot_store(url: str, **options) -> SnapshotStore:
    """The store of the snapshots of a model's run at `url`."""
    return SnapshotStore(url, expects=snapshot_problem, reads_back=index_problem, **options)


def model_files(snapshot: Snapshot) -> list[str]:
    """What loading the model alone reads: all of a sharded snapshot (weights are sharded with the optimizer state)."""
    return list(snapshot.manifest["files"]) if snapshot.sharded else ["model.pt", "tokenizer.json"]


def open_snapshot(url: str) -> Snapshot:
    """`url` names one snapshot (it has a manifest) or a folder of them (take the newest that verifies)."""
    url = url.rstrip("/")
    parent, _, name = url.rpartition("/")
    if parent:
        store = snapshot_store(parent)
        if store.fs.exists(f"{store.path}/{name}/{MANIFEST}"):
            return store.get(name)
    snapshot = snapshot_store(url).latest(files=model_files)
    if snapshot is None:
        raise SnapshotError(f"no committed snapshot found in {redact(url)}; give a snapshot folder the trainer wrote")
    return snapshot


def load_model(snapshot: Snapshot, device: torch.device) -> tuple[GPT, Tokenizer]:
    """The snapshot's model, in eval mode on `device`, and its tokenizer."""
    try:
        tokenizer = tokenizer_from_dict(parse_json(snapshot.read("tokenizer.json")))
    except ValueError as e:  # JSONDecodeError, or a tokenizer description of no known kind
        raise SnapshotError(f"snapshot {snapshot.url} has an unusable tokenizer.json ({e})") from None
    model = GPT(GPTConfig(**snapshot.manifest["model_config"]))
    try:
        model.load_state_dict(read_weights(snapshot, device, model))
    except RuntimeError as e:  # missing, unexpected or misshapen tensors
        reason = str(e).splitlines()[0]
        what = "its shards do" if snapshot.sharded else "model.pt does"
        raise SnapshotError(f"snapshot {snapshot.url}: {what} not fit its model_config ({reason})") from None
    return model.to(device).eval(), tokenizer


def read_weights(snapshot: Snapshot, device: torch.device | str = "cpu", model: GPT | None = None) -> dict:
    """The snapshot's weights, a GPT state dict: model.pt, or gathered from the shards (into `model` if given)."""
    if not snapshot.sharded:
        return snapshot.load_tensors("model.pt", device)
    # Imported here: DCP and the DTensor machinery under it are slow to import, and only a sharded snapshot needs them.
    from mingpt.checkpoint.sharded import read_model

    weights = read_model(snapshot, model or GPT(GPTConfig(**snapshot.manifest["model_config"])))
    return {name: tensor.to(device) for name, tensor in weights.items()}


def open_model(url: str, device: torch.device) -> tuple[Snapshot, GPT, Tokenizer]:
    """The snapshot `url` names, its model on `device` and its tokenizer; storage failures as one line."""
    try:
        snapshot = open_snapshot(url)
        return (snapshot, *load_model(snapshot, device))
    except MinGPTError:
        raise
    except Exception as e:  # storage clients raise many types (OSError, botocore, aiohttp): explain any
        local = "://" not in url or url.startswith("file:")
        reason = explain_storage_error(e, local=local, setting="the SNAPSHOT argument")
        raise SnapshotError(f"cannot read {redact(url)}: {reason}") from None
