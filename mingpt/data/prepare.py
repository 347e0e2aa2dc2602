"""Prepare data: tokenize a corpus once into a prepared folder (its format: mingpt.data.prepared).

    mingpt-prepare --corpus 'corpus/*.jsonl.gz' --tokenizer bpe --vocab-size 32768 --out data/web
    mingpt-prepare --verify --out data/web      # re-read the corpus: is it still what was prepared?

Preparation streams. The corpus is read in pieces (see mingpt.data.corpus), worker processes tokenize
them, and the tokens are appended to the files in corpus order as they come back, so memory stays
bounded whatever the corpus size. Every document ends with the tokenizer's end-of-text token.
A char vocabulary needs one more pass over the corpus (its set of characters); bpe learns its
merges from a sample of about `bpe_sample_bytes`, drawn across the corpus.

Validation split. One text document (a single file, or the built-in corpus): its last
`val_fraction` of tokens. Several documents: whole documents, drawn in a fixed seeded order; of
text files, the last `val_fraction` of them (at least one); of records (JSONL lines, Parquet rows),
each record whose number across the corpus has a seeded hash below `val_fraction`.

Whether a folder is current is decided from the listing of the sources (paths, sizes, mtimes or
ETags) and the settings, so a start or restart never reads the corpus. `prepare` builds a new
folder under a temporary name and renames it into place, so a reader never sees a half-written
one; it replaces only prepared data or an empty folder, never anything else.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from mingpt.claim import MachineLock
from mingpt.data.corpus import (
    BUILTIN_CORPUS, Piece, Source, as_list, documents, list_sources, read_pieces, sample_pieces,
)
from mingpt.data.prepared import (
    FORMAT, FORMAT_VERSION, META_FILE, TOKEN_FILES, TOKENIZER_FILE, file_sha256, fingerprint, read_meta,
)
from mingpt.data.progress import Progress
from mingpt.data.remote import RemoteFolder
from mingpt.errors import DataError, check_stopped, deferred_stops
from mingpt.storage import local_path, redact
from mingpt.tokenizers import (
    BPETokenizer, CharTokenizer, Tokenizer, check_bpe_vocab_size, is_path, load_tokenizer, tokenizer_from_dict,
    train_tokenizer,
)

log = logging.getLogger(__name__)

SPLIT_SEED = 0  # the validation documents do not change with the training seed
PROGRESS_FILE = "progress.json"  # in a scratch folder: how far tokenizing got, for the next start to go on
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass
class PrepareConfig:
    """What to prepare and how: the settings that `mingpt-prepare` and the trainer's `data` group share."""

    # A file, a folder, a quoted glob, or a list of these; local paths or fsspec URLs (s3://...);
    # .gz/.bz2/.xz/.zst read as such, .jsonl as one document per line, .parquet one per row; hf://datasets/...
    # (Hugging Face Hub); or the built-in python-docs.
    corpus: Any = BUILTIN_CORPUS
    text_field: str = "text"  # the field of each JSONL record, or the Parquet column, that holds the text
    # char, bpe, a tiktoken encoding name (gpt2, cl100k_base, ...), or a folder with a slash in its name
    # (./gpt2) holding a Hugging Face tokenizer or a mingpt snapshot's.
    tokenizer: str = "char"
    vocab_size: Optional[int] = None  # for bpe
    bpe_sample_bytes: int = 100_000_000  # bpe is trained on a sample of this many bytes, drawn across the corpus
    num_workers: int = 0  # processes that tokenize; 0: one per CPU core
    val_fraction: float = 0.1
    # default: data/<corpus>-<tokenizer>[-<vocab_size>]. An object-store URL (s3://...) is prepared by the
    # first node to claim it and copied by every other node into `local_copy` (see mingpt.data.remote).
    prepared_dir: Optional[str] = None
    local_copy: Optional[str] = None  # where a prepared_dir URL is copied to; default data/copies/<name>-<hash>

    def wanted(self, sources: list[Source]) -> dict:
        """What meta.json must say for a prepared folder to be reused: the listed sources and the settings
        that change the tokens (a setting that does not apply, like vocab_size for char, is None)."""
        bpe = self.tokenizer == "bpe"
        return {
            "sources": [source.to_dict() for source in sources],
            "tokenizer": self.tokenizer,
            "requested_vocab_size": self.vocab_size if bpe else None,
            "bpe_sample_bytes": self.bpe_sample_bytes if bpe else None,
            "text_field": self.text_field if any(source.records for source in sources) else None,
            "val_fraction": self.val_fraction,
        }


