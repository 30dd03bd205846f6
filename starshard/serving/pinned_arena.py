"""The host tier's memory: its whole budget page-locked once, at server start, shard buffers carved out of it.

Why not `torch.empty(n, pin_memory=True)` per shard: each is a fresh cudaHostAlloc (page-locking many GiB
takes seconds, and the demotion stalls every stream meanwhile), and torch's caching host allocator rounds
a request up to the next power of two (a 17 GB shard pins 32 GiB). Here one plain host tensor of exactly
the budget is registered with cudaHostRegister once; `alloc` hands out aligned ranges of it (first fit
over a sorted free list) and `free` returns them, merged with their free neighbours. When no free range
is large enough (fragmentation) `alloc` answers None and the caller uses a pageable buffer instead.

The arena knows nothing of copies: its user frees a range only once every copy into or out of it is done
(host_tier.py: on HostKV.release() or when the HostKV is gone, after its copies' events have passed).
"""
from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
import weakref

import torch

log = logging.getLogger("starshard.serve")

ARENA_ALIGN = 4096  # every range starts on a page: any dtype views it, DMA runs on whole pages


def _register(buf: torch.Tensor) -> None:
    """Page-lock `buf` for asynchronous copies (CUDA only; cannot run on a CPU-only host)."""
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel() / 2**30:.2f} GiB failed with cudaError {err} "
                           "(not enough lockable host memory? lower --host-cache-gib)")


def _unregister(ptr: int) -> None:
    torch.cuda.synchronize()  # no copy may still run on the pages being unlocked
    torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedArena:
    """`nbytes` of host memory (page-locked when `pin`, default: when CUDA is available), handed out as
    uint8 views by `alloc` and taken back by `free`. Thread-safe (the disk tier reads on other threads)."""

    def __init__(self, nbytes: int, align: int = ARENA_ALIGN, pin: bool | None = None):
        if nbytes <= 0:
            raise ValueError(f"a pinned arena needs > 0 bytes (--host-cache-gib), got {nbytes}")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"the arena's alignment must be a power of two, got {align}")
        self.nbytes, self.align = nbytes, align
        self.pinned = torch.cuda.is_available() if pin is None else pin
        t0 = time.perf_counter()
        self._buf = torch.empty(nbytes, dtype=torch.uint8)  # plain: exactly nbytes, no caching-allocator rounding
        self._base = self._buf.data_ptr()
        if self.pinned:
            _register(self._buf)
            self._close = weakref.finalize(self, _unregister, self._base)
            self._close.atexit = False  # at exit the process' pages go anyway
            log.info("host cache: page-locked %.2f GiB in %.2f s", nbytes / 2**30, time.perf_counter() - t0)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, never adjacent
        self._used: dict[int, int] = {}  # offset -> size of each range handed out
        self._pending: collections.deque[int] = collections.deque()  # freed offsets not yet merged back
        self._lock = threading.Lock()
        self.fallbacks = 0  # requests a caller served with a pageable buffer instead (counted by the caller)

    def alloc(self, n: int) -> torch.Tensor | None:
        """A uint8 view of `n` bytes at an aligned offset, or None when no free range is large enough."""
        if n < 0:
            raise ValueError(f"alloc: a negative size {n}")
        size = max(self.align, (n + self.align - 1) // self.align * self.align)  # offsets stay aligned
        with self._lock:
            self._drain()
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    self._used[off] = size
                    break
            else:
                return None
        return self._buf[off:off + n]  # outside the lock: see free

    def owns(self, view: torch.Tensor) -> bool:
        return view.device.type == "cpu" and 0 <= view.data_ptr() - self._base < self.nbytes

    def free(self, view: torch.Tensor) -> None:
        """Return the range `view` (from alloc) to the free list, merged with free neighbours. Never waits
        for the lock: a free may run from a garbage collection inside alloc on this thread (a HostKV's
        finalizer); then the range is merged back by the next call that holds the lock."""
        off = view.data_ptr() - self._base
        if off not in self._used or off in self._pending:
            raise ValueError(f"free: offset {off} is not a range this arena handed out (freed twice?)")
        self._pending.append(off)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Merge the pending frees into the free list (the lock held)."""
        while self._pending:
            off = self._pending.popleft()
            size = self._used.pop(off)
            i = bisect.bisect_left(self._free, (off, 0))
            if i < len(self._free) and off + size == self._free[i][0]:  # the next range is free: merge
                size += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # the previous one too
                off, size = self._free[i - 1][0], self._free[i - 1][1] + size
                i -= 1
                del self._free[i]
            self._free.insert(i, (off, size))

    def free_bytes(self) -> int:
        with self._lock:
            self._drain()
            return sum(size for _, size in self._free)

    def largest_free(self) -> int:
        with self._lock:
            self._drain()
            return max((size for _, size in self._free), default=0)

    def close(self) -> None:
        """Unlock the pages (the memory itself lives on while views of it do)."""
        if self.pinned:
            self._close()
