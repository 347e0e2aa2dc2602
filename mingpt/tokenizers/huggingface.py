"""Hugging Face's byte-level BPE tokenizers, in and out, as tiktoken encodings.

In: `tokenizer.json`, or GPT-2's `vocab.json` + `merges.txt`, becomes a `bpe` tokenizer (pattern + ranks); the char
vocabulary mingpt-export writes becomes a char tokenizer. Out: `tokenizer_files`, which `AutoTokenizer` encodes alike.
"""

from __future__ import annotations

import json

from mingpt.errors import TokenizerError
from mingpt.storage import redact
from mingpt.tokenizers.base import EOT, Tokenizer
from mingpt.tokenizers.bpe import BPETokenizer, TiktokenTokenizer
from mingpt.tokenizers.char import CharTokenizer
from mingpt.tokenizers.files import json_object, read_file

# GPT-2's pre-tokenizer: what HF's ByteLevel(use_regex=True) splits words with.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to the printable characters its vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def from_vocab_and_merges(fs, path: str, url: str) -> BPETokenizer:
    """GPT-2's slow tokenizer files (vocab.json + merges.txt) in folder `path` of `fs`, as a tiktoken encoding."""
    if fs.exists(f"{path}/vocab.json") and fs.exists(f"{path}/merges.txt"):
        vocab = read_file(fs, f"{path}/vocab.json", json_object)
        merges = read_file(fs, f"{path}/merges.txt", _merges)
        added = {token: vocab.pop(token) for token in list(vocab) if token == EOT}
        return _to_bpe(vocab, merges, GPT2_PATTERN, added, url)
    raise TokenizerError(f"{url} holds no tokenizer: expected tokenizer.json, or vocab.json and merges.txt")


def _merges(data: bytes) -> list[tuple[str, ...]]:
    """merges.txt: a pair of tokens a line, after an optional '#version' line."""
    lines = data.decode("utf-8").splitlines()
    return [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]


def from_tokenizer_json(payload: dict, url: str) -> Tokenizer:
    """A parsed Hugging Face tokenizer.json as a bpe or char tokenizer; JSON of another shape is one TokenizerError."""
    try:
        return _from_tokenizer_json(payload, url)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, TokenizerError):
            raise
        raise TokenizerError(f"{redact(url)}/tokenizer.json is not a tokenizer file this reads ({type(e).__name__}: "
                             f"{e}); download or copy it again") from None


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
    """tiktoken merges the pair of lowest id first, HF's BPE in the order of its merges list: they agree only where ids
    follow that order (GPT-2, mingpt-export); other layouts are refused rather than made a different tokenizer."""
    decode = {c: b for b, c in byte_to_unicode().items()}
    try:
        ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items()}
    except KeyError:
        raise TokenizerError(f"{url}: not a byte-level vocabulary (a token has a character outside GPT-2's "
                             "byte alphabet)") from None
    # Each token of several bytes is made by one merge of two: fewer merges, a truncated file.
    several = sum(len(token) > 1 for token in ranks)
    if any(len(pair) != 2 or "" in pair for pair in merges) or len(merges) != several:
        raise TokenizerError(f"{url}: {len(merges)} merges for {several} tokens of several bytes, where each is "
                             "one merge of a pair: the merges are truncated or of another vocabulary; download or "
                             "copy the folder again")
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
    """Hugging Face's files of the same vocabulary (vocab.json and merges.txt too for GPT-2's pattern)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    if tokenizer.eot_id is not None:
        config.update(eos_token=EOT, bos_token=EOT)
    if isinstance(tokenizer, CharTokenizer):
        fast = _tokenizer_json({c: i for i, c in enumerate(tokenizer.chars)}, [], tokenizer, pre=None,
                               decoder={"type": "Fuse"})
        return {"tokenizer.json": _dumps(fast), "tokenizer_config.json": _dumps(config)}
    if isinstance(tokenizer, (BPETokenizer, TiktokenTokenizer)):
        ranks, pattern = tokenizer.tables()
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
    """The merges list of a tiktoken ranking: each longer token is the pair BPE leaves of its bytes with lower ranks."""
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