def prepare(config: PrepareConfig) -> Path:
    """Tokenize the corpus into `config.prepared_dir` (default: see `default_out_dir`) unless it is already
    there; return that folder, or for a prepared_dir URL the local copy of it."""
    if config.tokenizer == "bpe":
        check_bpe_vocab_size(config.vocab_size)
    if not 0.0 <= config.val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {config.val_fraction}")
    out = out_dir(config)
    check_replaceable(out)  # before any reading: refusing late wastes the expensive part
    if is_remote(config.prepared_dir):
        return _prepare_remote(config, RemoteFolder(str(config.prepared_dir)), out)
    sources = list_sources(config.corpus)
    wanted = config.wanted(sources)
    if _matches(out, wanted):
        log.info("reusing prepared data in %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _machine_lock(out.parent) as locked:  # processes on one machine prepare once; the others wait, then reuse
        if _matches(out, wanted):
            log.info("reusing prepared data in %s, prepared by another process", out)
            return out
        meta = {**wanted, "corpus": [redact(entry) for entry in as_list(config.corpus)]}
        # Nobody else on this machine prepares here now: scratch folders of ours were left by a stop or a kill.
        resume = _take_leftover(out, meta) if locked else None
        _Job(config, sources).build(out, meta, resume)
    return out


def _prepare_remote(config: PrepareConfig, remote: RemoteFolder, out: Path) -> Path:
    """Copy the published data at `remote` into `out`; or, where none that matches `config` is published,
    claim it, prepare it into `out` and publish it; or wait for the node that claimed it."""
    wanted = config.wanted(list_sources(config.corpus))
    current = lambda meta: meta is not None and all(meta.get(key) == value for key, value in wanted.items())
    while True:
        meta = remote.meta()
        if current(meta):
            return _copy(remote, meta, out)
        claim = remote.claim(lambda: current(remote.meta()))  # waits while a live node holds it
        if claim is None:
            continue  # published meanwhile
        with claim:
            meta = remote.meta()  # published between the look and the claim?
            if current(meta):
                return _copy(remote, meta, out)
            log.info("preparing %s here (this node claimed it)", redact(remote.url))
            prepare(replace(config, prepared_dir=str(out), local_copy=None))  # reuses a current local copy
            remote.upload(out, read_meta(out))
        return out


def _copy(remote: RemoteFolder, meta: dict, out: Path) -> Path:
    """`out`, made a copy of the published data `meta` describes (unless it is one already)."""
    same = lambda: _matches(out, {"fingerprint": meta["fingerprint"]})
    if same():
        log.info("reusing the local copy %s of %s", out, redact(remote.url))
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _machine_lock(out.parent) as locked:  # processes on one machine copy once
        if same():
            return out
        if locked:
            _remove_leftovers(out.parent)  # copies are not resumed: they take seconds
        tmp = _scratch(out, "tmp")
        tmp.mkdir()
        try:
            remote.download(meta, tmp)
            _publish(tmp, out, meta)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def out_dir(config: PrepareConfig) -> Path:
    """The local prepared folder: `config.prepared_dir`, the local copy of a prepared_dir URL, or the
    folder named after the corpus and tokenizer."""
    location = str(config.prepared_dir) if config.prepared_dir else None
    if is_remote(location):
        return Path(config.local_copy) if config.local_copy else default_copy_dir(location)
    if location:
        return Path(local_path(location)) if location.lower().startswith("file:") else Path(location)
    return default_out_dir(config.corpus, config.tokenizer, config.vocab_size)


def is_remote(location: str | os.PathLike | None) -> bool:
    """Whether a prepared_dir is a URL of a file system other than this machine's (s3://...)."""
    text = str(location or "")
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text)) and not text.lower().startswith("file:")


