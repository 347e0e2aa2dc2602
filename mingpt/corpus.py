"""Reading a text corpus: a local path, any fsspec URL (`s3://...`), or the built-in default.

The built-in corpus, `python-docs`, is the Python language reference that every CPython
install carries as text (`pydoc_data.topics`, about 0.47 MB of English prose and code),
so the default job runs on a fresh machine with no network and no downloads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from mingpt.errors import DataError, MinGPTError
from mingpt.storage import explain_storage_error, is_local, open_fs, redact

BUILTIN_CORPUS = "python-docs"


@dataclass(frozen=True)
class Corpus:
    name: str  # what the user gave: a path, a URL or BUILTIN_CORPUS
    text: str
    sha256: str  # of the UTF-8 bytes; tells prepared data whether it is still current
    num_bytes: int


def read_corpus(source: str) -> Corpus:
    """Read a UTF-8 text corpus; raise DataError saying what to do when it is missing, empty or not text."""
    raw = _builtin_bytes() if source == BUILTIN_CORPUS else _read_bytes(source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"corpus {redact(source)} is not UTF-8 text (bad byte at offset {e.start}); "
            "convert it to UTF-8, e.g. `iconv -f LATIN1 -t UTF-8`"
        ) from None
    if not text.strip():
        raise DataError(f"corpus {redact(source)} is empty; give a text file with some content")
    return Corpus(name=source, text=text, sha256=hashlib.sha256(raw).hexdigest(), num_bytes=len(raw))


def _read_bytes(source: str) -> bytes:
    try:
        fs, path = open_fs(source)
    except MinGPTError as e:  # an unknown protocol, or its package is missing
        raise DataError(f"{e}; fix data.corpus (or --corpus of mingpt-prepare)") from None
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(
            f"corpus {redact(source)} does not exist; give a path or URL of a UTF-8 text file, "
            f"or {BUILTIN_CORPUS!r} for the built-in corpus"
        ) from None
    except IsADirectoryError:
        raise DataError(f"corpus {redact(source)} is a directory; give one text file") from None
    except Exception as e:  # storage clients raise many types (OSError, botocore, aiohttp): explain any
        reason = explain_storage_error(e, local=is_local(fs), setting="data.corpus")
        raise DataError(f"cannot read the corpus {redact(source)} (data.corpus, or --corpus of mingpt-prepare): "
                        f"{reason}") from None


def _builtin_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics)).encode("utf-8")
