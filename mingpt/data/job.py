"""One preparation of a corpus: its tokenizer, then its token files, built in a scratch folder and published. Workers
tokenize the corpus in pieces, appended in corpus order as they come back, so memory stays bounded whatever the corpus
size; after every piece, how far it got is saved (mingpt.data.resume), and a stopped preparation goes on from there."""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from mingpt.data import tasks
from mingpt.data.corpus import Source
from mingpt.data.pieces import Piece, read_pieces
from mingpt.data.pool import WorkerPool
from mingpt.data.prepared import (
    FORMAT, FORMAT_VERSION, META_FILE, TOKEN_FILES, TOKENIZER_FILE, file_sha256, fingerprint, token_dtype,
)
from mingpt.data.progress import Progress
from mingpt.data.resume import PROGRESS_FILE, CorpusChanged, Tokenized
from mingpt.data.scratch import publish, scratch
from mingpt.data.settings import PrepareConfig
from mingpt.data.split import move_tail, val_files
from mingpt.data.vocabulary import bpe_sample, corpus_chars
from mingpt.errors import DataError
from mingpt.storage import redact
from mingpt.tokenizers import BPETokenizer, CharTokenizer, Tokenizer, load_tokenizer, train_tokenizer

log = logging.getLogger(__name__)


WORKERS_PER_CORE = 4  # the most tokenizing processes per core: a few more than one hide the reading of S3


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Job:
    """One preparation: the tokenizer, then the token files, in a scratch folder published at the end."""

    def __init__(self, config: PrepareConfig, sources: list[Source]):
        self.config, self.sources = config, sources
        self.num_workers = min(config.num_workers or _cpu_count(), WORKERS_PER_CORE * _cpu_count())
        if self.num_workers < config.num_workers:
            log.warning("data.num_workers=%d: using %d, %d per CPU core of this machine (tokenizing is CPU work: more "
                        "processes would only take memory)", config.num_workers, self.num_workers, WORKERS_PER_CORE)
        self.listed_bytes = sum(source.size for source in sources)
        self.tail_split = len(sources) == 1 and not sources[0].records  # one document
        self.context = {
            "names": [redact(source.url) for source in sources],
            "paths": [source.url if source.local_plain else None for source in sources],
            "formats": [source.format for source in sources],
            "text_field": config.text_field,
            "val_fraction": config.val_fraction,
            "val_sources": [] if self.tail_split else val_files(sources, config.val_fraction),
        }

    def build(self, out: Path, meta: dict, resume: tuple[Path, Tokenized] | None = None) -> None:
        """Prepare into a scratch folder, published as `out`; `resume`: a stopped preparation's folder and progress."""
        started = time.perf_counter()
        tmp = scratch(out, "tmp")
        if resume:
            resume[0].rename(tmp)
            for path in tmp.iterdir():  # part files of pieces in flight, a half-written progress file
                if path.name not in (TOKENIZER_FILE, "train.bin", "val.bin", PROGRESS_FILE):
                    path.unlink()
        else:
            tmp.mkdir()
        keep = False
        try:
            if resume:
                tok = load_tokenizer(str(tmp / TOKENIZER_FILE))
            else:
                tok = self.make_tokenizer()
                tok.save(str(tmp / TOKENIZER_FILE))
            dtype = np.dtype(token_dtype(tok.vocab_size)).type
            try:
                counts, digests, read = self.tokenize(tok, dtype, tmp, resume[1] if resume else Tokenized.start(meta))
            except CorpusChanged:  # the tokens kept, and maybe the tokenizer, came from other text
                log.info("the corpus changed since the preparation was stopped; starting over")
                shutil.rmtree(tmp, ignore_errors=True)  # nothing of it is kept, however the new start ends
                return self.build(out, meta)
            meta = {
                "format": FORMAT, "version": FORMAT_VERSION, **meta,
                "source_sha256": [digests[i] for i in range(len(self.sources))],
                "corpus_bytes": read, "split": "tail" if self.tail_split else "documents",
                "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "dtype": np.dtype(dtype).name,
                "train_tokens": counts["train"], "val_tokens": counts["val"],
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            if meta["val_fraction"] > 0 and not counts["val"] and not self.tail_split:
                raise DataError(f"no document of the corpus fell into the validation split (val_fraction "
                                f"{self.config.val_fraction}); give more documents or a larger val_fraction")
            (tmp / PROGRESS_FILE).unlink()
            meta["sha256"] = {name: file_sha256(tmp / name) for name in TOKEN_FILES}
            meta["fingerprint"] = fingerprint(meta["sha256"])
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
            publish(tmp, out, meta)
        except KeyboardInterrupt:  # stopped (Ctrl-C, SIGTERM): what is tokenized stays for the next start
            keep = (tmp / PROGRESS_FILE).exists()
            if keep:
                log.info("stopped; what was tokenized is kept in %s, and the next start goes on from there", tmp)
            raise
        finally:
            if not keep:
                shutil.rmtree(tmp, ignore_errors=True)
        seconds = time.perf_counter() - started
        log.info("prepared %s: %d train + %d val tokens, %s, %.1f MB in %.1fs (%.1f MB/s, %d workers) -> %s",
                 ", ".join(meta["corpus"]), meta["train_tokens"], meta["val_tokens"], tok.describe(),
                 read / 1e6, seconds, read / 1e6 / max(seconds, 1e-9), self.num_workers, out)

    def make_tokenizer(self) -> Tokenizer:
        """The tokenizer, learnt from the corpus where it has something to learn (see mingpt.data.vocabulary)."""
        if self.config.tokenizer == "char":
            with self.workers() as pool:
                chars = corpus_chars(pool, self.pieces(), self.listed_bytes)
            if not "".join(chars).strip():
                raise self.empty()
            return CharTokenizer(chars)
        if self.config.tokenizer == "bpe":
            return BPETokenizer.train(self.bpe_sample(), self.config.vocab_size)
        return train_tokenizer(self.config.tokenizer, "")  # a named tiktoken encoding: nothing to learn

    def bpe_sample(self) -> Iterator[str]:
        """The text that bpe learns from (see `vocabulary.bpe_sample`)."""
        # Read here, not in workers: decoding costs less than sending the texts back, and rustbpe uses every core.
        with self.workers(count=1) as pool:
            yield from bpe_sample(pool, self.sources, self.config, self.listed_bytes)

    def tokenize(self, tok: Tokenizer, dtype, folder: Path, done: Tokenized) -> tuple[dict, dict, int]:
        """Write the token files after the pieces `done` has, saving progress per piece; counts, digests, bytes read."""
        digests: dict[int, str] = {}
        files = {split: open(folder / f"{split}.bin", "r+b" if done.pieces else "wb") for split in done.sizes}
        try:
            for split, f in files.items():
                f.truncate(done.sizes[split])  # tokens of pieces in flight when it stopped
                f.seek(0, os.SEEK_END)
            if done.pieces:
                log.info("going on with a preparation that was stopped: %.1f MB of the corpus were tokenized",
                         done.read / 1e6)
            with Progress("tokenizing", self.listed_bytes) as progress, self.workers(tok, dtype, folder) as pool:
                progress.update(done.read)
                read_so_far: collections.deque = collections.deque()
                for piece, (written, has_text) in pool.map(tasks.encode, self.pieces(digests, done, read_so_far)):
                    for split, (part, count) in written.items():
                        done.append(split, files[split], part, count)
                    done.add(piece.size, has_text, read_so_far.popleft())
                    for f in files.values():
                        f.flush()  # before the progress that counts these tokens
                    done.save(folder)
                    progress.update(piece.size)
        finally:
            for f in files.values():
                f.close()
        if not done.any_text:
            raise self.empty()
        counts = done.counts
        if self.tail_split:
            counts = move_tail(folder / "train.bin", folder / "val.bin", np.dtype(dtype), self.config.val_fraction)
        return counts, digests, done.read

    def empty(self) -> DataError:
        return DataError(f"the corpus ({', '.join(self.context['names'])}) is empty or only whitespace; give text "
                         "with some content")

    def pieces(self, digests: dict[int, str] | None = None, done: Tokenized | None = None,
               read_so_far: collections.deque | None = None) -> Iterator[Piece]:
        """The corpus in pieces after those `done` has (read for `digests` only; CorpusChanged where they read otherwise
        now), lean where workers read a local plain file themselves. `read_so_far` gets each one's corpus digest."""
        digests = {} if digests is None else digests
        skip = done.pieces if done else 0
        finished, current, number = hashlib.sha256(), None, -1  # the digests of the sources read through
        for number, piece in enumerate(read_pieces(self.sources, self.config.text_field, digests)):
            if piece.source != current:
                if current is not None:
                    finished.update(digests[current].encode())
                current = piece.source
            so_far = finished.copy()
            so_far.update(digests[current].encode())  # the running digest of the source being read
            mark = so_far.hexdigest()
            if number + 1 == skip and mark != done.corpus_sha256:
                raise CorpusChanged
            if number >= skip:
                if read_so_far is not None:
                    read_so_far.append(mark)
                yield piece.lean() if self.sources[piece.source].local_plain else piece
        if number + 1 < skip:
            raise CorpusChanged

    def workers(self, tok: Tokenizer | None = None, dtype=None, folder: Path | None = None,
                count: int = 0) -> WorkerPool:
        """`count` (default: num_workers) workers that know the sources, the tokenizer and the folder for tokens."""
        context = {**self.context, "tokenizer": tok.to_json() if tok else None, "dtype": dtype, "folder": folder}
        return WorkerPool(count or self.num_workers, tasks.setup, context)