def default_copy_dir(url: str, root: str = "data/copies") -> Path:
    """`data/copies/<last part of the URL>-<hash of the URL>`: the local copy of a prepared_dir URL."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", redact(url).rstrip("/").rsplit("/", 1)[-1]) or "prepared"
    return Path(root) / f"{name}-{hashlib.sha256(redact(url).encode()).hexdigest()[:8]}"


def default_out_dir(corpus: str | Sequence[str], tokenizer: str, vocab_size: int | None, root: str = "data") -> Path:
    """`data/<corpus name>[-<hash of its location>]-<tokenizer>[-<vocab size>]`, e.g. data/python-docs-char.

    The hash keeps two corpora of the same name (./input.txt, s3://b/input.txt) apart."""
    entries = as_list(corpus)
    first = redact(entries[0]).rstrip("/").split("://")[-1].replace("***@", "")  # never a secret in a folder name
    if re.search(r"[*?[]", first):  # a glob: name it after its folder
        first = re.split(r"[*?[]", first)[0].rstrip("/")
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(first).name.split(".")[0]) or "corpus"
    if entries != [BUILTIN_CORPUS]:
        locations = [entry if "://" in entry or entry == BUILTIN_CORPUS else str(Path(entry).resolve())
                     for entry in entries]
        stem += "-" + hashlib.sha256(json.dumps(locations).encode()).hexdigest()[:8]
    suffix = f"-{vocab_size}" if tokenizer == "bpe" else ""
    return Path(root) / f"{stem}-{_tokenizer_label(tokenizer)}{suffix}"


