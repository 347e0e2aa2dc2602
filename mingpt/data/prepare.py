"""Prepare data: tokenize a corpus once into a prepared folder (mingpt.data.prepared; usage: docs/data.md). This module
decides what to do: reuse a current folder, go on from what a stopped preparation left, prepare anew (mingpt.data.job,
one process of this machine at a time), or, for a prepared_dir URL, copy it or prepare and publish it
(mingpt.data.remote). Whether a folder is current is decided from the sources' listing and the settings, so a start
never reads the corpus; a new folder is renamed into place (mingpt.data.scratch), never seen half-written."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from mingpt.claim import MachineLock
from mingpt.data.corpus import BUILTIN_CORPUS, Source, as_list, list_sources
from mingpt.data.job import Job
from mingpt.data.pieces import read_pieces
from mingpt.data.prepared import META_FILE, file_sha256, read_meta
from mingpt.data.progress import Progress
from mingpt.data.remote import RemoteFolder
from mingpt.data.resume import take_leftover
from mingpt.data.scratch import check_replaceable, matches, publish, remove_leftovers, scratch
from mingpt.data.settings import PrepareConfig
from mingpt.errors import DataError
from mingpt.storage import local_path, redact
from mingpt.tokenizers import check_bpe_vocab_size, is_path

log = logging.getLogger(__name__)


def prepare(config: PrepareConfig) -> Path:
    """Tokenize the corpus into `out_dir(config)` unless it is already there; that folder (a URL's local copy)."""
    if config.tokenizer == "bpe":
        check_bpe_vocab_size(config.vocab_size)
    if not 0.0 <= config.val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {config.val_fraction}")
    out = out_dir(config)
    check_replaceable(out)  # before any reading: refusing late wastes the expensive part
    check_outside_the_corpus(out, config.corpus)
    if is_remote(config.prepared_dir):
        return _prepare_remote(config, RemoteFolder(str(config.prepared_dir)), out)
    sources = list_sources(config.corpus)
    wanted = config.wanted(sources)
    if matches(out, wanted):
        log.info("reusing prepared data in %s", out)
        return out
    _make_folder(out.parent, config)
    with _machine_lock(out.parent) as locked:  # processes on one machine prepare once; the others wait, then reuse
        if matches(out, wanted):
            log.info("reusing prepared data in %s, prepared by another process", out)
            return out
        meta = {**wanted, "corpus": [redact(entry) for entry in as_list(config.corpus)]}
        # Nobody else on this machine prepares here now: scratch folders of ours were left by a stop or a kill.
        resume = take_leftover(out, meta) if locked else None
        Job(config, sources).build(out, meta, resume)
    return out


def check_outside_the_corpus(out: Path, corpus: str | Sequence[str]) -> None:
    """DataError where `out` is inside a local folder of the corpus: the next preparation would read it as corpus."""
    where = out.resolve()
    for entry in as_list(corpus):
        folder = Path(entry).expanduser()
        if entry != BUILTIN_CORPUS and "://" not in entry and folder.is_dir() and \
                (where == folder.resolve() or folder.resolve() in where.parents):
            raise DataError(f"the prepared-data folder {out} is inside the corpus folder {entry}: its files would be "
                            "read as corpus the next time; give one outside it (mingpt-prepare --out, or "
                            "data.prepared_dir)")


def _prepare_remote(config: PrepareConfig, remote: RemoteFolder, out: Path) -> Path:
    """Copy the matching published data into `out`; or claim it, prepare and publish it; or wait for who claimed it."""
    wanted = config.wanted(list_sources(config.corpus))
    current = lambda meta: meta is not None and all(meta.get(key) == value for key, value in wanted.items())
    while True:
        meta = remote.meta()
        if current(meta):
            return _copy(remote, meta, out, config)
        claim = remote.claim(lambda: current(remote.meta()))  # waits while a live node holds it
        if claim is None:
            continue  # published meanwhile
        with claim:
            meta = remote.meta()  # published between the look and the claim?
            if current(meta):
                return _copy(remote, meta, out, config)
            log.info("preparing %s here (this node claimed it)", redact(remote.url))
            prepare(replace(config, prepared_dir=str(out), local_copy=None))  # reuses a current local copy
            remote.upload(out, read_meta(out))
        return out


def _copy(remote: RemoteFolder, meta: dict, out: Path, config: PrepareConfig) -> Path:
    """`out`, made a copy of the published data `meta` describes (unless it is one already)."""
    same = lambda: matches(out, {"fingerprint": meta["fingerprint"]})
    if same():
        log.info("reusing the local copy %s of %s", out, redact(remote.url))
        return out
    _make_folder(out.parent, config)
    with _machine_lock(out.parent) as locked:  # processes on one machine copy once
        if same():
            return out
        if locked:
            remove_leftovers(out.parent)  # copies are not resumed: they take seconds
        tmp = scratch(out, "tmp")
        tmp.mkdir()
        try:
            remote.download(meta, tmp)
            publish(tmp, out, meta)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _make_folder(folder: Path, config: PrepareConfig) -> None:
    """`folder`, made where it is not there; DataError, before any work, where this user cannot write there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        setting = "data.local_copy (--local-copy" if is_remote(config.prepared_dir) else "data.prepared_dir (--out"
        raise DataError(f"cannot write prepared data into {folder.absolute()} ({e.strerror}); set {setting} of "
                        "mingpt-prepare) to a folder you can write, or run from one") from None


def out_dir(config: PrepareConfig) -> Path:
    """The local prepared folder: `prepared_dir`, the local copy of a prepared_dir URL, or one named after the data."""
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
    """`data/<corpus name>[-<location hash>]-<tokenizer>[-<vocab size>]`: the hash keeps same-named corpora apart."""
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


def _machine_lock(folder: Path) -> MachineLock:
    """The lock that lets one process of this machine at a time prepare or copy data into `folder`. Where the
    file system has no flock it is not held, and `publish` keeps concurrent preparation correct, only slower."""
    return MachineLock(folder.resolve(), "preparing data in")


def _sha256_or_none(path: Path) -> str | None:
    try:
        return file_sha256(path)
    except FileNotFoundError:
        return None


def verify(directory: str | os.PathLike) -> list[str]:
    """Re-list and re-read a prepared folder's corpus and files; what differs, one line each (empty: current)."""
    meta = read_meta(directory)
    recorded, expected = _recorded_sources(meta, directory)
    problems = [f"{Path(directory) / name}: damaged, it is not what was prepared (sha256 {digest[:12]}...); delete "
                f"{directory} and prepare the data again"
                for name, digest in meta["sha256"].items() if _sha256_or_none(Path(directory) / name) != digest]
    try:
        listed = {source.url: source for entry in _corpus_entries(meta) for source in list_sources(entry)}
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
    for i, source in enumerate(present):
        if digests[i] != expected[source.url]:
            problems.append(f"{redact(source.url)}: content differs from what was prepared (sha256 {expected[source.url][:12]}"
                            f"... -> {digests[i][:12]}...)")
    return problems


def _recorded_sources(meta: dict, directory: str | os.PathLike) -> tuple[list[Source], dict[str, str]]:
    """The sources meta records and each one's content sha256; DataError where not as mingpt-prepare writes them."""
    try:
        recorded = [Source(**source) for source in meta["sources"]]
        digests = meta["source_sha256"]
        if not all(isinstance(s.url, str) and type(s.size) is int and isinstance(s.version, str) for s in recorded) \
                or not isinstance(digests, list) or len(digests) != len(recorded) \
                or not all(isinstance(digest, str) for digest in digests):
            raise TypeError
    except (KeyError, TypeError):
        raise DataError(f"{Path(directory) / META_FILE} is damaged: its sources or their sha256 are not as "
                        f"mingpt-prepare writes them; delete {directory} and prepare the data again") from None
    return recorded, dict(zip((s.url for s in recorded), digests))


def _corpus_entries(meta: dict) -> list[str]:
    corpus = meta.get("corpus")
    entries = corpus if isinstance(corpus, list) else [corpus]
    if not all(isinstance(entry, str) for entry in entries):
        raise DataError(f"the description's corpus is not as mingpt-prepare writes it ({corpus!r:.80}); prepare the "
                        "data again")
    return entries
