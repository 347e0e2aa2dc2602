"""HellaSwag's validation file: where it comes from, and its examples as lm-evaluation-harness's `hellaswag` task
reads them.

The file is the public JSONL of the HellaSwag authors (one JSON object a line: activity_label, ctx_a, ctx_b,
endings, label). A local path is read as it is. A URL is fetched once into a folder that only this user can write
(`cache_folder`), checked against the file's known sha256 where it is known, and read from there afterwards.

Each example becomes a query and its choices exactly as lm-evaluation-harness's lm_eval/tasks/hellaswag/utils.py
makes them (`preprocess`, `to_example`); mingpt.metrics.scoring scores them.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from mingpt.errors import MinGPTError, one_line
from mingpt.storage import open_fs, parse_json, private_folder, read_own_file, redact

PUBLIC_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
# The public file's digest, from Hugging Face datasets' record of it (datasets/hellaswag/dataset_infos.json,
# download_checksums: 12,246,618 bytes), for both of GitHub's addresses of it.
KNOWN_SHA256 = {
    PUBLIC_URL: "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588",
    "https://github.com/rowanz/hellaswag/raw/master/data/hellaswag_val.jsonl":
        "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588",
}
MAX_BYTES = 256 << 20  # the validation file is 12 MB: a larger download is not it
FETCH_TIMEOUT_S = 120  # an http(s) fetch, whole: a server that never answers must not hold a job's start


class HellaSwagUnavailable(MinGPTError):
    """The file cannot be had here (no network, no copy): a training job goes on without the metric."""


@dataclass(frozen=True)
class Example:
    """One HellaSwag example as lm-evaluation-harness scores it: each choice is a continuation of the query,
    after a space."""

    query: str
    choices: tuple[str, ...]
    label: int


def preprocess(text: str) -> str:
    """lm-evaluation-harness's cleaning of HellaSwag's text: WikiHow's "[title]" ends a sentence, its other
    bracketed tags go, and a double space left behind becomes one."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def to_example(record: dict) -> Example:
    """The query and choices of one record of the file (lm-evaluation-harness's `process_docs`)."""
    context = record["ctx_a"] + " " + record["ctx_b"].capitalize()
    return Example(query=preprocess(record["activity_label"] + ": " + context),
                   choices=tuple(preprocess(ending) for ending in record["endings"]), label=int(record["label"]))


def parse_examples(data: bytes, source: str) -> list[Example]:
    """The examples of a HellaSwag JSONL file; MinGPTError naming the first line that is not one. Blank lines are
    skipped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MinGPTError(f"{source} is not UTF-8 text (byte {e.start}); give HellaSwag's JSONL file") from None
    examples = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            examples.append(to_example(_record(line, f"{source} line {number}")))
    if not examples:
        raise MinGPTError(f"{source} holds no examples; give HellaSwag's JSONL file (hellaswag_val.jsonl)")
    return examples


def _record(line: str, where: str) -> dict:
    """The JSON object of one line, its fields checked; MinGPTError saying what is wrong with it."""
    try:
        record = parse_json(line)
    except ValueError as e:
        raise MinGPTError(f"{where} is not JSON ({e}); give HellaSwag's JSONL file, one example a line") from None
    if not isinstance(record, dict):
        raise MinGPTError(f"{where} is not a JSON object; give HellaSwag's JSONL file, one example a line")
    for key in ("activity_label", "ctx_a", "ctx_b"):
        if not isinstance(record.get(key), str):
            raise MinGPTError(f"{where} has no text field {key!r}; each example needs activity_label, ctx_a, ctx_b, "
                              "endings and label")
    endings = record.get("endings")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise MinGPTError(f"{where}: 'endings' must be a list of at least two texts")
    label = record.get("label")
    if isinstance(label, str) and label.isdigit():  # Hugging Face's copy stores it as text
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise MinGPTError(f"{where}: 'label' must be the index of the right ending, 0 to {len(endings) - 1}; got "
                          f"{record.get('label')!r} (the test split's labels are hidden: use the validation file)")
    return record


def load_examples(source: str) -> list[Example]:
    """The examples of `source`, a local path or a URL (fetched into the cache once); HellaSwagUnavailable where
    a URL can be neither read from the cache nor fetched, MinGPTError for a file that is not HellaSwag's."""
    if is_local(source):
        return parse_examples(_read_local(source), source)
    return parse_examples(cached_copy(source), redact(source))