def _tokenizer_label(tokenizer: str) -> str:
    """The tokenizer in a folder name: itself, or for a tokenizer folder its name and a hash of its location."""
    if not is_path(tokenizer):
        return tokenizer
    location = tokenizer if "://" in tokenizer else str(Path(tokenizer).resolve())
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", tokenizer.rstrip("/").rsplit("/", 1)[-1]) or "tokenizer"
    return f"{name}-{hashlib.sha256(location.encode()).hexdigest()[:8]}"


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Job:
    """One preparation: the tokenizer, then the token files, in a temporary folder published at the end."""

    def __init__(self, config: PrepareConfig, sources: list[Source]):
        self.config, self.sources = config, sources
        self.num_workers = config.num_workers or _cpu_count()
        self.listed_bytes = sum(source.size for source in sources)
        self.tail_split = len(sources) == 1 and not sources[0].records  # one document
        self.context = {
            "names": [redact(source.url) for source in sources],
            "paths": [source.url if source.local_plain else None for source in sources],
            "formats": [source.format for source in sources],
            "text_field": config.text_field,
            "val_fraction": config.val_fraction,
            "val_sources": [] if self.tail_split else _val_files(sources, config.val_fraction),
        }

    def build(self, out: Path, meta: dict, resume: tuple[Path, "_Tokenized"] | None = None) -> None:
        """Prepare into a scratch folder, then publish it as `out`. `resume`: a scratch folder that a stopped
        preparation of the same data left, and how far it got: tokenizing goes on from there."""
        started = time.perf_counter()
        tmp = _scratch(out, "tmp")
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
            dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
            try:
                counts, digests, read = self.tokenize(tok, dtype, tmp, resume[1] if resume else _Tokenized.start(meta))
            except _CorpusChanged:  # the tokens kept, and maybe the tokenizer, came from other text
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
            _publish(tmp, out, meta)
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
        if self.config.tokenizer == "char":  # the vocabulary is the corpus's set of characters: one pass to find it
            with Progress("finding characters", self.listed_bytes) as progress, self.workers() as pool:
                chars: set[str] = set()
                for piece, found in pool.map(_chars, self.pieces()):
                    chars.update(found)
                    progress.update(piece.size)
            if not "".join(chars).strip():
                raise self.empty()
            return CharTokenizer(chars)
        if self.config.tokenizer == "bpe":
            return BPETokenizer.train(self.bpe_sample(), self.config.vocab_size)
        return train_tokenizer(self.config.tokenizer, "")  # a named tiktoken encoding: nothing to learn

    def bpe_sample(self) -> Iterator[str]:
        """About `bpe_sample_bytes` of text, in pieces drawn by a seeded hash of their place, so from the
        whole corpus (from its start, when compressed files make the total larger than listed)."""
        budget = self.config.bpe_sample_bytes
        share = min(1.0, budget / max(self.listed_bytes, 1))
        chosen = sample_pieces(self.sources, self.config.text_field,
                               lambda source, number: _unit_hash(SPLIT_SEED, "bpe", source, number) < share)
        taken = 0
        # Read here, not in workers: decoding costs less than sending the texts back, and rustbpe uses every core.
        with Progress("training bpe on a sample", min(budget, self.listed_bytes)) as progress, \
                self.workers(count=1) as pool:
            for piece, texts in pool.map(_texts, chosen):
                yield from texts
                taken += piece.size
                progress.update(piece.size)
                if taken >= budget:
                    return

    def tokenize(self, tok: Tokenizer, dtype, folder: Path, done: "_Tokenized") -> tuple[dict, dict, int]:
        """Write train.bin and val.bin, going on after the pieces `done` has; return token counts, each
        source's sha256 and the bytes read. After each piece, how far it got is saved in the folder."""
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
                for piece, (written, has_text) in pool.map(_encode, self.pieces(digests, done, read_so_far)):
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
            counts = _move_tail(folder / "train.bin", folder / "val.bin", np.dtype(dtype), self.config.val_fraction)
        return counts, digests, done.read

    def empty(self) -> DataError:
        return DataError(f"the corpus ({', '.join(self.context['names'])}) is empty or only whitespace; give text "
                         "with some content")

    def pieces(self, digests: dict[int, str] | None = None, done: "_Tokenized | None" = None,
               read_so_far: collections.deque | None = None) -> Iterator[Piece]:
        """The corpus in pieces after those `done` has (which are read for `digests` only, and must read as
        they did: else _CorpusChanged), sent lean where workers can read the bytes themselves: a local file
        that is not compressed (so that its bytes do not go through a pipe, which costs more than reading).
        `read_so_far` receives, for each piece sent, the digest of the corpus up to its end."""
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
                raise _CorpusChanged
            if number >= skip:
                if read_so_far is not None:
                    read_so_far.append(mark)
                yield piece.lean() if self.sources[piece.source].local_plain else piece
        if number + 1 < skip:
            raise _CorpusChanged

    @contextmanager
    def workers(self, tok: Tokenizer | None = None, dtype=None, folder: Path | None = None, count: int = 0):
        """`count` (default: num_workers) worker processes that know the sources, and the tokenizer and the
        folder to write tokens to."""
        context = {**self.context, "tokenizer": tok.to_json() if tok else None, "dtype": dtype, "folder": folder}
        with _Pool(count or self.num_workers, context) as pool:
            yield pool


