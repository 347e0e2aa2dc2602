"""Worker processes that map a function over corpus pieces: results in order, few pieces in flight (bounded memory
however fast the corpus is read), workers ended at once when the work stops. Workers are forked (they start at once and
share this memory): they open only corpus files and their own part files, and take no lock that a thread here (a lease
renewer) could hold. A worker that dies fails the work at once; workers end with this process however it ends."""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Iterator

from mingpt.errors import DataError, check_stopped, deferred_stops
from mingpt.processes import signal_when_parent_dies


class WorkerTraceback(Exception):
    """Where a worker raised an exception: its traceback, as the cause of the exception raised here."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class _Task:
    """One piece handed to the pool, and what came back for it."""

    piece: Any
    done: bool = False
    ok: bool = True
    value: Any = None  # the result, or the exception raised
    trace: str = ""

    def outcome(self) -> Any:
        if not self.ok:
            raise self.value from WorkerTraceback(self.trace)
        return self.value


@dataclass(eq=False)
class _Worker:
    process: multiprocessing.Process
    conn: Connection
    task: _Task | None = None  # the piece it works on; None while idle

    def stop(self, at_once: bool) -> None:
        """Tell it to end (an idle worker returns), or kill it: `at_once`, or where it is gone already."""
        if not at_once:
            try:
                self.conn.send(None)
                return
            except OSError:
                pass
        self.process.kill()


class WorkerPool:
    """`map` over `count` worker processes, each set up by `setup(context)`; one worker or one piece: none, all here."""

    def __init__(self, count: int, setup: Callable[[Any], None], context: Any):
        self.count, self.setup, self.context = count, setup, context
        self.workers: list[_Worker] = []
        self.inline = count <= 1 or multiprocessing.current_process().daemon  # a daemon may have no children

    def map(self, fn: Callable[[Any], Any], pieces: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
        """(piece, fn(piece)) for each piece, in order; an exception of `fn` is raised at its piece's turn."""
        pieces = iter(pieces)
        if not self.workers:  # one piece (a small corpus) is worked here: forking workers would cost more than it
            first = list(itertools.islice(pieces, 2))
            pieces, self.inline = itertools.chain(first, pieces), self.inline or len(first) < 2
            if self.inline:
                self.setup(self.context)
            else:
                with deferred_stops():  # a fork's hooks (logging's) would print a Stopped raised in them, and drop it
                    self._start()
        if self.inline:
            yield from ((piece, fn(piece)) for piece in pieces)
            return
        tasks: collections.deque[_Task] = collections.deque()  # in flight, oldest first
        waiting: collections.deque[_Task] = collections.deque()  # of those, the ones no worker has yet
        while True:
            while len(tasks) < 2 * self.count and (piece := next(pieces, _END)) is not _END:
                tasks.append(_Task(piece))
                waiting.append(tasks[-1])
            self._hand_out(fn, waiting)
            if not tasks:
                return
            if tasks[0].done:
                task = tasks.popleft()
                yield task.piece, task.outcome()
            else:
                check_stopped()  # a stop whose Stopped was swallowed where it was raised (a __del__)
                self._receive()

    def _start(self) -> None:
        fork = multiprocessing.get_context("fork")
        for _ in range(self.count):
            ours, theirs = fork.Pipe()
            process = fork.Process(target=_serve, args=(theirs, self.setup, self.context, os.getpid()))
            process.start()
            theirs.close()  # the worker's end is the worker's alone: its death reads as the end of the pipe
            self.workers.append(_Worker(process, ours))

    def _hand_out(self, fn: Callable[[Any], Any], waiting: collections.deque) -> None:
        for worker in self.workers:
            if worker.task is None and waiting:
                worker.task = waiting.popleft()
                try:
                    worker.conn.send((fn, worker.task.piece))
                except OSError:  # the worker is gone
                    raise self._died() from None

    def _receive(self) -> None:
        """Wait until a busy worker replies; DataError where a worker died."""
        busy = {worker.conn: worker for worker in self.workers if worker.task is not None}
        sentinels = {worker.process.sentinel for worker in self.workers}
        ready = wait([*busy, *sentinels])
        for conn in busy.keys() & set(ready):
            worker = busy[conn]
            try:
                worker.task.ok, worker.task.value, worker.task.trace = conn.recv()
            except (EOFError, OSError):
                raise self._died() from None
            worker.task.done, worker.task = True, None
        if sentinels & set(ready):
            raise self._died()

    def _died(self) -> DataError:
        return DataError(f"a tokenizing worker process died (killed, or out of memory?); nothing was published: "
                         f"run again, with fewer data.num_workers (--num-workers) than {self.count} if memory is short")

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Stopped, failed or abandoned mid-work: kill workers (their pieces are unwanted). Reap all: none outlives it.
        finished = exc_type is None and all(worker.task is None for worker in self.workers)
        for worker in self.workers:
            worker.stop(at_once=not finished)
        for worker in self.workers:
            worker.process.join()
            worker.conn.close()
        self.workers = []


_END = object()  # no more pieces


def _serve(conn: Connection, setup: Callable[[Any], None], context: Any, parent: int) -> None:
    """A worker: set up, then run each function on its piece that arrives and send back what came of it."""
    _start_worker(parent)
    setup(context)
    while (task := conn.recv()) is not None:
        fn, piece = task
        try:
            reply = (True, fn(piece), "")
        except Exception as e:
            reply = (False, e, traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as e:  # a result or exception that does not pickle (nothing was sent): say so
            conn.send((False, RuntimeError(f"cannot send back what {fn.__name__} returned: {e!r}"),
                       traceback.format_exc()))


def _start_worker(parent: int) -> None:
    """Make this forked worker die with `parent` and leave stopping to it."""
    # The kernel SIGKILLs this process when its parent ends, even by SIGKILL.
    if not signal_when_parent_dies(signal.SIGKILL, parent):  # the parent ended between the fork and the prctl
        os._exit(1)
    # Ctrl-C and a SIGTERM sent to the whole process group (torchrun's) are for the parent to act on: it stops the
    # workers itself, so a worker never ends first with a traceback of its own or a "worker died".
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
