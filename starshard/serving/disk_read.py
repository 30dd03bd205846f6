"""Reading a range of a file at the disk's rate: several sequential readers in parallel.

One thread issuing one large read at a time leaves an NVMe drive (or a network filesystem) mostly idle:
it serves many requests at once. Here `readers` threads take fixed-size chunks of the range in file order
(chunk k goes to whichever reader is free next) and read each with os.preadv straight into the
destination buffer (the GIL is released during the read), so several requests are in flight while the
filled prefix still grows from the front: `read_range` yields that prefix as it grows, and a caller
hands a layer on (e.g. starts its host -> device copy) once all of its bytes are in. readers=1 is one
thread reading in order in the caller's thread, as before.

direct=True also opens the file with O_DIRECT (bypassing the page cache) where the filesystem allows
it; a chunk whose buffer address, file offset or length is not block-aligned (a buffer's tail, a
pageable buffer) is read through the page cache instead, as is everything after the first read the
filesystem refuses (EINVAL). Off by default: a warm page cache is faster than any disk.

`rate` (bytes/s) paces the readers with sleeps, together, to at most that rate: a benchmark's stand-in
for a slower disk (`bench serve --disk-read-throttle`), never used when serving.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from typing import Iterator

DEFAULT_READERS = 4  # enough requests in flight for an NVMe drive; --disk-readers
MAX_READERS = 64
CHUNK = 16 << 20  # bytes one of several readers reads at a time: in flight = readers x CHUNK
SERIAL_CHUNK = 64 << 20  # one reader: large sequential reads
BLOCK = 4096  # O_DIRECT's alignment of buffer address, file offset and length


class ShortRead(EOFError):
    """The file ended `done` bytes into the range."""

    def __init__(self, done: int, length: int):
        self.done, self.length = done, length
        super().__init__(f"the file ends {done} bytes into a {length}-byte range")


def check_readers(n: int) -> int:
    if not isinstance(n, int) or not 1 <= n <= MAX_READERS:
        raise ValueError(f"--disk-readers must be an integer from 1 to {MAX_READERS} (1: one sequential reader), "
                         f"got {n!r}")
    return n


class Pacer:
    """Sleep-based pacing shared by readers: chunk after chunk, each gets a slot of n / rate seconds after
    the previous one's, and its reader neither starts before its slot nor returns before the slot's end;
    so a range of B bytes takes at least B / rate seconds, however many readers share it."""

    def __init__(self, rate: float):
        if not rate > 0:
            raise ValueError(f"a read rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def slot(self, n: int) -> tuple[float, float]:
        with self._lock:
            start = max(time.monotonic(), self._next)
            self._next = start + n / self.rate
            return start, self._next


def sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(left)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def open_direct(path) -> int | None:
    """An O_DIRECT read-only fd of `path`, or None where the platform or filesystem refuses it (tmpfs, ...)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


class _Direct:
    """Which chunks go through the O_DIRECT fd: aligned ones, until the filesystem refuses one."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def fd_for(self, address: int, file_off: int, n: int) -> int | None:
        if self.fd is None:
            return None
        return self.fd if address % BLOCK == 0 and file_off % BLOCK == 0 and n % BLOCK == 0 else None

    def refused(self) -> None:
        self.fd = None


def _read_chunk(fd: int, direct: _Direct, view: memoryview, base: int, view_off: int, file_off: int, n: int) -> int:
    """Read n bytes at file_off into view[view_off:] (`base`: the view's address, for O_DIRECT's alignment);
    the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < n:
        dfd = direct.fd_for(base + view_off + got, file_off + got, n - got)
        try:
            r = os.preadv(dfd if dfd is not None else fd, [view[view_off + got:view_off + n]], file_off + got)
        except OSError as e:
            if dfd is None or e.errno != 22:  # EINVAL: this filesystem takes no direct reads after all
                raise
            direct.refused()
            continue
        if r == 0:
            break
        got += r
    return got