class _Pool:
    """`map` over worker processes, in order, with a bounded number of pieces in flight (memory stays
    bounded however fast the corpus is read). One worker means no processes: the work runs here.

    Workers are forked: they start at once and share this process's memory. They open only corpus
    files and their own part files, and take no lock that a thread of this process (a lease
    renewer) could hold. A worker that dies (killed for memory, say) fails the preparation at once.
    Workers end with this process, however it ends: it kills them when it stops (an error, Ctrl-C,
    SIGTERM), and the kernel kills them when it is killed (see `_start_worker`)."""

    def __init__(self, count: int, context: dict):
        self.count = count
        if count > 1 and not multiprocessing.current_process().daemon:  # a daemon (a pool's worker) has no children
            self.pool = ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork"),
                                            initializer=_start_worker, initargs=(context, os.getpid()))
        else:
            _init_worker(context)
            self.pool = None

    def map(self, fn: Callable[[Piece], object], pieces: Iterable[Piece]) -> Iterator[tuple[Piece, object]]:
        if self.pool is None:
            yield from ((piece, fn(piece)) for piece in pieces)
            return
        pending: collections.deque = collections.deque()
        for piece in pieces:
            with deferred_stops():  # the first submit forks the workers: no Stopped inside the fork's hooks
                pending.append((piece, self.pool.submit(fn, piece)))
            if len(pending) >= 2 * self.count:
                yield self._result(*pending.popleft())
        while pending:
            check_stopped()
            yield self._result(*pending.popleft())

    def _result(self, piece: Piece, future) -> tuple[Piece, object]:
        try:
            return piece, future.result()
        except BrokenProcessPool:
            raise DataError(f"a tokenizing worker process died (killed, or out of memory?); nothing was published: "
                            f"run again, with fewer data.num_workers (--num-workers) than {self.count} if memory "
                            "is short") from None

    def __enter__(self) -> "_Pool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.pool is None:
            return
        if exc_type is None:
            self.pool.shutdown(wait=True)
            return
        # Stopped or failed: the pieces in flight are wanted no more. Kill the workers and reap them here, so that
        # none outlives the preparation; the pool's own shutdown is not waited for, since a pool whose workers
        # were killed under it can block in it (its queue feeder on a full pipe).
        processes = list(self.pool._processes.values())  # Python 3.14 has kill_workers() for this
        for process in processes:
            process.kill()
        for process in processes:
            process.join()
        manager = self.pool._executor_manager_thread  # taken first: shutdown forgets it
        self.pool.shutdown(wait=False, cancel_futures=True)
        # Its manager thread notices the dead workers and closes its wake-up pipe. Let it finish: Python 3.11's
        # exit hook writes to that pipe without a lock, and racing the close it printed "Bad file descriptor".
        if manager is not None:
            manager.join(timeout=10)


# What each worker process knows: set once by `_init_worker`.
_worker: dict = {}


def _start_worker(context: dict, parent: int) -> None:
    """Set up a forked worker: it dies with `parent`, leaves stopping to it, and learns the context."""
    if sys.platform == "linux":  # the kernel SIGKILLs this process when its parent ends, even by SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended between the fork and the prctl
        os._exit(1)
    # Ctrl-C and a SIGTERM sent to the whole process group (torchrun's) are for the parent to act on: it stops
    # the workers itself, so a worker never ends first with a traceback of its own or a "worker died".
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _init_worker(context)


def _init_worker(context: dict) -> None:
    _worker.clear()
    _worker.update(context)
    if context.get("tokenizer"):
        _worker["tok"] = tokenizer_from_dict(json.loads(context["tokenizer"]))
    _worker["val_sources"] = set(context["val_sources"])


def _documents(piece: Piece) -> Iterator[tuple[int, str]]:
    piece = piece.filled(_worker["paths"][piece.source])
    form = _worker["formats"][piece.source]
    return documents(piece, form, _worker["text_field"], _worker["names"][piece.source])


def _chars(piece: Piece) -> set[str]:
    found: set[str] = set()
    for _, text in _documents(piece):
        found.update(text)
    return found


def _texts(piece: Piece) -> list[str]:
    return [text for _, text in _documents(piece)]


