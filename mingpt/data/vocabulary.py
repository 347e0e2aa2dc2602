"""What a tokenizer learns from the corpus: char, its set of characters (one pass, in the workers); bpe, its merges from
a sample of about `bpe_sample_bytes` drawn across it; a named tiktoken encoding, nothing."""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from mingpt.data import tasks
from mingpt.data.corpus import Source
from mingpt.data.pieces import Piece, sample_pieces
from mingpt.data.pool import WorkerPool
from mingpt.data.progress import Progress
from mingpt.data.settings import PrepareConfig
from mingpt.data.split import SPLIT_SEED, unit_hash


def corpus_chars(pool: WorkerPool, pieces: Iterable[Piece], listed_bytes: int) -> set[str]:
    """Every character of the corpus's `pieces` (about `listed_bytes` in all), found by the workers of `pool`."""
    chars: set[str] = set()
    with Progress("finding characters", listed_bytes) as progress:
        for piece, found in pool.map(tasks.chars, pieces):
            chars.update(found)
            progress.update(piece.size)
    return chars


def bpe_sample(pool: WorkerPool, sources: Sequence[Source], config: PrepareConfig, listed_bytes: int) -> Iterator[str]:
    """About `config.bpe_sample_bytes` of text, in pieces drawn by a seeded hash of their place, so from the
    whole corpus (from its start, when compressed files make the total larger than listed)."""
    budget = config.bpe_sample_bytes
    share = min(1.0, budget / max(listed_bytes, 1))
    chosen = sample_pieces(sources, config.text_field,
                           lambda source, number: unit_hash(SPLIT_SEED, "bpe", source, number) < share)
    taken = 0
    with Progress("training bpe on a sample", min(budget, listed_bytes)) as progress:
        for piece, texts in pool.map(tasks.texts, chosen):
            yield from texts
            taken += piece.size
            progress.update(piece.size)
            if taken >= budget:
                return