def read_range(fd: int, offset: int, length: int, into: memoryview | None = None, readers: int = 1,
               chunk: int | None = None, rate: float | None = None, direct_fd: int | None = None) -> Iterator[int]:
    """Read `length` bytes of `fd` from `offset` into `into` (a writable byte memoryview of at least `length`
    bytes; None: each reader reads into its own scratch buffer and the bytes are dropped, to measure a rate).
    Yields the bytes filled from the range's start, growing, ending with `length`. Raises ShortRead when the
    file ends early, OSError as the read raised it. `chunk`: bytes per read (default CHUNK, SERIAL_CHUNK for
    one reader); `rate`: pace to at most this many bytes/s; `direct_fd`: an O_DIRECT fd of the same file
    (open_direct) for the aligned chunks. Closing the generator early stops the readers before it returns."""
    check_readers(readers)
    chunk = chunk or (SERIAL_CHUNK if readers == 1 else CHUNK)
    if direct_fd is not None:
        chunk = max(BLOCK, chunk // BLOCK * BLOCK)
    if length <= 0:
        yield 0
        return
    n_chunks = -(-length // chunk)
    readers = min(readers, n_chunks)
    pacer = Pacer(rate) if rate else None
    scratch = None if into is not None else [memoryview(mmap.mmap(-1, min(chunk, length))) for _ in range(readers)]
    direct = _Direct(direct_fd)
    views = [into] if into is not None else scratch
    bases = [_address(v) if direct_fd is not None else 0 for v in views]

    def one(k: int, reader: int) -> None:
        """Read chunk k (a reader's scratch: at its start, so the address stays aligned)."""
        start = k * chunk
        n = min(chunk, length - start)
        if pacer is not None:
            t0, t1 = pacer.slot(n)
            sleep_until(t0)
        i = 0 if into is not None else reader
        got = _read_chunk(fd, direct, views[i], bases[i], start if into is not None else 0, offset + start, n)
        if got < n:
            raise ShortRead(start + got, length)
        if pacer is not None:
            sleep_until(t1)

    if readers == 1:  # in this thread, in order
        for k in range(n_chunks):
            one(k, 0)
            yield min(length, (k + 1) * chunk)
        return

    done = [False] * n_chunks
    state = {"next": 0, "error": None, "stop": False}
    cond = threading.Condition()

    def worker(reader: int) -> None:
        while True:
            with cond:
                if state["stop"] or state["error"] is not None or state["next"] >= n_chunks:
                    return
                k = state["next"]
                state["next"] += 1
            try:
                one(k, reader)
            except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
                with cond:
                    if state["error"] is None or (isinstance(e, ShortRead) and isinstance(state["error"], ShortRead)
                                                  and e.done < state["error"].done):
                        state["error"] = e  # of two short reads, the earlier end is the file's
                    cond.notify_all()
                return
            with cond:
                done[k] = True
                cond.notify_all()

    threads = [threading.Thread(target=worker, args=(r,), name=f"disk-read-{r}", daemon=True) for r in range(readers)]
    for t in threads:
        t.start()
    filled = 0  # chunks complete from the start
    try:
        while filled < n_chunks:
            with cond:
                while not done[filled] and state["error"] is None:
                    cond.wait()
                if state["error"] is not None:
                    break
                while filled < n_chunks and done[filled]:
                    filled += 1
            yield min(length, filled * chunk)
    finally:
        with cond:
            state["stop"] = True
        for t in threads:
            t.join()  # none may still write into `into` once the caller moves on
    if state["error"] is not None:
        raise state["error"]


def read_file(path, offset: int, length: int, into: memoryview | None = None, readers: int = 1,
              chunk: int | None = None, rate: float | None = None, direct: bool = False) -> Iterator[int]:
    """read_range over `path` opened here (and with O_DIRECT too when `direct` and the filesystem allows)."""
    fd = os.open(path, os.O_RDONLY)
    dfd = open_direct(path) if direct else None
    try:
        yield from read_range(fd, offset, length, into, readers, chunk, rate, dfd)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
