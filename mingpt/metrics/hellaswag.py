"""HellaSwag's validation file: where it comes from, and its examples as lm-evaluation-harness's `hellaswag` task
reads them (`preprocess`, `to_example`); mingpt.metrics.scoring scores them. See docs/evaluation.md.

A URL is fetched once into a folder only this user can write (`cache_folder`), checked against the known sha256,
and kept only once its examples parsed. Every input is bounded before it costs much: MAX_BYTES a file, MAX_LINE_CHARS
a line (refused before it is parsed or reaches a tokenizer), FETCH_TIMEOUT_S a whole fetch."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from fsspec.asyn import get_loop, sync
from fsspec.implementations.local import LocalFileSystem

from mingpt.errors import MinGPTError, one_line
from mingpt.storage import open_fs, parse_json, private_folder, read_head, read_own_file, redact, replace_atomically

PUBLIC_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
# The public file's digest (Hugging Face datasets' dataset_infos.json records it), at both of GitHub's addresses.
KNOWN_SHA256 = {
    PUBLIC_URL: "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588",
    "https://github.com/rowanz/hellaswag/raw/master/data/hellaswag_val.jsonl":
        "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588",
}
MAX_BYTES = 64 << 20  # every process of a job holds the examples: bound them well above the real file
MAX_LINE_CHARS = 1 << 16  # an example of the file takes a few thousand characters at most
FETCH_TIMEOUT_S = 120  # a whole fetch, all its requests: a server that never answers must not hold a job's start
GIVE_THE_FILE = "give HellaSwag's validation JSONL (hellaswag_val.jsonl), one example a line, or its URL"


class HellaSwagUnavailable(MinGPTError):
    """The file cannot be had here (no network, no copy): a training job goes on without the metric."""


@dataclass(frozen=True)
class Example:
    """One HellaSwag example as lm-evaluation-harness scores it: each choice continues the query, after a space."""

    query: str
    choices: tuple[str, ...]
    label: int


def load_examples(source: str, setting: str, fetch: bool = True) -> list[Example]:
    """The examples of `source` (a path or URL), errors naming `setting`. HellaSwagUnavailable where a URL is neither
    cached nor fetched (`fetch`); MinGPTError for a file that is not HellaSwag's."""
    try:
        if is_local(source):
            return parse_examples(_read_local(source), source)
        return _examples_at(source, fetch)
    except MinGPTError as e:
        raise type(e)(f"{setting}: {e}") from None


def is_local(source: str) -> bool:
    return "://" not in source or source.startswith("file:")


def _read_local(source: str) -> bytes:
    """A local file's bytes (a link is followed); MinGPTError unless it is a regular file of at most MAX_BYTES."""
    path = open_fs(source)[1] if source.startswith("file:") else source
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block: refused below
    except OSError as e:
        raise MinGPTError(f"cannot read {path}: {e.strerror}; {GIVE_THE_FILE}") from None
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise MinGPTError(f"{path} is {'a folder' if stat.S_ISDIR(kind) else 'not a regular file'}; "
                              f"{GIVE_THE_FILE}")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise MinGPTError(f"{path} is larger than {MAX_BYTES >> 20} MB: not HellaSwag's validation file; "
                          f"{GIVE_THE_FILE}")
    return data


def parse_examples(data: bytes, source: str, advice: str = GIVE_THE_FILE) -> list[Example]:
    """The examples of a HellaSwag JSONL file, blank lines skipped; MinGPTError naming the first bad line."""
    examples = []
    for number, line in enumerate(_lines(data), 1):
        where = f"{source} line {number}"
        if len(line) > MAX_LINE_CHARS:
            raise MinGPTError(f"{where} is longer than {MAX_LINE_CHARS:,} characters: not a HellaSwag example; "
                              f"{advice}")
        if _UNDECODED.search(line):
            raise MinGPTError(f"{where} is not UTF-8 text; {advice}")
        if line.strip():
            examples.append(to_example(_record(line, where, advice)))
    if not examples:
        raise MinGPTError(f"{source} holds no examples; {advice}")
    return examples


_UNDECODED = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of bytes that are not UTF-8


def _lines(data: bytes) -> Iterator[str]:
    """The lines of `data`, each decoded to at most MAX_LINE_CHARS + 1 characters (a longer line's rest comes next)."""
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")
    while line := text.readline(MAX_LINE_CHARS + 1):
        yield line.removesuffix("\n")


def _record(line: str, where: str, advice: str) -> dict:
    """The JSON object of one line, its fields checked; MinGPTError saying what is wrong with it."""
    try:
        record = parse_json(line)
    except ValueError as e:
        raise MinGPTError(f"{where} is not JSON ({e}); {advice}") from None
    if not isinstance(record, dict):
        raise MinGPTError(f"{where} is not a JSON object; {advice}")
    for key in ("activity_label", "ctx_a", "ctx_b"):
        if not isinstance(record.get(key), str):
            raise MinGPTError(f"{where} has no text field {key!r}; each example needs activity_label, ctx_a, ctx_b, "
                              f"endings and label; {advice}")
    endings = record.get("endings")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise MinGPTError(f"{where}: 'endings' must be a list of at least two texts; {advice}")
    label = record.get("label")
    if isinstance(label, str) and label.isdigit():  # Hugging Face's copy stores it as text
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise MinGPTError(f"{where}: 'label' must be the index of the right ending, 0 to {len(endings) - 1}; got "
                          f"{record.get('label')!r} (the test split's labels are hidden: use the validation file); "
                          f"{advice}")
    return record


