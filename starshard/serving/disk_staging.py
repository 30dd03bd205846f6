"""A disk reload straight to the device through a bounded pinned staging area, reused.

Without a host tier (or with one too full to lend a range) kv_file.read_kv_host reads a whole shard into
pageable memory: each host -> device copy from it is synchronous and bounced through the driver's own
pinned buffer, so the copies no longer overlap the read (a 17 GB shard at 128K tokens). Here the disk
tier owns two pinned slots (DISK_STAGING_BYTES in all, page-locked once at start, CUDA only) and
streams the file through them: a window of whole layers is read into one slot (disk_read.py's parallel
readers), each layer's asynchronous copy to the device starts as soon as its bytes are in, and the next
window is read into the other slot meanwhile. A slot is reused only once the copies out of it have
passed their events and its sections' digests are checked (digests as read_kv_host: per block, on a
thread pool). A shard with a layer larger than a slot is not staged (the caller reads it as before).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from starshard.engine.kv_cache import KVCache
from starshard.serving.cache_key import CacheKey
from starshard.serving.disk_read import DEFAULT_READERS, ShortRead, read_file
from starshard.serving.host_tier import DeviceLoader, HostKV, Section
from starshard.serving.kv_file import (HASH_THREADS, KVFileError, KVFileHeader, check_digests, read_header,
                                      read_tokens, submit_digests)
from starshard.serving.pinned_arena import PinnedArena

DISK_STAGING_BYTES = 2 << 30  # two 1 GiB slots: a 128K-token Llama-3.1-8B layer (512 MiB at cp=1) fits one


class StagingArea:
    """Two slots of `nbytes` / 2 each (page-locked when `pin`, default: when CUDA is available), used by one
    staged load at a time."""

    def __init__(self, nbytes: int = DISK_STAGING_BYTES, pin: bool | None = None):
        self.arena = PinnedArena(nbytes, pin=pin)
        half = nbytes // 2 // self.arena.align * self.arena.align
        if half <= 0:
            raise ValueError(f"a staging area of {nbytes} bytes holds no two slots")
        self.slots = [self.arena.alloc(half), self.arena.alloc(half)]
        self.slot_bytes = half
        self.lock = threading.Lock()

    def close(self) -> None:
        self.arena.close()


def windows(header: KVFileHeader, slot_bytes: int) -> list[tuple[int, int, list[int]]] | None:
    """The payload cut into (start, end, layers) byte ranges of whole layers in file order, each at most
    `slot_bytes`, together covering it; None when one layer alone is larger than a slot."""
    spans: dict[int, list[int]] = {}
    for s in header.sections:
        lo, hi = spans.setdefault(s.layer, [s.offset, s.offset + s.nbytes])
        spans[s.layer] = [min(lo, s.offset), max(hi, s.offset + s.nbytes)]
    order = list(spans)
    starts = [spans[i][0] for i in order] + [header.payload_bytes]  # a layer runs to the next one's start
    out, first = [], 0
    for j in range(len(order)):
        if starts[j + 1] - starts[j] > slot_bytes:
            return None
        if starts[j + 1] - starts[first] > slot_bytes:
            out.append((starts[first], starts[j], order[first:j]))
            first = j
    out.append((starts[first], starts[-1], order[first:]))
    out[0] = (0, out[0][1], out[0][2])
    return out


def _window_host(header: KVFileHeader, slot: torch.Tensor, start: int, end: int,
                 layers: list[int]) -> tuple[HostKV, dict[Section, tuple[str, ...]]]:
    """The layers of window [start, end) as a HostKV over the slot (sections moved to the slot's offsets),
    and each moved section's block digests."""
    keep = set(layers)
    moved = {Section(s.layer, s.part, s.dtype, s.shape, s.offset - start, s.nbytes): want
             for s, want in zip(header.sections, header.block_digests) if s.layer in keep}
    host = HostKV(slot[:end - start], tuple(moved), getattr(torch, header.dtype), header.fp8, header.length,
                  header.next_position, dict(header.windows), header.serves_from, context_len=header.context_len)
    return host, moved


def read_kv_staged(path, device, staging: StagingArea, key: CacheKey | None = None, rank: int | None = None,
                   extra_capacity: int = 0, verify: bool = True, readers: int = DEFAULT_READERS,
                   rate: float | None = None) -> tuple[KVCache, np.ndarray] | None:
    """A file's shard as a KVCache on `device` (exactly its rows plus `extra_capacity`, copies done) and its
    token ids, read through `staging`; None when a layer does not fit a slot (read it otherwise). Errors as
    kv_file.read_kv_host (KVFileError with its reason; the KVCache is dropped)."""
    h = read_header(path, key, rank)
    plan = windows(h, staging.slot_bytes)
    if plan is None:
        return None
    tokens = read_tokens(path, h)
    meta = HostKV(torch.empty(h.payload_bytes, dtype=torch.uint8, device="meta"), h.sections,
                  getattr(torch, h.dtype), h.fp8, h.length, h.next_position, dict(h.windows), h.serves_from,
                  context_len=h.context_len)
    loader = DeviceLoader(meta, device, extra_capacity)
    events: list[list] = [[], []]  # per slot: the copies out of the window it holds
    hashes: list[list] = [[], []]  # per slot: (section, digest, future) of the window's sections

    def settle(slot: int) -> None:
        """The slot's copies done and digests checked: it may be overwritten."""
        for ev in events[slot]:
            ev.synchronize()
        for s, want, futs in hashes[slot]:
            check_digests(path, s, want, futs)
        events[slot], hashes[slot] = [], []

    with staging.lock, ThreadPoolExecutor(HASH_THREADS) as pool:
        try:
            for w, (start, end, layers) in enumerate(plan):
                slot = w % 2
                settle(slot)
                host, wants = _window_host(h, staging.slots[slot], start, end, layers)
                buf = memoryview(host.buffer.numpy()).cast("B")
                ends = {i: max(s.offset + s.nbytes for s in host.sections if s.layer == i) for i in layers}
                pending = list(layers)
                for done in read_file(path, h.payload_offset + start, end - start, buf, readers, rate=rate):
                    while pending and ends[pending[0]] <= done:
                        i = pending.pop(0)
                        if verify:
                            hashes[slot] += [(s, wants[s], submit_digests(pool, buf, s, h.block_tokens))
                                              for s in host.sections if s.layer == i]
                        loader.copy_layer(i, host)  # asynchronous from pinned memory: overlaps the rest of the read
                        if i in loader.events:
                            events[slot].append(loader.events[i])
            settle(0)
            settle(1)
        except ShortRead as e:
            raise KVFileError(path, "truncated", f"the payload ends after {start + e.done} of "
                              f"{h.payload_bytes} bytes") from None
        except OSError as e:
            raise KVFileError(path, "io", str(e)) from None
        finally:
            for slot in (0, 1):  # on an error too: no copy may still read a slot the next load overwrites
                for ev in events[slot]:
                    ev.synchronize()
    load = loader.finish()
    load.synchronize()
    return load.kv, tokens