def _encode(piece: Piece) -> tuple[dict[str, tuple[Path, int]], bool]:
    """Write the tokens of `piece` by split, each document (a record, the end of a text file) ended
    by end-of-text, to part files (cheaper than sending them back through a pipe); return each split's
    part file and token count, and whether the piece held any text that is not whitespace."""
    tok: Tokenizer = _worker["tok"]
    eot = [] if tok.eot_id is None else [tok.eot_id]
    records = _worker["formats"][piece.source] != "text"
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    has_text = False
    for number, text in _documents(piece):
        has_text = has_text or not text.isspace() and bool(text)
        if records:  # by the record's number across the corpus: the same split whatever the container
            split = "val" if _unit_hash(SPLIT_SEED, "record", number) < _worker["val_fraction"] else "train"
        else:
            split = "val" if piece.source in _worker["val_sources"] else "train"
        parts[split].append(tok.encode_array(text))
        if records or piece.last:
            parts[split].append(np.asarray(eot, dtype=np.int64))
    written = {}
    for split, arrays in parts.items():
        if arrays:
            path = _worker["folder"] / f"part-{piece.source}-{piece.offset}.{split}"
            ids = np.concatenate(arrays).astype(_worker["dtype"])
            ids.tofile(path)
            written[split] = (path, len(ids))
    return written, has_text


