"""Hugging Face's GPT-2 format: weights and byte-level BPE tokenizers, in and out.

In: `model.init_from=FOLDER` reads a GPT-2 folder (`config.json`, `model.safetensors` or
`pytorch_model.bin`, loaded with weights_only), local or an fsspec URL; `data.tokenizer=FOLDER`
converts its tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`) to a tiktoken encoding,
stored in prepared data and snapshots like any BPE vocabulary. Nothing is downloaded: a folder
fetched once with `huggingface-cli download gpt2 --local-dir gpt2` is enough.

Out: `mingpt-export SNAPSHOT OUT` writes a folder that `transformers` loads with
`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)`.

GPT-2's layers map one to one onto mingpt.model's; HF stores its linear weights as Conv1D,
(in, out), the transpose of nn.Linear's. Its GELU is the tanh form ("gelu_new"), as ours. A
model trained here without biases is exported with zero biases, which computes the same.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys

import torch

from mingpt.errors import ConfigError, MinGPTError, TokenizerError
from mingpt.model import GPT, GPTConfig
from mingpt.storage import explain_storage_error, open_fs, redact
from mingpt.tokenizers import EOT, BPETokenizer, CharTokenizer, Tokenizer, TiktokenTokenizer, tokenizer_from_dict

# GPT-2's pre-tokenizer: what HF's ByteLevel(use_regex=True) splits words with.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# HF's Conv1D layers store (in, out); nn.Linear stores (out, in).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_path(spec: str) -> bool:
    """Whether a tokenizer or init_from value names a folder or file (it has a slash), not a name such as gpt2."""
    return "/" in spec or "\\" in spec


def _fs(url: str):
    return open_fs(url.rstrip("/"))


def _read(fs, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read()


def is_hf_model(url: str) -> bool:
    fs, path = _fs(url)
    return fs.exists(f"{path}/config.json")


# ---------------------------------------------------------------------------------------------
# Tokenizers


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters, in which its vocabularies are written:
    printable Latin-1 bytes stand for themselves, the others for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def load_tokenizer_folder(url: str) -> Tokenizer:
    """The tokenizer of a folder: mingpt's own tokenizer.json (a snapshot or prepared data), or a Hugging
    Face byte-level BPE (tokenizer.json, or vocab.json + merges.txt) converted to a tiktoken encoding, or the
    character vocabulary that mingpt-export writes for a char tokenizer."""
    fs, path = _fs(url)
    if fs.isfile(path):  # a tokenizer.json named itself
        path = path.rpartition("/")[0]
    if fs.exists(f"{path}/tokenizer.json"):
        payload = json.loads(_read(fs, f"{path}/tokenizer.json"))
        if payload.get("format") == "mingpt-tokenizer":
            return tokenizer_from_dict(payload)
        return _from_tokenizer_json(payload, url)
    if fs.exists(f"{path}/vocab.json") and fs.exists(f"{path}/merges.txt"):
        vocab = json.loads(_read(fs, f"{path}/vocab.json"))
        lines = _read(fs, f"{path}/merges.txt").decode("utf-8").splitlines()
        merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
        added = {token: vocab.pop(token) for token in list(vocab) if token == EOT}
        return _to_bpe(vocab, merges, GPT2_PATTERN, added, url)
    raise TokenizerError(f"{url} holds no tokenizer: expected tokenizer.json, or vocab.json and merges.txt")


def _from_tokenizer_json(payload: dict, url: str) -> Tokenizer:
    model = payload.get("model") or {}
    if model.get("type") != "BPE" or payload.get("normalizer"):
        raise TokenizerError(f"{url}/tokenizer.json is not a byte-level BPE without normalizer; only those convert")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    added = {t["content"]: t["id"] for t in payload.get("added_tokens") or []}
    vocab = {token: i for token, i in model["vocab"].items() if token not in added}
    if not merges and payload.get("pre_tokenizer") is None:  # a character vocabulary, as mingpt-export writes one
        return _to_char(vocab, added, url)
    return _to_bpe(vocab, merges, _pattern(payload.get("pre_tokenizer") or {}, url), added, url)


def _to_char(vocab: dict[str, int], added: dict[str, int], url: str) -> CharTokenizer:
    tokenizer = CharTokenizer(list(vocab), eot=EOT in added)
    if {c: i for i, c in enumerate(tokenizer.chars)} != vocab or added and added != {EOT: tokenizer.eot_id}:
        raise TokenizerError(f"{url}: a character vocabulary in another order than mingpt's (sorted, then {EOT})")
    return tokenizer


def _pattern(pre: dict, url: str) -> str:
    """The split pattern of a byte-level pre-tokenizer: ByteLevel alone (GPT-2's), or Split then ByteLevel."""
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and "Regex" in steps[0].get("pattern", {}) \
            and steps[0].get("behavior") == "Isolated" and not steps[1].get("use_regex", True):
        return steps[0]["pattern"]["Regex"]
    raise TokenizerError(f"{url}/tokenizer.json: pre-tokenizer {kinds} is not one this converts "
                         "(ByteLevel, or Split + ByteLevel, without add_prefix_space)")


def _to_bpe(vocab: dict[str, int], merges: list, pattern: str, added: dict[str, int], url: str) -> BPETokenizer:
    """A tiktoken encoding ranks a token by its id and merges the lowest-ranked pair first; HF's BPE merges in
    the order of its merges list. The two agree when ids follow that order, as in GPT-2 and in what
    mingpt-export writes; other layouts are refused rather than converted into a different tokenizer."""
    decode = {c: b for b, c in byte_to_unicode().items()}
    try:
        ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items()}
    except KeyError:
        raise TokenizerError(f"{url}: not a byte-level vocabulary (a token has a character outside GPT-2's "
                             "byte alphabet)") from None
    ordered = sorted(ranks, key=ranks.get)
    merged = [vocab.get(a + b) for a, b in merges]
    if [ranks[t] for t in ordered] != list(range(len(ordered))) or None in merged or merged != sorted(merged):
        raise TokenizerError(f"{url}: token ids do not follow the merge order (ids 0..n-1, merges ascending), "
                             "so no tiktoken encoding gives the same ids")
    if set(added) - {EOT} or (added and added[EOT] != len(ordered)):
        raise TokenizerError(f"{url}: special tokens {sorted(added)} with ids {sorted(added.values())}; only "
                             f"{EOT} right after the vocabulary ({len(ordered)}) converts")
    return BPETokenizer(pattern, ordered, eot=EOT in added)


