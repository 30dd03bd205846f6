"""The tail of one rank's shard file, read backward block by block on a thread and copied into the new entry
as it arrives (issue 49, --disk-reload-policy split: a disk hit served from both ends).

While the service prefills an entry's head [0, cut) in its chunk steps, `TailRead` reads the file's rows at
positions >= cut from the last block backward (kv_file.read_block: each block's digest checked alone, the
block's sections read by `readers` threads at once) and copies each block's rows into the same rows of the
entry's KVCache, whose capacity the head's first chunk allocated: on a GPU from a ring of pinned slots on a
copy stream of its own, so reading and copying overlap the head's compute; `join` makes the compute stream
wait for the copies and `complete` sets the layers' lengths. The rows at positions >= cut are a suffix of every
rank's stored rows: the file keeps a prefill's rows in step order and a step's rows lie in its own [start,
end) (the layout, kv_layout.prefill_positions), so the head's steps [0, cut) store exactly the rows before
them, in the same order; `complete` checks that the head's positions equal the file's first rows'. A re-plan
that moves the cut later leaves rows already copied to be computed again over them.

A window-trimmed file (its local layers keep only their window) is refused: its local layers lack the rows a
computed head would meet (such an entry is reloaded whole). FP8 files are copied as stored (e4m3 and scales).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from starshard.engine.kv_cache import KVCache
from starshard.serving.disk_read import DEFAULT_READERS
from starshard.serving.kv_file import KVFileHeader, _row_axis, block_bytes, n_blocks, read_block

SLOTS_PER_READER = 4  # pinned slots of one section-block each, per reader: reads wait only on old copies


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
    (kv_file.KVFileError)."""

    def __init__(self, path, header: KVFileHeader, cut: int, readers: int = DEFAULT_READERS):
        if header.windows:
            raise ValueError("the file is window-trimmed (its local layers keep only their window): reloaded whole")
        self.path, self.header, self.readers = Path(path), header, readers
        self.positions = header.positions()
        self.n = header.length
        self.bt = header.block_tokens
        self.seconds, self.nbytes = 0.0, 0  # reading time and bytes (the reload rate)
        self._next = n_blocks(header.sections[0], self.bt) - 1 if self.n else -1  # the next block to read
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

    def _stop(self) -> int:
        return self.first // self.bt if self.first < self.n else self._next + 1

    def _start(self) -> None:
        """A reader thread, unless one runs or nothing is left above the cut (under the caller's lock)."""
        if self._kv is None or (self._thread is not None and self._thread.is_alive()):
            return
        if self.error is None and not self._cancelled and self._next >= self._stop():
            self._thread = threading.Thread(target=self._run, name="starshard-tail-read", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            sections = range(len(self.header.sections))
            if self._stream is not None and self._slots is None:  # pinned once, off the step loop
                size = max(block_bytes(s, 0, self.bt) for s in self.header.sections)
                self._slots = _Slots(SLOTS_PER_READER * self.readers, size)
            with ThreadPoolExecutor(self.readers) as pool:
                while True:
                    with self._cond:
                        if self._cancelled or self._next < self._stop():
                            return
                        j, first = self._next, self.first
                    for nbytes in pool.map(lambda k: self._move(k, j, first), sections):
                        self.nbytes += nbytes
                    with self._cond:
                        self._next = j - 1
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (handed to join())
            with self._cond:
                self.error = e
        finally:
            with self._cond:
                self.seconds += time.perf_counter() - t0
                self._cond.notify_all()

    def _move(self, k: int, j: int, first: int) -> int:
        """Read block j of section k and copy its rows from stored row `first` on into the entry -> bytes read."""
        s = self.header.sections[k]
        slot = self._slots.take() if self._slots is not None else None
        block = read_block(self.path, self.header, k, j, slot)
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
            while self.error is None and self._next >= self._stop():
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