def _unit_hash(*key) -> float:
    """A number in [0, 1) from `key`, the same on every machine and Python (unlike hash())."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _val_files(sources: Sequence[Source], val_fraction: float) -> list[int]:
    """The text files (one document each) of the validation split: the last `val_fraction` of them in
    a seeded order, at least one where there are two or more and no records to draw from."""
    text_files = [i for i, source in enumerate(sources) if not source.records]
    count = round(val_fraction * len(text_files))
    if val_fraction > 0 and count == 0 and len(text_files) >= 2 and len(text_files) == len(sources):
        count = 1
    order = np.random.default_rng(SPLIT_SEED).permutation(len(text_files))
    return sorted(text_files[i] for i in order[len(order) - count:]) if count else []


def _move_tail(train: Path, val: Path, dtype: np.dtype, val_fraction: float) -> dict:
    """Move the last `val_fraction` of the tokens of `train` to `val` (a one-document corpus)."""
    total = train.stat().st_size // dtype.itemsize
    n_val = int(total * val_fraction)
    with open(train, "r+b") as src, open(val, "wb") as dst:
        src.seek((total - n_val) * dtype.itemsize)
        shutil.copyfileobj(src, dst, 1 << 20)
        src.truncate((total - n_val) * dtype.itemsize)
    return {"train": total - n_val, "val": n_val}


def _machine_lock(folder: Path) -> MachineLock:
    """The lock that lets one process of this machine at a time prepare or copy data into `folder`. Where the
    file system has no flock it is not held, and `_publish` keeps concurrent preparation correct, only slower."""
    return MachineLock(folder.resolve(), "preparing data in")


def _scratch(out: Path, kind: str) -> Path:
    """A new name for a scratch folder next to `out`: it names this machine and process."""
    return out.parent / f".{out.name}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname())


def _leftovers(folder: Path) -> list[Path]:
    """The scratch folders that this machine's preparations left in `folder` when stopped or killed (not
    another machine's, not host "node1-b"'s for host "node1"). Only looked at with the machine lock held:
    then no preparation of this machine is running there."""
    ours = re.compile(rf"^\..+\.(tmp|stale)-{re.escape(_host())}-\d+-[0-9a-f]{{8}}$")
    return sorted(path for path in folder.iterdir() if ours.match(path.name))


def _remove_leftovers(folder: Path, keep: Path | None = None) -> None:
    for path in _leftovers(folder):
        if path != keep:
            log.info("removing %s, left by a preparation that was stopped", path)
            shutil.rmtree(path, ignore_errors=True)


def _take_leftover(out: Path, meta: dict) -> tuple[Path, "_Tokenized"] | None:
    """The scratch folder of a stopped preparation of the same data into `out` that got furthest, and how
    far; every other scratch folder this machine left beside `out` is removed."""
    best = None
    for path in _leftovers(out.parent):
        done = _Tokenized.load(path, meta) if path.name.startswith(f".{out.name}.tmp-") else None
        if done and (best is None or done.pieces > best[1].pieces):
            best = (path, done)
    _remove_leftovers(out.parent, keep=best[0] if best else None)
    return best


class _CorpusChanged(Exception):
    """A resumed preparation read the corpus pieces it had done, and they read differently now."""


@dataclass
class _Tokenized:
    """How far tokenizing got (saved as PROGRESS_FILE in the scratch folder after every piece): the pieces
    done, the bytes of each token file that hold their tokens, and what `meta` they were prepared for.

    A resume trusts none of it unchecked: the file is sealed by a hash of its fields, the token files'
    kept bytes must hash as recorded, and the corpus's pieces done must read as they did (`_Job.pieces`)."""

    meta: dict
    pieces: int = 0
    read: int = 0
    any_text: bool = False
    sizes: dict = field(default_factory=lambda: {"train": 0, "val": 0})  # bytes of each token file kept
    counts: dict = field(default_factory=lambda: {"train": 0, "val": 0})  # tokens in them
    tokens_sha256: dict = field(default_factory=dict)  # of those bytes
    corpus_sha256: str = ""  # of the corpus read up to the end of the pieces done
    hashers: dict = field(default_factory=lambda: {"train": hashlib.sha256(), "val": hashlib.sha256()}, repr=False)

    @classmethod
    def start(cls, meta: dict) -> "_Tokenized":
        return cls(json.loads(json.dumps(meta)))

    def append(self, split: str, out, part: Path, count: int) -> None:
        """Append the part file `part` of `count` tokens to the open token file `out`, and delete it."""
        data = part.read_bytes()
        out.write(data)
        self.hashers[split].update(data)
        self.sizes[split] += len(data)
        self.counts[split] += count
        part.unlink()

    def add(self, size: int, has_text: bool, corpus_sha256: str) -> None:
        """Count one more piece done, whose end the corpus has read to with digest `corpus_sha256`."""
        self.pieces, self.read, self.any_text = self.pieces + 1, self.read + size, self.any_text or has_text
        self.corpus_sha256 = corpus_sha256
        self.tokens_sha256 = {split: hasher.hexdigest() for split, hasher in self.hashers.items()}

    def fields(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "hashers"}

    def save(self, folder: Path) -> None:
        record = self.fields()
        record["seal"] = _seal(record)
        tmp = folder / f".{PROGRESS_FILE}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, folder / PROGRESS_FILE)

    @classmethod
    def load(cls, folder: Path, meta: dict) -> "_Tokenized | None":
        """The progress saved in `folder`, if it is sealed, for `meta`, and its token files begin with the
        bytes it counts; else None (the preparation starts over)."""
        try:
            record = json.loads((folder / PROGRESS_FILE).read_bytes()[:PROGRESS_LIMIT])
            if not isinstance(record, dict) or record.pop("seal", None) != _seal(record):
                return None
            done = cls(**record)
        except (OSError, ValueError, TypeError):
            return None
        numbers = [done.pieces, done.read, *done.sizes.values(), *done.counts.values()]
        if done.meta != json.loads(json.dumps(meta)) or not (folder / TOKENIZER_FILE).is_file() \
                or set(done.sizes) != {"train", "val"} or set(done.counts) != {"train", "val"} \
                or not all(isinstance(n, int) and n >= 0 for n in numbers):
            return None
        for split in ("train", "val"):
            if not _begins_with(folder / f"{split}.bin", done.sizes.get(split), done.tokens_sha256.get(split),
                                done.hashers[split]):
                return None
        return done


PROGRESS_LIMIT = 1 << 20  # bytes of a progress file read at most: it holds a few numbers and the settings