def tokenizer_files(tokenizer: Tokenizer, max_length: int) -> dict[str, bytes]:
    """Hugging Face tokenizer files of the same vocabulary: tokenizer.json (and, for GPT-2's split pattern,
    vocab.json and merges.txt); AutoTokenizer encodes text to the same ids."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    if tokenizer.eot_id is not None:
        config.update(eos_token=EOT, bos_token=EOT)
    if isinstance(tokenizer, CharTokenizer):
        fast = _tokenizer_json({c: i for i, c in enumerate(tokenizer.chars)}, [], tokenizer, pre=None,
                               decoder={"type": "Fuse"})
        return {"tokenizer.json": _dumps(fast), "tokenizer_config.json": _dumps(config)}
    if isinstance(tokenizer, (BPETokenizer, TiktokenTokenizer)):
        ranks, pattern = tokenizer.encoding._mergeable_ranks, tokenizer.encoding._pat_str  # tiktoken's own tables
        to_text = byte_to_unicode()
        text = lambda token: "".join(to_text[b] for b in token)
        vocab = {text(token): rank for token, rank in ranks.items()}
        merges = [f"{text(a)} {text(b)}" for a, b in _recover_merges(ranks)]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
        pre = {**byte_level, "use_regex": True} if pattern == GPT2_PATTERN else {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False}]}
        fast = _tokenizer_json(vocab, merges, tokenizer, pre=pre, decoder={**byte_level, "use_regex": True})
        files = {"tokenizer.json": _dumps(fast), "tokenizer_config.json": _dumps(config)}
        if pattern == GPT2_PATTERN:  # the slow files imply GPT-2's split pattern: for any other they would mislead
            slow_vocab = {**vocab, **({EOT: tokenizer.eot_id} if tokenizer.eot_id is not None else {})}
            files.update({"vocab.json": _dumps(slow_vocab),
                          "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode()})
        return files
    raise TokenizerError(f"no Hugging Face form for a {tokenizer.describe()} tokenizer")


def _tokenizer_json(vocab: dict, merges: list[str], tokenizer: Tokenizer, pre: dict | None, decoder: dict) -> dict:
    added = [] if tokenizer.eot_id is None else [{"id": tokenizer.eot_id, "content": EOT, "single_word": False,
                                                  "lstrip": False, "rstrip": False, "normalized": False, "special": True}]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": pre, "post_processor": None, "decoder": decoder,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


def _recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges list of a tiktoken ranking: each token of several bytes is the pair that BPE, with only the
    tokens ranked below it, leaves of its bytes."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            found = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(found)
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise TokenizerError(f"token {token!r} is not a merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _dumps(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, indent=1).encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Weights


def hf_model_config(url: str, block_size: int) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 folder, for training on `block_size`-token windows."""
    fs, path = _fs(url)
    config = json.loads(_read(fs, f"{path}/config.json"))
    if config.get("model_type") != "gpt2":
        raise ConfigError(f"model.init_from={url}: config.json says model_type {config.get('model_type')!r}; "
                          "only GPT-2 (gpt2) folders load")
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"model.init_from={url}: activation {config['activation_function']!r}; this GPT uses "
                          "GPT-2's tanh GELU (gelu_new)")
    if block_size > config["n_positions"]:
        raise ConfigError(f"data.block_size={block_size} exceeds the {config['n_positions']} positions of "
                          f"model.init_from={url}; use a block_size up to {config['n_positions']}")
    return GPTConfig(vocab_size=config["vocab_size"], block_size=block_size, n_layer=config["n_layer"],
                     n_head=config["n_head"], n_embd=config["n_embd"], bias=True,
                     tie_weights=config.get("tie_word_embeddings", True))


