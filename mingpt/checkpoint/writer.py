"""Writing snapshots off the training thread, and noticing when writing keeps failing."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from mingpt.checkpoint.lease import LeaseLostError
from mingpt.checkpoint.store import SnapshotError, SnapshotStore
from mingpt.storage import explain_storage_error

log = logging.getLogger(__name__)


class SnapshotWriter:
    """Saves snapshots, in the background (`async_save`) or in the caller's thread, one at a time. A failed save is
    logged and leaves no manifest (it never looks committed); the next interval tries again. After `max_failures`
    failures in a row, `check` raises SnapshotError: the trainer stops every process together."""

    def __init__(self, store: SnapshotStore, async_save: bool = True, max_failures: int = 3):
        self.store = store
        self.async_save = async_save
        self.max_failures = max_failures
        self.failures = 0  # consecutive; 0 after a success
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None

    def save(self, step: int, tensors: dict[str, Any], files: dict[str, bytes], info: dict) -> None:
        """Save a snapshot of `step`; `tensors` must be CPU copies that nobody changes afterwards."""
        self.submit(step, lambda: self.store.save(step, tensors, files, info))

    def submit(self, step: int, save: Callable[[], object]) -> None:
        """Run `save`, which writes the snapshot of `step` from copies nobody changes afterwards."""
        self.wait()
        if self.async_save:
            self._thread = threading.Thread(target=self._save, args=(step, save), name=f"snapshot-{step}", daemon=True)
            self._thread.start()
        else:
            self._save(step, save)

    def wait(self) -> None:
        """Block until no save is in flight."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def failed_too_often(self) -> bool:
        """True when the last `max_failures` saves all failed (as far as finished saves tell)."""
        return self.failures >= self.max_failures

    def check(self, final: bool = False) -> None:
        """SnapshotError when too many saves failed in a row, or (`final`) when the last save failed."""
        if self.failed_too_often or (final and self.failures):
            what = "the last snapshot" if final and not self.failed_too_often else f"{self.failures} snapshots in a row"
            raise SnapshotError(
                f"{what} could not be written to {self.store.url}; last error: {self.last_error}. Fix the "
                "storage, then run the same command to resume from the newest committed snapshot"
            )

    def _save(self, step: int, save: Callable[[], object]) -> None:
        started = time.perf_counter()
        try:
            save()
            self.failures = 0
            log.debug("snapshot of step %d took %.2fs", step, time.perf_counter() - started)
        except LeaseLostError as e:  # not a storage failure: the trainer stops the job at the next step
            log.error("%s", e)
        except Exception as e:
            self.failures += 1
            self.last_error = explain_storage_error(e, self.store.local)
            log.error("SNAPSHOT FAILED at step %d (%d in a row, the job stops after %d): %s",
                      step, self.failures, self.max_failures, self.last_error)
