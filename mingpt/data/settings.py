"""The settings of a preparation (`PrepareConfig`), and which of them a prepared folder must match to be reused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mingpt.data.corpus import BUILTIN_CORPUS, Source


MIN_BPE_SAMPLE = 1_000_000  # bytes: bpe learns nothing worth its merges from less


@dataclass
class PrepareConfig:
    """What to prepare and how: the settings that `mingpt-prepare` and the trainer's `data` group share."""

    # Files, folders, quoted globs (local, fsspec URLs, hf://datasets/...) or python-docs, alone or a list: docs/data.md
    corpus: Any = BUILTIN_CORPUS
    text_field: str = "text"  # the field of each JSONL record, or the Parquet column, that holds the text
    # char, bpe, a tiktoken name (gpt2, ...), or a folder with a slash in its name (./gpt2): Hugging Face's or mingpt's
    tokenizer: str = "char"
    vocab_size: Optional[int] = None  # for bpe
    bpe_sample_bytes: int = 100_000_000  # bpe is trained on a sample of this many bytes, drawn across the corpus
    num_workers: int = 0  # processes that tokenize; 0: one per CPU core
    val_fraction: float = 0.1
    # default: data/<corpus>-<tokenizer>[-<vocab_size>]; an s3:// URL is prepared once, copied (mingpt.data.remote)
    prepared_dir: Optional[str] = None
    local_copy: Optional[str] = None  # where a prepared_dir URL is copied to; default data/copies/<name>-<hash>

    def wanted(self, sources: list[Source]) -> dict:
        """What meta.json must say for reuse: the sources, and the settings that change the tokens (others None)."""
        bpe = self.tokenizer == "bpe"
        return {
            "sources": [source.to_dict() for source in sources],
            "tokenizer": self.tokenizer,
            "requested_vocab_size": self.vocab_size if bpe else None,
            "bpe_sample_bytes": self.bpe_sample_bytes if bpe else None,
            "text_field": self.text_field if any(source.records for source in sources) else None,
            "val_fraction": self.val_fraction,
        }
