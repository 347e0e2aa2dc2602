"""The layout of a run folder (`snapshot.dir`, a local path or any fsspec URL): the one place that knows where each
thing lives (docs/ARCHITECTURE.md lists them). A run on an object store keeps TensorBoard's files on this machine."""

from __future__ import annotations

import os
import posixpath
import re

from mingpt.errors import MinGPTError
from mingpt.storage import is_local, open_fs, redact


class RunDir:
    """One run folder: its file system, its path there, and the places of what a run writes."""

    OWNER = "owner"
    COMPILE_CACHE = "compile-cache"
    METRICS = "metrics.jsonl"
    WANDB_STATE = "wandb_run.json"
    TENSORBOARD = "tensorboard"

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = redact(url.rstrip("/"))  # for messages: credentials never shown
        self.fs, path = open_fs(url.rstrip("/"), storage_options)
        if self.fs.protocol in ("memory", ("memory",)):
            raise MinGPTError(f"cannot keep a run in {self.url}: memory:// is a file system of this process alone, "
                              "and what it holds is gone when the process ends; give a local folder or "
                              "s3://bucket/prefix")
        self.path = path.rstrip("/")
        self.local = is_local(self.fs)  # object stores have no folders, and no appends

    def __repr__(self) -> str:
        return f"RunDir({self.url!r})"

    def join(self, *names: str) -> str:
        """The path of `names` under the run folder, for the file system `fs`."""
        return "/".join([self.path, *names])

    def url_of(self, *names: str) -> str:
        """What to show a user for `names` under the run folder."""
        return "/".join([self.url, *names])

    owner = property(lambda self: self.join(self.OWNER))
    compile_cache = property(lambda self: self.join(self.COMPILE_CACHE))
    metrics = property(lambda self: self.join(self.METRICS))
    wandb_state = property(lambda self: self.join(self.WANDB_STATE))

    def tensorboard(self) -> str:
        """A local folder for TensorBoard's event files, which it appends to (object stores cannot)."""
        if self.local:
            return self.join(self.TENSORBOARD)
        # Named after the URL without its scheme; "/" first, so that ".." cannot climb out of ./tensorboard.
        below = posixpath.normpath("/" + re.sub(r"^[\w+.-]+://", "", self.url)).lstrip("/")
        return os.path.abspath(os.path.join(self.TENSORBOARD, below))
