"""Reading files that other programs wrote (Hugging Face folders), for the tokenizers and mingpt.interop: `read_file`
turns any failure to parse one (a truncated download, another format) into one line naming the file and the fix."""

from __future__ import annotations

from typing import Callable, TypeVar

from fsspec.spec import AbstractFileSystem

from mingpt.errors import MinGPTError, TokenizerError
from mingpt.storage import check_regular_file, is_local, parse_json, redact

T = TypeVar("T")

AGAIN = "the file is truncated or damaged: download or copy it again"


class NotReadable(ValueError):
    """What a parse function raises with a reason in our own words."""


def read_file(fs: AbstractFileSystem, path: str, parse: Callable[[bytes], T], advice: str = AGAIN,
              error: type[MinGPTError] = TokenizerError) -> T:
    """`parse` of the bytes of `path`; a failure to parse them as `error`, one line naming the file. Only a
    regular file is read: a FIFO would block for ever, /dev/zero would fill the memory, a folder fails."""
    name = path if is_local(fs) else fs.unstrip_protocol(path)
    try:
        check_regular_file(fs, path)
    except OSError as e:
        raise error(str(e)) from None  # names the file, without credentials
    data = fs.cat_file(path)
    try:
        return parse(data)
    except MinGPTError:
        raise
    except Exception as e:  # parsers raise many types: JSONDecodeError, UnicodeDecodeError, SafetensorError, ...
        raise error(f"cannot read {redact(name)} ({_reason(e)}); {advice}") from None


def json_object(data: bytes) -> dict:
    """A JSON file whose top level is an object, as every configuration and vocabulary file is."""
    payload = parse_json(data)
    if not isinstance(payload, dict):
        raise NotReadable(f"a JSON {type(payload).__name__}, not an object")
    return payload


def _reason(e: Exception) -> str:
    """The gist of a parser's message: libraries append paragraphs of advice that does not fit here."""
    if isinstance(e, NotReadable):
        return str(e)
    lines = str(e).strip().splitlines()
    text = lines[0].split(". ")[0] if lines else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
