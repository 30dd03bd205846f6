"""The tail of one rank's shard file, read backward block by block on a thread and copied into the new entry
as it arrives (issue 49, --disk-reload-policy split: a disk hit served from both ends).

While the service prefills an entry's head [0, cut) in its chunk steps, `TailRead` reads the file's rows at
positions >= cut from the last block backward (kv_file.read_block: each block's digest checked alone, the
block's sections read by `readers` x READS_PER_READER threads at once, the next block's queued behind) and
copies each block's rows into the same rows of the entry's KVCache, whose capacity the head's first chunk
allocated: on a GPU from a ring of pinned slots on a copy stream of its own, so reading and copying overlap
the head's compute; `join` makes the compute stream wait for the copies and `complete` sets the layers'
lengths. The rows at positions >= cut are a suffix of every rank's stored rows: the file keeps a prefill's
rows in step order and a step's rows lie in its own [start, end) (the layout, kv_layout.prefill_positions),
so the head's steps [0, cut) store exactly the rows before them, in the same order; `complete` checks that
the head's positions equal the file's first rows'. A re-plan that moves the cut later leaves rows already
copied to be computed again over them; one that moves it earlier reads the rows between (a block already
read, again).

A window-trimmed file (its local layers keep only their window) is refused: its local layers lack the rows a
computed head would meet (such an entry is reloaded whole). FP8 files are copied as stored (e4m3 and scales).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from starshard.engine.kv_cache import KVCache
from starshard.serving.disk_read import DEFAULT_READERS, Pacer, sleep_until
from starshard.serving.kv_file import KVFileHeader, _row_axis, block_bytes, read_block

# A block of one section is a few ranges of about 1 MB (one per KV head): a disk serves them at its rate only
# with many in flight, so each --disk-readers reader stands for READS_PER_READER block reads at once, and the
# next BLOCKS_AHEAD blocks are queued before the oldest is done (no pause between blocks). Pinned slots: two
# per read in flight, so reads wait only on old copies.
READS_PER_READER = 4
BLOCKS_AHEAD = 2


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # copies take no e4m3


class _Slots:
    """Pinned buffers for section-blocks in flight to the GPU: a slot is handed out again once the copy out of
    it has passed its event."""

    def __init__(self, count: int, nbytes: int):
        self.free = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self.busy: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self.lock = threading.Lock()

    def take(self) -> torch.Tensor:
        with self.lock:
            if self.free:
                return self.free.pop()
            slot, event = self.busy.pop(0)  # the oldest copy: the first to finish
        event.synchronize()
        return slot

    def give(self, slot: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        """Back once `event` (a copy out of it) has passed; None: nothing was copied out of it."""
        with self.lock:
            if event is None:
                self.free.append(slot)
            else:
                self.busy.append((slot, event))


class TailRead:
    """Rows at positions >= `cut` of the shard file at `path` (checked `header`). `attach(kv)` starts reading
    them into `kv` from the last block backward; `retarget(cut)` moves the cut (a re-plan); `join(cut)` waits for
    them; `complete(kv, first)` makes them the entry's. A damaged or short block raises in `join`
    (kv_file.KVFileError). `rate` (bytes/s): paced as disk_read's readers (a benchmark's slower disk)."""

    def __init__(self, path, header: KVFileHeader, cut: int, readers: int = DEFAULT_READERS,
                 rate: float | None = None):
        if header.windows:
            raise ValueError("the file is window-trimmed (its local layers keep only their window): reloaded whole")
        self.path, self.header, self.readers = Path(path), header, readers
        self._pacer = Pacer(rate) if rate else None  # bench serve --disk-read-throttle's slower disk
        self.positions = header.positions()
        self.n = header.length
        self.bt = header.block_tokens
        self.seconds, self.nbytes = 0.0, 0  # reading time and bytes (the reload rate)
        self._since: float | None = None  # when the running reader thread started
        self._covered = self.n  # rows [_covered, n) are read and their copies queued (a suffix of the rows)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._cancelled = False
        self._kv: KVCache | None = None
        self._stream: torch.cuda.Stream | None = None
        self._slots: _Slots | None = None
        self.error: BaseException | None = None
        self.first = self._first(cut)

    def _first(self, cut: int) -> int:
        """The stored row where positions >= cut begin (ValueError: they are not a suffix)."""
        pos = self.positions
        first = int(np.count_nonzero(pos < cut))
        if not (pos[first:] >= cut).all():
            raise ValueError(f"the rows at positions >= {cut} are not the file's last rows (another prefill layout)")
        return first

    def attach(self, kv: KVCache) -> None:
        """Start reading into `kv` (the entry the head's chunks fill; its capacity holds every row), after the
        work queued so far on the current stream (the allocation's earlier tenants)."""
        layers = {s.layer for s in self.header.sections}
        if set(kv.layers) != layers:
            raise ValueError(f"the file holds layers {sorted(layers)}, the entry {sorted(kv.layers)}")
        for i, layer in kv.layers.items():
            if layer.trimmed or self.n > layer.capacity or layer.fp8 != self.header.fp8:
                raise ValueError(f"layer {i}: {layer.capacity} rows (trimmed: {layer.trimmed}, fp8: {layer.fp8}) "
                                 f"cannot take the file's {self.n} (fp8: {self.header.fp8})")
        device = next(iter(kv.layers.values())).k.device
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._kv = kv
        with self._cond:
            self._start()

    def _wanted(self) -> bool:
        return self._covered > self.first

    def _start(self) -> None:
        """A reader thread, unless one runs or nothing is left above the cut (under the caller's lock)."""
        if self._kv is None or (self._thread is not None and self._thread.is_alive()):
            return
        if self.error is None and not self._cancelled and self._wanted():
            self._thread = threading.Thread(target=self._run, name="starshard-tail-read", daemon=True)
            self._thread.start()

    def progress(self) -> tuple[int, float]:
        """(bytes read so far, seconds spent reading them), live: a re-plan's measured rate."""
        with self._cond:
            return self.nbytes, self.seconds + (time.perf_counter() - self._since if self._since else 0.0)

    def _run(self) -> None:
        with self._cond:
            t0 = self._since = time.perf_counter()
        threads = self.readers * READS_PER_READER
        try:
            sections = range(len(self.header.sections))
            if self._stream is not None and self._slots is None:  # pinned once, off the step loop
                size = max(block_bytes(s, 0, self.bt) for s in self.header.sections)
                self._slots = _Slots(2 * threads, size)
            with ThreadPoolExecutor(threads) as pool:
                flight: deque[tuple[int, int, list]] = deque()  # (block, first row, reads) queued, newest last
                while True:
                    with self._cond:
                        if self._cancelled:
                            return
                        j = flight[-1][0] - 1 if flight else (self._covered - 1) // self.bt
                        while len(flight) < BLOCKS_AHEAD and self._wanted() and j >= max(0, self.first // self.bt):
                            first = self.first
                            flight.append((j, first, [pool.submit(self._move, k, j, first) for k in sections]))
                            j -= 1
                    if not flight:
                        return
                    j, first, futures = flight.popleft()
                    nbytes = sum(f.result() for f in futures)
                    with self._cond:
                        self.nbytes += nbytes
                        # Blocks end in order, each below the last; a block read before the cut moved earlier
                        # may leave a gap above it: _covered stays, and the block at the gap is read again.
                        if self._covered <= min((j + 1) * self.bt, self.n):
                            self._covered = min(self._covered, max(first, j * self.bt))
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (handed to join())
            with self._cond:
                self.error = e
        finally:
            with self._cond:
                self.seconds += time.perf_counter() - t0
                self._since = None
                self._cond.notify_all()

    def _move(self, k: int, j: int, first: int) -> int:
        """Read block j of section k and copy its rows from stored row `first` on into the entry -> bytes read."""
        s = self.header.sections[k]
        slot = self._slots.take() if self._slots is not None else None
        if self._pacer is not None:
            t0, t1 = self._pacer.slot(block_bytes(s, j, self.bt))
            sleep_until(t0)
        block = read_block(self.path, self.header, k, j, slot)
        if self._pacer is not None:
            sleep_until(t1)
        lo, hi = max(first, j * self.bt), min((j + 1) * self.bt, self.n)
        if hi > lo:
            axis = _row_axis(s)
            src = block.narrow(axis, lo - j * self.bt, hi - lo)
            with torch.inference_mode():  # the entry's tensors are inference tensors (made in the step loop's mode)
                dst = getattr(self._kv.layers[s.layer], s.part).narrow(axis, lo, hi - lo)
                if self._stream is None:
                    _raw(dst).copy_(_raw(src))
                else:
                    with torch.cuda.stream(self._stream):
                        _raw(dst).copy_(_raw(src), non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self._stream)
                    self._slots.give(slot, event)
                    slot = None
        if slot is not None:
            self._slots.give(slot)
        return block.numel() * block.element_size()

    def retarget(self, cut: int) -> None:
        with self._cond:
            self.first = self._first(cut)
            self._start()

    def abandon(self) -> None:
        """Stop reading; work queued on the current stream from now on runs after the copies already queued (the
        entry may be freed, or the rest of its rows computed)."""
        with self._cond:
            self._cancelled = True
        if self._thread is not None:
            self._thread.join()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def join(self, cut: int) -> int:
        """Wait until the rows at positions >= cut are read and their copies queued -> their first stored row;
        the current stream then waits for those copies (no host wait on a GPU)."""
        if self._kv is None:
            raise RuntimeError("the tail read never started (no entry was attached)")
        self.retarget(cut)
        with self._cond:
            while self.error is None and self._wanted():
                if self._thread is None or not self._thread.is_alive():
                    self._start()
                self._cond.wait(0.1)
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return self.first

    def complete(self, kv: KVCache, first: int) -> None:
        """Every layer of `kv` holds the computed head (`first` rows, at the file's first rows' positions) and,
        after it, the tail's rows (join): make them the entry's. Nothing changes on a ValueError."""
        for i, layer in kv.layers.items():
            if layer.trimmed or layer.length != first:
                raise ValueError(f"layer {i} holds {layer.length} rows (trimmed: {layer.trimmed}); the file's tail "
                                 f"starts at row {first}")
        some = next(iter(kv.layers.values()))
        if not np.array_equal(some.pos[:first].cpu().numpy(), self.positions[:first]):
            raise ValueError("the computed head's positions differ from the file's first rows (another prefill layout)")
        for layer in kv.layers.values():
            layer.length, layer.head = self.n, self.n % layer.capacity
        kv.next_position = max(kv.next_position, self.header.next_position)
