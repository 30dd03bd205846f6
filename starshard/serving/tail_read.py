"""The tail of one rank's shard file, read backward block by block on a thread, and grafted after a computed
head (issue 49, --disk-reload-policy split: a disk hit served from both ends).

While the service prefills an entry's head [0, cut) in its chunk steps, `TailRead` reads the file's rows at
positions >= cut, from the last block backward (kv_file.read_block: each block's digest checked alone), so
that the two meet where they finish together; `graft` then copies those rows after the head's in the new
entry's KVCache (an executor step). The rows at positions >= cut are a suffix of every rank's stored rows:
the file keeps a prefill's rows in step order and a step's rows lie in its own [start, end) (the layout,
kv_layout.prefill_positions), so the head's steps [0, cut) store exactly the rows before them, in the same
order; `graft` checks that the head's positions equal the file's first rows'.

A window-trimmed file (its local layers keep only their window) is refused: its local layers lack the rows a
computed head would meet (such an entry is reloaded whole). FP8 files are copied as stored (e4m3 and scales).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import torch

from starshard.engine.kv_cache import KVCache
from starshard.serving.host_tier import STORE_DTYPES
from starshard.serving.kv_file import KVFileHeader, n_blocks, read_block


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # copies and cats take no e4m3


def _axis(part: str) -> int:
    return 0 if part == "pos" else 2  # pos [n]; k, v [B, H, n, D]; scales [B, H, n]


class TailRead:
    """Rows at positions >= `cut` of the shard file at `path` (checked `header`), read from its last block
    backward on a thread as soon as it is made. `retarget(cut)` moves the cut (a re-plan); `rows(cut)` waits
    and returns them; a damaged or short block raises there (kv_file.KVFileError)."""

    def __init__(self, path, header: KVFileHeader, cut: int):
        if header.windows:
            raise ValueError("the file is window-trimmed (its local layers keep only their window): reloaded whole")
        self.path, self.header = Path(path), header
        self.positions = header.positions()
        self.n = header.length
        self.bt = header.block_tokens
        self.sections = list(range(len(header.sections)))
        self.seconds, self.nbytes = 0.0, 0  # reading time and bytes (the reload rate)
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}
        self._next = n_blocks(header.sections[0], self.bt) - 1 if self.n else -1  # the next block to read
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._cancelled = False
        self.error: BaseException | None = None
        self.first = self._first(cut)
        self._start()

    def _first(self, cut: int) -> int:
        """The stored row where positions >= cut begin (ValueError: they are not a suffix)."""
        pos = self.positions
        first = int(np.count_nonzero(pos < cut))
        if not (pos[first:] >= cut).all():
            raise ValueError(f"the rows at positions >= {cut} are not the file's last rows (another prefill layout)")
        return first

    def _stop(self) -> int:
        return self.first // self.bt if self.first < self.n else self._next + 1

    def _start(self) -> None:
        """A reader thread, unless one runs or nothing is left above the cut (under no lock: the caller's)."""
        if self._thread is not None and self._thread.is_alive():
            return
        if self.error is None and not self._cancelled and self._next >= self._stop():
            self._thread = threading.Thread(target=self._run, name="starshard-tail-read", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            while True:
                with self._cond:
                    if self._cancelled or self._next < self._stop():
                        return
                    j = self._next
                for k in self.sections:  # every layer's pos, k, v (and scales) of block j
                    t = read_block(self.path, self.header, k, j)
                    self._blocks[(k, j)] = t
                    self.nbytes += t.numel() * t.element_size()
                with self._cond:
                    self._next = j - 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 (handed to rows())
            with self._cond:
                self.error = e
        finally:
            with self._cond:
                self.seconds += time.perf_counter() - t0
                self._cond.notify_all()

    def retarget(self, cut: int) -> None:
        with self._cond:
            self.first = self._first(cut)
            self._start()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True

    def rows(self, cut: int) -> tuple[int, dict[int, dict[str, torch.Tensor]]]:
        """(first stored row, {layer: {part: its rows from there on}}) once read (waits for the reader)."""
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
        out: dict[int, dict[str, torch.Tensor]] = {}
        for k, s in enumerate(self.header.sections):
            axis, j0 = _axis(s.part), self.first // self.bt
            if self.first >= self.n:
                shape = list(s.shape)
                shape[axis] = 0
                t = torch.empty(shape, dtype=STORE_DTYPES[s.dtype])
            else:
                blocks = [_raw(self._blocks[(k, j)]) for j in range(j0, n_blocks(s, self.bt))]
                t = torch.cat(blocks, axis).narrow(axis, self.first - j0 * self.bt, self.n - self.first)
                t = t.view(STORE_DTYPES[s.dtype])
            out.setdefault(s.layer, {})[s.part] = t
        return self.first, out


def graft(kv: KVCache, first: int, rows: dict[int, dict[str, torch.Tensor]], head_positions: np.ndarray,
          next_position: int) -> None:
    """Copy the tail `rows` (TailRead.rows) after the `first` rows each layer of `kv` holds (the computed head,
    whose positions must be `head_positions`, the file's first rows'). Nothing changes on a ValueError."""
    for i, layer in kv.layers.items():
        n = rows[i]["pos"].shape[0]
        if layer.trimmed or layer.length != first or first + n > layer.capacity:
            raise ValueError(f"layer {i} holds {layer.length} rows of {layer.capacity} (trimmed: {layer.trimmed}); "
                             f"the file's tail starts at row {first} and has {n}")
    some = next(iter(kv.layers.values()))
    if not np.array_equal(some.pos[:first].cpu().numpy(), head_positions):
        raise ValueError("the computed head's positions differ from the file's first rows (another prefill layout)")
    for i, layer in kv.layers.items():
        part = rows[i]
        end = first + part["pos"].shape[0]
        layer.pos[first:end].copy_(part["pos"])
        for name in ("k", "v", "k_scale", "v_scale"):
            dst = getattr(layer, name)
            if dst is not None:
                _raw(dst)[:, :, first:end].copy_(_raw(part[name]))
        layer.length, layer.head = end, end % layer.capacity
    kv.next_position = max(kv.next_position, next_position)