def _seal(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _begins_with(path: Path, size, digest, hasher) -> bool:
    """Whether the file `path` holds at least `size` bytes whose sha256 is `digest`; `hasher` has read them."""
    if not isinstance(size, int) or size < 0 or not isinstance(digest, str):
        return False
    try:
        with open(path, "rb") as f:
            left = size
            while left:
                block = f.read(min(left, 1 << 20))
                if not block:
                    return False
                hasher.update(block)
                left -= len(block)
    except OSError:
        return False
    return hasher.hexdigest() == digest


def _sha256_or_none(path: Path) -> str | None:
    try:
        return file_sha256(path)
    except FileNotFoundError:
        return None


def _matches(directory: Path, wanted: dict) -> bool:
    try:
        meta = read_meta(directory)
    except DataError:
        return False
    return all(meta.get(key) == value for key, value in wanted.items())


def check_replaceable(out: Path) -> None:
    """DataError unless `out` is new, an empty folder, or prepared data (which `prepare` may replace).

    Anything else may be a user's files: preparing there would delete them."""
    try:
        os.stat(out)
    except FileNotFoundError:
        return
    except OSError as e:  # ELOOP: a loop of symbolic links at it or above it; ENOTDIR: a file above it
        raise DataError(f"cannot use {out} as the prepared-data folder: {e.strerror}; choose another folder "
                        "(mingpt-prepare --out, data.prepared_dir or data.local_copy)") from None
    if not out.is_dir():
        raise DataError(f"the prepared-data folder {out} is a file; choose an empty or new folder "
                        "(mingpt-prepare --out, or data.prepared_dir for training)")
    if not any(out.iterdir()):
        return
    try:
        meta = json.loads((out / META_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:  # any version of ours may be replaced
        raise DataError(
            f"{out} is not empty and holds no mingpt prepared data (no valid {META_FILE}); preparing there would "
            "replace its files, so choose an empty or new folder (mingpt-prepare --out, or data.prepared_dir "
            "for training)"
        )


def _publish(tmp: Path, out: Path, meta: dict) -> None:
    """Move the finished folder `tmp` (described by `meta`) to `out`, replacing stale data but never a
    concurrent twin, nor a folder that is not prepared data."""
    for _ in range(3):
        try:
            tmp.rename(out)
            return
        except OSError:  # `out` exists and is not empty
            if _matches(out, {"fingerprint": meta["fingerprint"]}):
                return  # another process prepared the very same tokens first; theirs are as good
            check_replaceable(out)  # again: files may have appeared since `prepare` checked
            stale = _scratch(out, "stale")
            try:
                out.rename(stale)
            except FileNotFoundError:
                continue  # someone else moved it meanwhile; try again
            shutil.rmtree(stale, ignore_errors=True)
    raise DataError(f"could not replace {out}; is another process preparing different data there?")


def verify(directory: str | os.PathLike) -> list[str]:
    """Re-list and re-read the corpus a folder was prepared from, and re-read the folder's own files; what
    differs, one line each (empty: current)."""
    meta = read_meta(directory)
    recorded = [Source(**s) for s in meta["sources"]]
    problems = [f"{Path(directory) / name}: damaged, it is not what was prepared (sha256 {digest[:12]}...); delete "
                f"{directory} and prepare the data again"
                for name, digest in meta["sha256"].items() if _sha256_or_none(Path(directory) / name) != digest]
    try:
        listed = {source.url: source for entry in meta["corpus"] for source in list_sources(entry)}
    except DataError as e:
        return [str(e)]
    for source in recorded:
        now = listed.get(source.url)
        if now is None:
            problems.append(f"{redact(source.url)}: no longer part of the corpus")
        elif (now.size, now.version) != (source.size, source.version):
            problems.append(f"{redact(source.url)}: size or version changed ({source.size} B, {source.version} -> "
                            f"{now.size} B, {now.version})")
    problems += [f"{redact(url)}: new in the corpus" for url in listed if url not in {s.url for s in recorded}]
    digests: dict[int, str] = {}
    present = [s for s in recorded if s.url in listed]
    with Progress("verifying", sum(s.size for s in present)) as progress:
        for piece in read_pieces(present, meta.get("text_field") or "text", digests=digests):
            progress.update(len(piece.data))
    expected = dict(zip((s.url for s in recorded), meta["source_sha256"]))
    for i, source in enumerate(present):
        if digests[i] != expected[source.url]:
            problems.append(f"{redact(source.url)}: content differs from what was prepared (sha256 {expected[source.url][:12]}"
                            f"... -> {digests[i][:12]}...)")
    return problems
