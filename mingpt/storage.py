"""Storage shared by corpora and snapshots: opening a path, file: URL or fsspec URL, and explaining failures; and, on
this machine's disk, folders and files of this user's alone, for what is kept where other users share (/dev/shm, /tmp,
a cache). Every message built here is safe to log: URLs lose their credentials, and storage options (which may hold
keys) are never part of a message."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from fsspec import available_protocols
from fsspec.core import url_to_fs
from fsspec.spec import AbstractFileSystem

from mingpt.errors import MinGPTError


# scheme://user:password@host or scheme://user@host, anywhere in a text. A password may hold "/" (AWS secrets do) and
# "@": it runs to the last "@" before a space (hiding more, never less); a user name holds neither "/" nor ":".
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)(?:[^\s/@:]*:\S*|[^\s/@:]*)@")
# Query parameters that carry a secret: X-Amz-Signature/Credential/Security-Token, Azure SAS's sig, token=, api_key=...
_SECRET_PARAMETER = re.compile(r"([?&;][^=&#\s]*(?:sig|token|credential|secret|password|key|auth)[^=&#\s]*=)[^&#\s]*",
                               re.IGNORECASE)
# Object stores: a user and password in their URL would become part of the bucket name, and so of every message.
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")
LOCAL_SCHEMES = ("file", "local")


def parse_json(data: str | bytes) -> Any:
    """json.loads for what storage or a peer gives: ValueError also for arrays nested thousands deep."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to be read") from None


def redact(text: object) -> str:
    """`text` without the credentials its URLs carry: user, password and secret query values become ***."""
    text = _USERINFO.sub(r"\1***@", str(text))
    return _SECRET_PARAMETER.sub(r"\1***", text)


def open_fs(url: str, storage_options: dict | None = None) -> tuple[AbstractFileSystem, str]:
    """The file system and path of `url`: a local path, a file: URL (RFC 8089) or an fsspec URL. MinGPTError for one it
    cannot use: an unknown protocol, a file: URL naming another machine, credentials in an object store's URL."""
    url = str(url)
    if "::" in url:  # an fsspec chain (simplecache::s3://...): each link is checked as a URL of its own
        for link in url.split("::")[1:]:
            _check_link(link)
        _check_link(url.split("::")[0], chained=True)
    else:
        url = _check_link(url)
    try:
        return url_to_fs(url, **(storage_options or {}))
    except (ValueError, ImportError) as e:  # "Protocol not known: foo", or its package is not installed
        raise MinGPTError(
            f"cannot open {redact(url)}: {redact(e)}. Use a local path, file://, or s3://bucket/prefix "
            "(other fsspec protocols need their package installed)"
        ) from None
    except Exception as e:  # file systems that connect when made (ftp, sftp), to a server that is not there
        raise MinGPTError(f"cannot open {redact(url)}: {explain_storage_error(e, setting='the URL')}") from None