def is_local(source: str) -> bool:
    return "://" not in source or source.startswith("file:")


def _read_local(source: str) -> bytes:
    path = open_fs(source)[1] if source.startswith("file:") else source
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block: refused below
    except OSError as e:
        raise MinGPTError(f"cannot read {path}: {e.strerror}; give the path of HellaSwag's JSONL file, or its "
                          f"URL ({PUBLIC_URL})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MinGPTError(f"{path} is not a regular file; give the path of HellaSwag's JSONL file")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise MinGPTError(f"{path} is larger than {MAX_BYTES >> 20} MB: not HellaSwag's validation file")
    return data


# -- the cache: a folder only this user can write, no link followed --------------------------------------------------


def cache_folder() -> Path:
    """$XDG_CACHE_HOME/mingpt/hellaswag (default ~/.cache): fetched files, by URL."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mingpt" / "hellaswag"


def cache_path(url: str) -> Path:
    """Where the file fetched from `url` is kept: its name, after a digest of the URL (two URLs of one name)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1].split("?")[0]) or "hellaswag.jsonl"
    return cache_folder() / f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{name}"


def cached_copy(url: str) -> bytes:
    """The bytes of the file at `url`: the cached copy where there is one, else fetched and cached. Checked
    against the file's known sha256 (KNOWN_SHA256) either way."""
    path = cache_path(url)
    _check_cache_folder(path.parent)
    data = _read_cached(path)
    if data is None:
        data = _fetch(url, path)
        _check_digest(data, url, f"the file fetched from {redact(url)}", "the URL serves another file")
        _write_cached(path, data)
    else:
        _check_digest(data, url, f"the cached copy {path}", "remove it, and it is fetched again")
    return data


def _check_cache_folder(folder: Path) -> None:
    """Make the folder (0700) where it is missing; MinGPTError unless it is a folder (not a link) of this user's
    that no one else can write (one made by hand with mkdir, 0755, will do: the file is public, and checked)."""
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


def _fetch(url: str, path: Path) -> bytes:
    """The file at `url`; HellaSwagUnavailable where it cannot be had (a URL that cannot be used at all, an unknown
    protocol, is a MinGPTError: a mistake to fix, not a network to wait for)."""
    fs, remote = open_fs(url, _http_options(url))
    try:
        with fs.open(remote, "rb") as f:
            return f.read(MAX_BYTES + 1)
    except Exception as e:  # no network, a proxy, HTTP 404: every storage client raises its own types
        raise HellaSwagUnavailable(f"HellaSwag: cannot fetch {redact(url)} ({redact(one_line(e))}); put the file at "
                                   f"{path}, or give the path of a copy (trainer.hellaswag_data, or mingpt-eval's "
                                   "--data)") from None


def _http_options(url: str) -> dict:
    """fsspec's HTTP file system waits 5 minutes for a server that does not answer (aiohttp's default)."""
    if not url.startswith(("http://", "https://")):
        return {}
    import aiohttp  # fsspec's HTTP client

    return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S, sock_connect=10)}}


def _check_digest(data: bytes, url: str, what: str, advice: str) -> None:
    expected = KNOWN_SHA256.get(url)
    if len(data) > MAX_BYTES:
        raise MinGPTError(f"{what} is larger than {MAX_BYTES >> 20} MB: not HellaSwag's validation file; {advice}")
    if expected and hashlib.sha256(data).hexdigest() != expected:
        raise MinGPTError(f"{what} is not HellaSwag's validation file (sha256 {hashlib.sha256(data).hexdigest()}, "
                          f"expected {expected}); {advice}")


def _write_cached(path: Path, data: bytes) -> None:
    """Write the file whole under a new name of its own, then rename it into place: a reader sees all of it or
    nothing, and processes that fetch at once each put a whole copy there."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