def to_example(record: dict) -> Example:
    """The query and choices of one record of the file (lm-evaluation-harness's `process_docs`)."""
    context = record["ctx_a"] + " " + record["ctx_b"].capitalize()
    return Example(query=preprocess(record["activity_label"] + ": " + context),
                   choices=tuple(preprocess(ending) for ending in record["endings"]), label=int(record["label"]))


def preprocess(text: str) -> str:
    """lm-evaluation-harness's cleaning of HellaSwag's text (WikiHow's bracketed tags, double spaces)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


# -- a URL: the cache, a folder only this user can write, no link followed --------------------------------------------


def cache_folder() -> Path:
    """$XDG_CACHE_HOME/mingpt/hellaswag (default ~/.cache): fetched files, by URL."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mingpt" / "hellaswag"


def cache_path(url: str) -> Path:
    """Where the file fetched from `url` is kept: its name, after a digest of the URL (two URLs of one name)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1].split("?")[0]) or "hellaswag.jsonl"
    return cache_folder() / f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{name}"


def _examples_at(url: str, fetch: bool) -> list[Example]:
    """The examples of the file at `url`: cached, else fetched (where `fetch`) and cached once they parse."""
    path = cache_path(url)
    _check_cache_folder(path.parent)
    cached = _read_cached(path)
    if cached is not None:
        what, advice = f"the cached copy {path}", f"remove it, and it is fetched again from {redact(url)}"
        _check_digest(cached, url, what, advice)
        return parse_examples(cached, what, advice)
    if not fetch:
        raise HellaSwagUnavailable(f"{redact(url)} has no copy at {path}, and is not fetched here; put the file "
                                   "there, or give the path of a copy")
    data = _download(url, path)
    what, advice = f"the file fetched from {redact(url)}", f"it is not kept; {GIVE_THE_FILE}"
    _check_digest(data, url, what, advice)
    examples = parse_examples(data, what, advice)
    replace_atomically(LocalFileSystem(), str(path), data)  # whole or not at all, whoever fetches at once
    return examples


def _check_cache_folder(folder: Path) -> None:
    """Make the folder (0700) where missing; MinGPTError unless it is a folder (not a link) of this user's that no one
    else can write (0755 will do: the file is public, and checked)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    if not private_folder(folder, others=0o022):
        found = os.lstat(folder)
        raise MinGPTError(f"the cache folder {folder} is not a folder that only this user can write (mode "
                          f"{stat.filemode(found.st_mode)}, owner uid {found.st_uid}); remove it, or set "
                          "XDG_CACHE_HOME to a folder of your own")


def _read_cached(path: Path) -> bytes | None:
    """The cached file's bytes, or None where there is none; never through a link, never waiting on a FIFO."""
    try:
        return read_own_file(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:  # a link, a FIFO, another user's file, one too large
        raise MinGPTError(f"cannot read the cached copy {path} ({e.strerror or e}); remove it") from None


def _download(url: str, path: Path) -> bytes:
    """The file at `url`, at most MAX_BYTES, within FETCH_TIMEOUT_S for http(s) and async object stores (others, such
    as hf://, keep their clients' timeouts). HellaSwagUnavailable where it cannot be had; MinGPTError for an unusable
    URL or a file too large: a mistake to fix, not a network to wait for."""
    try:
        if url.startswith(("http://", "https://")):
            data = sync(get_loop(), _http_get, url, timeout=FETCH_TIMEOUT_S)  # on fsspec's loop, cancelled there
        else:
            data = _read_url(url)
    except MinGPTError:
        raise
    except Exception as e:  # no network, a proxy, HTTP 404: every storage client raises its own types
        late = isinstance(e, (TimeoutError, asyncio.TimeoutError))  # (one type from Python 3.11)
        reason = f"not done within {FETCH_TIMEOUT_S} s" if late else redact(one_line(e))
        raise HellaSwagUnavailable(f"cannot fetch {redact(url)} ({reason}); put the file at {path}, or give the "
                                   "path of a copy") from None
    if len(data) > MAX_BYTES:
        raise MinGPTError(f"the file at {redact(url)} is larger than {MAX_BYTES >> 20} MB: not HellaSwag's "
                          f"validation file; {GIVE_THE_FILE}")
    return data


async def _http_get(url: str) -> bytes:
    """At most MAX_BYTES + 1 bytes of the body of a GET of `url` (redirects followed); an error status raises."""
    import aiohttp  # fsspec's HTTP client

    async with aiohttp.ClientSession() as session, session.get(url) as response:
        response.raise_for_status()
        data = bytearray()
        async for chunk in response.content.iter_any():
            data += chunk
            if len(data) > MAX_BYTES:
                break
        return bytes(data)


def _read_url(url: str) -> bytes:
    """At most MAX_BYTES + 1 bytes of the file at an fsspec URL other than http(s)."""
    fs, remote = open_fs(url)
    if fs.async_impl:
        return sync(fs.loop, fs._cat_file, remote, start=0, end=MAX_BYTES + 1, timeout=FETCH_TIMEOUT_S)
    return read_head(fs, remote, MAX_BYTES + 1)


def _check_digest(data: bytes, url: str, what: str, advice: str) -> None:
    expected = KNOWN_SHA256.get(url)
    if expected and hashlib.sha256(data).hexdigest() != expected:
        raise MinGPTError(f"{what} is not HellaSwag's validation file (sha256 {hashlib.sha256(data).hexdigest()}, "
                          f"expected {expected}); {advice}")
