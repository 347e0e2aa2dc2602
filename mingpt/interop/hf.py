"""Hugging Face's GPT-2 format: weights in (`model.init_from=FOLDER`, a local or fsspec folder, never downloaded; its
tokenizer: mingpt.tokenizers.huggingface) and out (`mingpt-export SNAPSHOT OUT`, which transformers' Auto classes load).
See docs/huggingface.md. GPT-2's layers map one to one onto mingpt.model's (HF's Conv1D weights transposed), with the
same tanh GELU; a model trained without biases is exported with zero biases, which compute the same."""

from __future__ import annotations

import io
import json
import pickle
import re
import warnings

import torch

from mingpt.checkpoint.load import open_model
from mingpt.errors import ConfigError, MinGPTError
from mingpt.model import GPT, GPTConfig
from mingpt.storage import explain_storage_error, open_fs, redact
from mingpt.tokenizers.files import NotReadable, json_object, read_file
from mingpt.tokenizers.huggingface import tokenizer_files

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHAPE_KEYS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
# HF's Conv1D layers store (in, out); nn.Linear stores (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _fs(url: str):
    return open_fs(url.rstrip("/"))


def is_hf_model(url: str) -> bool:
    fs, path = _fs(url)
    return fs.exists(f"{path}/config.json")


def hf_model_config(url: str, block_size: int) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 folder, for training on `block_size`-token windows."""
    fs, path = _fs(url)
    config = read_file(fs, f"{path}/config.json", json_object, error=ConfigError,
                       advice=f"model.init_from={url} must be a Hugging Face GPT-2 folder, as save_pretrained "
                              "writes it; download or copy it again")
    if config.get("model_type") != "gpt2":
        raise ConfigError(f"model.init_from={url}: config.json says model_type {config.get('model_type')!r}; "
                          "only GPT-2 (gpt2) folders load")
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"model.init_from={url}: activation {config['activation_function']!r}; this GPT uses "
                          "GPT-2's tanh GELU (gelu_new)")
    missing = [key for key in SHAPE_KEYS if not isinstance(config.get(key), int)]
    if missing:
        raise ConfigError(f"model.init_from={url}: config.json gives no whole number for {', '.join(missing)}; "
                          "give a GPT-2 config.json, as save_pretrained writes it")
    if block_size > config["n_positions"]:
        raise ConfigError(f"data.block_size={block_size} exceeds the {config['n_positions']} positions of "
                          f"model.init_from={url}; use a block_size up to {config['n_positions']}")
    return GPTConfig(vocab_size=config["vocab_size"], block_size=block_size, n_layer=config["n_layer"],
                     n_head=config["n_head"], n_embd=config["n_embd"], bias=True,
                     tie_weights=config.get("tie_word_embeddings", True))


def load_hf_weights(url: str, config: GPTConfig) -> dict[str, torch.Tensor]:
    """The state dict of a Hugging Face GPT-2 folder in mingpt.model's names (mingpt.interop.pretrained checks it)."""
    fs, path = _fs(url)
    name = next((n for n in WEIGHT_FILES if fs.exists(f"{path}/{n}")), None)
    if name is None:
        raise ConfigError(f"model.init_from={url} has config.json but no weights ({' or '.join(WEIGHT_FILES)})")
    parse = _safetensors if name.endswith(".safetensors") else _weights_only
    tensors = read_file(fs, f"{path}/{name}", parse, error=ConfigError,
                        advice="download the folder again, or give its weights as model.safetensors")
    state = {}
    for key, tensor in tensors.items():
        key = re.sub(r"^h\.(\d+)\.", r"blocks.\1.", key.removeprefix("transformer."))
        if key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of older checkpoints
            continue
        state[key] = tensor.t() if key.endswith(CONV1D) else tensor
    if config.tie_weights and "wte.weight" in state:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["wte.weight"]
    return state


def _safetensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def _weights_only(data: bytes) -> dict[str, torch.Tensor]:
    """A torch.save file of tensors alone; anything else is refused (unpickling it, as torch suggests, runs code)."""
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files it then refuses
            warnings.simplefilter("ignore")
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise NotReadable("not tensors alone: a pickle of other Python objects, or damaged; unpickling "
                          "those could run code, so mingpt never does") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise NotReadable("holds other things than a dict of named tensors")
    return tensors


def beyond_gpt2(config: GPTConfig) -> str:
    """The parts of `config` that GPT-2's layers cannot hold, in words ("" where none)."""
    parts = [(config.rotary, "rotary positions"), (config.norm != "layernorm", f"{config.norm}"),
             (config.qk_norm, "QK-norm"), (config.mlp != "gelu", f"a {config.mlp} MLP")]
    return ", ".join(words for differs, words in parts if differs)


def hf_files(model: GPT, eot_id: int | None) -> dict[str, bytes]:
    """config.json and model.safetensors of `model` as a GPT2LMHeadModel whose `generate` stops at `eot_id`."""
    from safetensors.torch import save

    c = model.config
    if (unheld := beyond_gpt2(c)):
        raise ConfigError(f"this model's architecture has {unheld}, which Hugging Face's GPT-2 cannot hold: only a "
                          "model of model.arch=gpt2's layers exports (its head may be tied or not)")
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
              "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
              "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
              "tie_word_embeddings": c.tie_weights, "torch_dtype": "float32", "bos_token_id": eot_id,
              "eos_token_id": eot_id}
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_weights:
            continue  # the same tensor as wte
        tensor = tensor.detach().float().cpu()
        hf_key = key if key == "lm_head.weight" else "transformer." + key.replace("blocks.", "h.", 1)
        tensors[hf_key] = (tensor.t() if key.endswith(CONV1D) else tensor).contiguous()
    if not c.bias:  # GPT-2 always has biases: zeros compute the same as none
        for i in range(c.n_layer):
            for layer, width in (("ln_1", c.n_embd), ("ln_2", c.n_embd), ("attn.c_attn", 3 * c.n_embd),
                                 ("attn.c_proj", c.n_embd), ("mlp.c_fc", 4 * c.n_embd), ("mlp.c_proj", c.n_embd)):
                tensors[f"transformer.h.{i}.{layer}.bias"] = torch.zeros(width)
        tensors["transformer.ln_f.bias"] = torch.zeros(c.n_embd)
    return {"config.json": json.dumps(config, indent=1).encode(), "model.safetensors": save(tensors, metadata={"format": "pt"})}


def export(snapshot_url: str, out: str) -> list[str]:
    """Write the model and tokenizer of a snapshot as a Hugging Face folder; the names of the files written."""
    _, model, tokenizer = open_model(snapshot_url, torch.device("cpu"))
    files = {**hf_files(model, tokenizer.eot_id), **tokenizer_files(tokenizer, model.config.block_size)}
    try:
        fs, path = _fs(out)
        if fs.exists(path) and fs.ls(path):
            raise ConfigError(f"{out} exists and is not empty; give a new folder")
        fs.makedirs(path, exist_ok=True)
        for name, data in files.items():
            with fs.open(f"{path}/{name}", "wb") as f:
                f.write(data)
    except MinGPTError:
        raise
    except Exception as e:  # storage clients raise many types: explain any in one line
        reason = explain_storage_error(e, local="://" not in out, setting="the OUT argument")
        raise ConfigError(f"cannot write {redact(out)}: {reason}") from None
    return sorted(files)
