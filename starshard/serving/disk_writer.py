"""One rank's disk writes off the step loop: a writer thread that writes the disk tier's reserved files
(DiskTier.reserve -> write), one at a time in the order the steps submitted them (least recently used
first), while the steps go on. File I/O and hashing release the GIL.

The writer never lists a file: the executor's `settle` step, on every rank alike, lists (commits) a
write once every rank finished its own, or gives it up everywhere (each rank removes its file) when any
rank's failed (serving/executor.py, Executor.settle_writes).
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from starshard.serving.disk_tier import DiskTier, PendingWrite

log = logging.getLogger("starshard.serving.disk_writer")

QUEUED, WRITTEN, FAILED = 0, 1, 2  # a job's state, as the ranks' all-gather carries it


@dataclass
class WriteJob:
    """A cache entry's write on this rank. `staged`: its host buffer belongs to the write alone (a shard
    that left the device straight for disk), released when the job ends; else the host tier holds it."""

    entry: int
    pending: PendingWrite
    staged: bool

    @property
    def state(self) -> int:
        if not self.pending.done:
            return QUEUED
        return FAILED if self.pending.error is not None else WRITTEN


class DiskWriter:
    """The writer thread of one rank's disk tier. `jobs`: every job not yet settled, by entry id, in the
    order submitted (the same on every rank: the same ops submit them). `on_written`: called on the writer
    thread after each write (the scheduler on rank 0 wakes to settle it). `before_write`: test hook, called
    on the writer thread with the job before its file is written (e.g. waits on an Event, or raises)."""

    def __init__(self, disk: DiskTier, on_written: Callable[[], None] | None = None):
        self.disk = disk
        self.jobs: dict[int, WriteJob] = {}
        self.on_written = on_written
        self.before_write: Callable[[WriteJob], None] | None = None
        self._queue: collections.deque[WriteJob] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"starshard-disk-writer-r{disk.rank}", daemon=True)
        self._thread.start()

    def submit(self, entry: int, ids, host, staged: bool) -> WriteJob:
        """Reserve the file's room now (in the step: every rank evicts alike) and queue its write."""
        job = WriteJob(entry, self.disk.reserve(entry, ids, host), staged)
        self.jobs[entry] = job
        if not job.pending.done and job.pending.error is None:
            with self._cv:
                self._queue.append(job)
                self._cv.notify()
        else:
            job.pending.done = True
        return job

    def pop(self, entry: int) -> WriteJob:
        """A settled job leaves the writer (the caller commits or abandons it)."""
        return self.jobs.pop(entry)

    def in_flight(self) -> int:
        return len(self.jobs)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
            try:
                if self.before_write is not None:
                    self.before_write(job)
                self.disk.write(job.pending)
            except Exception as err:  # noqa: BLE001 (a hook's error is this write's failure)
                job.pending.error = f"{type(err).__name__}: {err}"
                job.pending.done = True
            if self.on_written is not None:
                try:
                    self.on_written()
                except Exception:  # noqa: BLE001
                    log.debug("on_written failed", exc_info=True)

    def close(self) -> None:
        """Stop after the write in progress (queued ones are dropped; a killed write leaves only a temporary
        file, which the next start removes)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify()