def load_hf_weights(url: str, config: GPTConfig) -> dict[str, torch.Tensor]:
    """The state dict of a Hugging Face GPT-2 folder in mingpt.model's names, its position table cropped to
    `config.block_size`."""
    fs, path = _fs(url)
    name = next((n for n in WEIGHT_FILES if fs.exists(f"{path}/{n}")), None)
    if name is None:
        raise ConfigError(f"model.init_from={url} has config.json but no weights ({' or '.join(WEIGHT_FILES)})")
    data = _read(fs, f"{path}/{name}")
    if name.endswith(".safetensors"):
        from safetensors.torch import load

        tensors = load(data)
    else:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    state = {}
    for key, tensor in tensors.items():
        key = re.sub(r"^h\.(\d+)\.", r"blocks.\1.", key.removeprefix("transformer."))
        if key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of older checkpoints
            continue
        state[key] = tensor.t() if key.endswith(CONV1D) else tensor
    state["wpe.weight"] = state["wpe.weight"][: config.block_size]
    if config.tie_weights:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["wte.weight"]
    return state


def hf_files(model: GPT, eot_id: int | None) -> dict[str, bytes]:
    """config.json and model.safetensors of `model` as a transformers GPT2LMHeadModel; `generate` stops at
    the end-of-text token `eot_id`, as mingpt-sample does."""
    from safetensors.torch import save

    c = model.config
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
    return {"config.json": _dumps(config), "model.safetensors": save(tensors, metadata={"format": "pt"})}


# ---------------------------------------------------------------------------------------------
# mingpt-export


def export(snapshot_url: str, out: str) -> list[str]:
    """Write the model and tokenizer of a snapshot as a Hugging Face folder; the names of the files written."""
    from mingpt.sample import open_for_sampling

    _, model, tokenizer = open_for_sampling(snapshot_url, torch.device("cpu"))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mingpt-export", description="Write a snapshot's model and tokenizer as a Hugging Face GPT-2 folder.")
    parser.add_argument("snapshot", help="a snapshot folder, or a run folder (its newest snapshot), local or s3://")
    parser.add_argument("out", help="a new folder, local or s3://")
    args = parser.parse_args(argv)
    try:
        names = export(args.snapshot, args.out)
    except MinGPTError as e:
        print(f"mingpt-export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(names)} to {args.out}")
    return 0