def _check_link(url: str, chained: bool = False) -> str:
    """`url` as open_fs uses it (a file: URL becomes its path); MinGPTError for credentials where they would
    be shown, or a file: URL that names another machine."""
    scheme, userinfo = _scheme(url), _USERINFO.match(url)
    rest = url[len(scheme) + 1:]
    if scheme in OBJECT_STORES and not (rest[2:] if rest.startswith("//") else rest.lstrip("/")).split("/", 1)[0]:
        raise MinGPTError(f"cannot use {redact(url)}: it names no bucket; give {scheme}://BUCKET/PREFIX")
    if scheme and scheme not in LOCAL_SCHEMES and scheme in available_protocols() and not rest.startswith("//"):
        raise MinGPTError(f"cannot use {redact(url)}: it is neither a path nor a URL ({scheme}://...); did you mean "
                          f"{redact(scheme + '://' + rest.lstrip('/'))}?")  # else: a local folder named "s3:"
    if scheme in LOCAL_SCHEMES:
        path = local_path(url)
        if chained and path != url:
            raise MinGPTError(f"cannot use {redact(url)} in an fsspec chain: give the plain path there")
        return path
    if scheme in OBJECT_STORES and userinfo:
        raise MinGPTError(
            f"cannot use {redact(url)}: credentials do not go in the URL, where they would be shown and logged; "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for S3, or give them in storage_options")
    elif userinfo and ("/" in userinfo[0].split("://", 1)[1] or userinfo[0].count("@") > 1):
        # URL parsers would end the host part at the first "/" or take the text after an "@" for the host
        raise MinGPTError(f"cannot use {redact(url)}: its password holds a '/' or an '@', which end the host part "
                          "of a URL; write each '/' in it as %2F and each '@' as %40")
    return url


def _scheme(url: str) -> str:
    """The scheme of `url` in lower case ("s3", "file"); "" for a plain path."""
    found = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", url)
    return found[1].lower() if found else ""


class RedactingFilter(logging.Filter):
    """Passes every record, traceback included, through `redact`, so that no credential a library logs is shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:  # the traceback text too, formatted here so that it can be redacted
            message += "\n" + logging.Formatter().formatException(record.exc_info)
            record.exc_info, record.exc_text = None, None
        record.msg, record.args = redact(message), None
        return True


def local_path(url: str) -> str:
    """The local path a file: URL names, as RFC 8089 reads it (file:///abs, file://localhost/abs, file:/abs), decoded;
    MinGPTError for any other form (another host, credentials, a relative path, a query), never a guess."""
    try:
        parts = urlsplit(url)
    except ValueError:  # a malformed host, such as "[x"
        parts = None
    if _USERINFO.match(url):  # not parts.netloc: a password may hold "/", which ends the netloc early
        problem = "it carries a user name or password"
    elif parts is None:
        problem = "its host is malformed"
    elif parts.netloc.lower() not in ("", "localhost"):
        problem = "it names another machine"
    elif not parts.path.startswith("/"):
        problem = "its path is not absolute"
    elif parts.query or parts.fragment or url.endswith(("?", "#")):
        problem = "it has a query or fragment (percent-encode ? as %3F and # as %23)"
    else:
        return unquote(parts.path)
    raise MinGPTError(f"cannot use {redact(url)}: {problem}. file:// URLs name a file on this machine: use "
                      "file:///path or file://localhost/path, or a plain path")


def is_local(fs: AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "file" in protocols or "local" in protocols


def explain_storage_error(e: BaseException, local: bool = False, setting: str = "snapshot.dir") -> str:
    """A one-line reason for a storage failure and what to do, naming `setting`; never credentials."""
    name = type(e).__name__
    detail = redact(e)  # clients echo the URL or request they failed on
    text = f"{name}: {detail}"
    if local and isinstance(e, PermissionError):
        return f"permission denied ({detail}); make the folder writable for this user or fix {setting}"
    if local and isinstance(e, (FileExistsError, NotADirectoryError)):
        return f"it, or a folder above it, is not a folder ({detail}): a file, or a link to nothing; fix {setting}"
    if isinstance(e, FileNotFoundError) and "bucket" in detail.lower():
        return f"the bucket does not exist ({detail}); create it or fix {setting}"
    if isinstance(e, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text \
            or "SignatureDoesNotMatch" in text or "Forbidden" in text:
        return (f"access denied ({detail}); check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE / "
                "instance role) and that they grant access to this bucket and prefix")
    if name == "NoCredentialsError":
        return "no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") \
            or isinstance(e, (ConnectionError, TimeoutError)):
        return (f"cannot reach the storage endpoint ({detail}); check the network, and AWS_ENDPOINT_URL_S3 or "
                "storage_options.client_kwargs.endpoint_url for S3-compatible stores")
    return f"{text}; check that {setting} names a reachable folder or bucket prefix"


def read_head(fs: AbstractFileSystem, path: str, limit: int) -> bytes:
    """The first `limit` bytes of `path`, all of a smaller file, in one ranged read. An object store answers a
    range of an empty object with 416 ("not satisfiable", an OSError): that is an empty file, not a failure."""
    try:
        return fs.cat_file(path, start=0, end=limit)
    except OSError as e:
        if e.errno == errno.EINVAL and "range" in str(e).lower() and fs.size(path) == 0:
            return b""
        raise


# Locally a file is durable once it and its folder entry are fsynced, and a rename or link makes it appear at once.
# Object stores: every PUT is atomic and durable when it returns; `If-None-Match: *` is their O_EXCL.


class _DurableLocalFile(io.FileIO):
    """A local file that is flushed to the disk (fsync) when it is closed without error."""

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            os.fsync(self.fileno())
        return super().__exit__(exc_type, *rest)


def check_regular_file(fs: AbstractFileSystem, path: str) -> None:
    """OSError unless `path` is a regular file or absent: a FIFO would block forever, a folder or device is not it."""
    try:
        kind = fs.info(path).get("type")
    except FileNotFoundError:
        return
    if kind != "file":
        raise OSError(f"{redact(path)} is not a regular file ({kind}); move it away")


def open_exclusive(fs: AbstractFileSystem, path: str):
    """A new binary file to stream into; FileExistsError where `path` exists (at open locally, at the final PUT on
    object stores), so two writers never mix their bytes. Locally, its bytes are on the disk once it is closed."""
    return _DurableLocalFile(path, "x") if is_local(fs) else fs.open(path, "xb")


def sync_folder(fs: AbstractFileSystem, path: str) -> None:
    """Make the names in a local folder durable (new files, renames, links); nothing to do elsewhere."""
    if is_local(fs):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def create_exclusive(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a small file whole where nothing is at `path` (else FileExistsError): locally, fsynced under a temporary
    name and hard-linked to `path`, so it never holds partial content; on object stores, one `If-None-Match: *` PUT."""
    if not is_local(fs):
        fs.pipe_file(path, data, mode="create")
        return
    tmp = _durable_temporary(path, data)
    try:
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
    sync_folder(fs, os.path.dirname(path))


def replace_atomically(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a small file whole, replacing what is there; a reader sees the old or the new bytes."""
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    os.replace(_durable_temporary(path, data), path)
    sync_folder(fs, os.path.dirname(path))


def _durable_temporary(path: str, data: bytes) -> str:
    """`data` in a new, fsynced file beside local `path`, under a hidden temporary name; that name."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
    with _DurableLocalFile(tmp, "x") as f:
        f.write(data)
    return tmp


def private_folder(path: Path | str, others: int = 0o077) -> bool:
    """Whether `path` is a folder (not a link) of this user's granting others none of `others`: by default nothing (a
    memory tier); 0o022, no writing (a cache of checked files). What is found in shared /dev/shm or /tmp is checked."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and found.st_mode & others == 0


def others_may_replace_in(folder: Path | str) -> str | None:
    """Why another user could rename, remove or replace what this user makes in `folder` (None: only root can): it, or
    a folder above, is another user's, or others may write in it and it lacks the sticky bit of /tmp and /dev/shm."""
    path = Path(os.path.realpath(folder))
    for place in (path, *path.parents):
        try:
            found = os.stat(place)
        except OSError as e:
            return f"{place} cannot be looked at ({e.strerror or e})"
        if found.st_uid not in (0, os.getuid()):
            return f"{place} belongs to another user (uid {found.st_uid})"
        if found.st_mode & 0o022 and not found.st_mode & stat.S_ISVTX:
            return f"other users may write in {place}, which has no sticky bit"
    return None


def own_file(path: Path) -> os.stat_result:
    """lstat of `path`; OSError unless it is a regular file of this user's."""
    found = os.lstat(path)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
        raise OSError(f"not a regular file of this user's (mode {stat.filemode(found.st_mode)}, owner {found.st_uid})")
    return found


def open_own_file(path: Path, flags: int) -> int:
    """A descriptor of `path` opened with `flags` (O_CREAT makes it 0600), never through a link, never waiting on a
    FIFO; OSError unless it is a regular file of this user's."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
        os.close(fd)
        raise OSError(f"{path} is not a regular file of this user's")
    return fd


def read_own_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of this user's, at most `limit`; never through a link, never waiting on a FIFO."""
    return _read_whole(open_own_file(path, os.O_RDONLY), path, limit)


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, whoever owns it (a folder of prepared data may be
    shared); never through a link, never waiting on a FIFO. OSError otherwise, FileNotFoundError where none is."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return _read_whole(fd, path, limit)


def _read_whole(fd: int, path: Path, limit: int) -> bytes:
    try:
        if os.fstat(fd).st_size > limit:
            raise OSError(f"{path} holds more than {limit} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)
