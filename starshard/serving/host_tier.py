"""The host tier: one rank's cache entry shards kept in pinned host memory, within a byte budget.

A shard leaves the device as one flat byte buffer (`HostKV`: each layer's filled rows of k, v,
positions and, for FP8, the e4m3 bytes with their float32 scales; nothing is converted), copied on a
side CUDA stream so the compute stream keeps running. A window-trimmed shard (a sliding-window model's
entry after Executor._trim: KVCache.compact_local) moves as it is: each layer its own row count, each
trimmed layer its window (`HostKV.windows`), and the entry's `serves_from` (context_cache.served_prefix),
so that it comes back with the same rows, positions, windows and bytes, serving the same prompts. The
same buffer is what kv_file.py writes to disk and reads back, so a shard moves device -> host -> disk ->
host -> device without reformatting.

Coming back, `to_device` copies layer by layer on a side stream and records one CUDA event per
layer: a consumer makes its stream wait for layer i only (`DeviceLoad.wait(i)`) right before layer i
reads the entry, so the question's forward through layers 0..i-1 overlaps the copies of layers
i..L-1. A caller with nothing to overlap calls `DeviceLoad.wait_all()` (GPU side, no host sync) or
`synchronize()`.

An entry being moved is never freed or read half-copied: a HostKV keeps its source KVCache alive
until its copy is done (`HostKV.synchronize`), a DeviceLoad keeps its HostKV's pinned buffer alive,
and every reader of a buffer still in flight waits on its event first.

Buffers come from the host tier's PinnedArena (its budget, page-locked once at start), never from a
pinned allocation per shard. The lifetime rule: a HostKV's arena range returns to the free list on
`HostKV.release()` (called where a shard leaves the host for good: HostTier.evict, load(keep=False)
once its copies are done, the executor after a promotion or a disk write, a disk reload once on the
device), or at the latest when the HostKV is garbage (weakref.finalize); either way only after every
copy into or out of it has passed its event (`HostKV._copies`). A released HostKV keeps its size but
its buffer is a meta tensor: reading it raises. Without an arena, or when it has no free range large
enough, the buffer is plain pageable memory: copies are then synchronous, still correct (counted as
the tier's unpinned_fallbacks).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from starshard.engine.kv_cache import KVCache, LayerKV, StoredKV
from starshard.serving.context_cache import longest_prefix
from starshard.serving.pinned_arena import PinnedArena
from starshard.serving.tier_stats import TierStats

ALIGN = 64  # every section starts on a 64-byte boundary: any dtype views it, copies run on aligned lines
PARTS = ("pos", "k", "v", "k_scale", "v_scale")  # a layer's sections, in buffer order (scales: FP8 only)
STORE_DTYPES = {str(d).removeprefix("torch."): d for d in
                (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64)}


@dataclass(frozen=True)
class Section:
    """One tensor inside a shard's flat buffer."""

    layer: int
    part: str  # one of PARTS
    dtype: str  # a key of STORE_DTYPES
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start
    nbytes: int


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(layer_ids, batch: int, heads: int, head_dim: int, length: int | dict[int, int], dtype: torch.dtype,
           fp8: bool) -> tuple[tuple[Section, ...], int]:
    """The sections of a shard of `length` rows per layer ({layer: rows} when they differ: a window-trimmed
    shard's local layers hold fewer) and the buffer's size in bytes."""
    store = torch.float8_e4m3fn if fp8 else dtype
    out, off = [], 0
    for i in layer_ids:
        n = length[i] if isinstance(length, dict) else length
        shapes = dict(pos=((n,), torch.int64), k=((batch, heads, n, head_dim), store),
                      v=((batch, heads, n, head_dim), store))
        if fp8:
            shapes |= dict(k_scale=((batch, heads, n), torch.float32), v_scale=((batch, heads, n), torch.float32))
        for part in PARTS:
            if part not in shapes:
                continue
            shape, dt = shapes[part]
            n = math.prod(shape) * dt.itemsize
            out.append(Section(i, part, str(dt).removeprefix("torch."), shape, off, n))
            off = _align(off + n)
    return tuple(out), off


def host_buffer(nbytes: int, arena: PinnedArena | None) -> torch.Tensor:
    """A uint8 host buffer for one shard: a range of `arena` when it has room, else pageable memory
    (counted in arena.fallbacks). Pair it with `own` once the HostKV exists."""
    buf = arena.alloc(nbytes) if arena is not None else None
    if buf is None:
        if arena is not None:
            arena.fallbacks += 1
        buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def _release(arena: PinnedArena, view: torch.Tensor, copies: list) -> None:
    for ev in copies:  # normally passed already: a DeviceLoad is synchronized before it lets go
        ev.synchronize()
    arena.free(view)


def own(host: "HostKV", arena: PinnedArena | None) -> "HostKV":
    """Give `host.buffer`'s arena range back on host.release() or when `host` is gone, once its copies are done."""
    if arena is not None and arena.owns(host.buffer):
        host._free = weakref.finalize(host, _release, arena, host.buffer, host._copies)
    return host


@dataclass
class HostKV:
    """One rank's entry shard in host memory: `buffer` (uint8, pinned on CUDA hosts) holding `sections`."""

    buffer: torch.Tensor
    sections: tuple[Section, ...]
    dtype: torch.dtype  # the compute dtype (an FP8 shard stores e4m3 and dequantizes to this)
    fp8: bool
    length: int  # rows of a layer that keeps every key (each layer's own: rows(i); they differ when trimmed)
    next_position: int
    windows: dict[int, int] = field(default_factory=dict)  # {layer: window} of the window-trimmed layers
    serves_from: int = 0  # its cache entry's (CacheEntry.serves_from): the fewest shared tokens it serves
    context_len: int | None = None  # its cache entry's (CacheEntry.context_len), to a file and back
    ready: torch.cuda.Event | None = None  # recorded after the device -> host copy (None: already done)
    _source: KVCache | None = field(default=None, repr=False)  # kept alive until the copy is done
    _copies: list = field(default_factory=list, repr=False)  # events of copies that use the buffer (CUDA)
    _free: weakref.finalize | None = field(default=None, repr=False)  # gives an arena range back (own)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def layer_ids(self) -> list[int]:
        return list(dict.fromkeys(s.layer for s in self.sections))

    def rows(self, i: int) -> int:
        """Rows layer i holds."""
        return next(s.shape[0] for s in self.sections if s.layer == i and s.part == "pos")

    def shape(self) -> tuple[int, int, int]:
        """(batch, KV heads, head dim) of every layer."""
        k = next(s for s in self.sections if s.part == "k")
        return k.shape[0], k.shape[1], k.shape[3]

    def tensor(self, s: Section) -> torch.Tensor:
        return self.buffer[s.offset:s.offset + s.nbytes].view(STORE_DTYPES[s.dtype]).view(s.shape)

    def layer(self, i: int) -> StoredKV:
        """Layer i's host tensors (views into the buffer); call synchronize() first if the copy may be in flight."""
        t = {s.part: self.tensor(s) for s in self.sections if s.layer == i}
        return StoredKV(t["k"], t["v"], t["pos"], t.get("k_scale"), t.get("v_scale"))

    def done(self) -> bool:
        return self.ready is None or self.ready.query()

    def synchronize(self) -> None:
        """Block until the device -> host copy is done; then the source KV may be freed."""
        if self.ready is not None:
            self.ready.synchronize()
        self.ready, self._source = None, None

    def release(self) -> None:
        """The shard leaves the host for good: its arena range goes back now (after its copies), not when
        the last reference to this HostKV goes (a scheduler may keep one). The buffer becomes a meta
        tensor of the same size: reading it raises instead of returning another shard's bytes."""
        self.synchronize()
        if self._free is not None:
            self._free()
            self._free = None
        self.buffer = torch.empty(self.buffer.numel(), dtype=torch.uint8, device="meta")


def _layer_parts(stored: StoredKV) -> dict[str, torch.Tensor]:
    return dict(pos=stored.pos, k=stored.k, v=stored.v, k_scale=stored.k_scale, v_scale=stored.v_scale)


def _in_order(layer: LayerKV) -> StoredKV:
    """A layer's held rows as stored, from its oldest write: a trimmed layer whose single-token writes went
    round its ring (head past row 0) is rolled so that its next write would append (the host copy keeps no
    ring state); every other layer as it is (no copy). Attention masks by position, not row order."""
    stored = layer.stored()
    if not (layer.trimmed and layer.ring_full() and layer.head):
        return stored

    def roll(t, dim):
        if t is None:
            return None
        src = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # roll takes no e4m3
        return torch.roll(src, -layer.head, dim).view(t.dtype)
    return StoredKV(roll(stored.k, 2), roll(stored.v, 2), roll(stored.pos, 0), roll(stored.k_scale, 2),
                    roll(stored.v_scale, 2))


def to_host(kv: KVCache, stream: torch.cuda.Stream | None = None, arena: PinnedArena | None = None,
            serves_from: int = 0, context_len: int | None = None) -> HostKV:
    """Copy a KV shard's filled rows into one host buffer (a range of `arena` when it has room, else
    pageable). CUDA: asynchronous on `stream` (default: a new side stream) after the work already queued
    on the current stream; the returned HostKV's `ready` event says when. CPU: a plain copy, done on return.
    A window-trimmed shard keeps each layer's rows and window; `serves_from`: its cache entry's (a trimmed
    entry's is its document's length, CacheEntry.serves_from), which travels with it to a file and back."""
    layer_ids = list(kv.layers)
    if not layer_ids:
        raise ValueError("to_host: the KV cache holds no layers")
    first = kv.layers[layer_ids[0]]
    rows = {i: layer.length for i, layer in kv.layers.items()}
    lengths = {layer.length for layer in kv.layers.values() if not layer.trimmed}
    if len(lengths) > 1:
        raise ValueError(f"to_host: the layers keeping every key hold different lengths {sorted(lengths)}; "
                         "a cache entry's layers agree")
    n = kv.length
    b, h, _, d = first.k.shape
    sections, nbytes = layout(layer_ids, b, h, d, rows, first.dtype, first.fp8)
    cuda = kv.device.type == "cuda"
    ready = torch.cuda.Event() if cuda else None  # recorded below; whoever frees the buffer waits on it
    windows = {i: layer.window for i, layer in kv.layers.items() if layer.trimmed}
    host = own(HostKV(host_buffer(nbytes, arena), sections, first.dtype, first.fp8, n, kv.next_position,
                      windows, serves_from, context_len=context_len, _copies=[ready] if cuda else []), arena)
    ends = [s.offset + s.nbytes for s in sections]
    for end, nxt in zip(ends, [s.offset for s in sections[1:]] + [nbytes]):
        host.buffer[end:nxt].zero_()  # the gaps between sections: never stale process memory in a file
    if cuda:
        stream = stream or torch.cuda.Stream(kv.device)
        stream.wait_stream(torch.cuda.current_stream(kv.device))  # the KV's writes are queued there
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        for i in layer_ids:
            parts = _layer_parts(_in_order(kv.layers[i]))
            for s in (s for s in sections if s.layer == i):
                host.tensor(s).copy_(parts[s.part], non_blocking=cuda)
                if cuda:
                    parts[s.part].record_stream(stream)  # not reused by the allocator before the copy is done
        if cuda:
            host.ready = ready
            host.ready.record(stream)
            host._source = kv
    return host


@dataclass
class DeviceLoad:
    """A shard on its way to the device: `kv` (exactly `length` rows held, plus the extra capacity asked)
    is complete for layer i once `events[i]` has passed (CUDA); on the CPU everything is done on return."""

    kv: KVCache
    events: dict[int, torch.cuda.Event]
    host: HostKV | None  # kept alive until the copies are done (their source is its pinned buffer)
    started: float = field(default_factory=time.perf_counter)
    on_done: Callable[[float], None] | None = None  # called once by synchronize() with the seconds taken
    release_host: bool = False  # release() the HostKV once the copies are done (it left the host tier)

    def wait(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait until layer `layer` is on the device; no host sync."""
        ev = self.events.get(layer)
        if ev is not None:
            (stream or torch.cuda.current_stream(self.kv.device)).wait_event(ev)

    def wait_all(self, stream: torch.cuda.Stream | None = None) -> None:
        for i in self.events:
            self.wait(i, stream)

    def done(self) -> bool:
        return all(ev.query() for ev in self.events.values())

    def synchronize(self) -> float:
        """Block until every layer is on the device; the seconds since the load started."""
        for ev in self.events.values():
            ev.synchronize()
        seconds = time.perf_counter() - self.started
        if self.release_host and self.host is not None:
            self.host.release()
        self.host = None
        if self.on_done is not None:
            self.on_done(seconds)
            self.on_done = None
        return seconds


class DeviceLoader:
    """to_device in steps: the KVCache is allocated at once and each layer copied when `copy_layer(i)` is
    called, e.g. as soon as a disk read has brought that layer's bytes in (kv_file.read_kv_host's
    on_layer), so the host -> device copies overlap the rest of the read."""

    def __init__(self, host: HostKV, device, extra_capacity: int = 0, stream: torch.cuda.Stream | None = None):
        if extra_capacity < 0:
            raise ValueError(f"extra_capacity must be >= 0, got {extra_capacity}")
        self.host, self.device = host, torch.device(device)
        b, h, d = host.shape()
        self.kv = KVCache([], b, h, d, 0, host.dtype, self.device, host.fp8)
        self.kv.layers = {i: LayerKV(b, h, d, host.rows(i) + extra_capacity, host.dtype, self.device, host.fp8,
                                     host.windows.get(i)) for i in host.layer_ids}  # each layer its own rows
        self.kv.next_position = host.next_position
        self.copied: set[int] = set()
        self.cuda = self.device.type == "cuda"
        self.stream = None
        if self.cuda:
            self.stream = stream or torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the new memory may be in use before
            if host.ready is not None:
                self.stream.wait_event(host.ready)
        elif host.ready is not None:
            host.synchronize()
        self.events: dict[int, torch.cuda.Event] = {}
        self.started = time.perf_counter()

    def copy_layer(self, i: int, src: HostKV | None = None) -> None:
        """Copy layer i from the shard's buffer, or from `src` (another HostKV holding layer i's sections, e.g.
        a reused staging window: disk_staging.py; its _copies get this copy's event)."""
        host = src if src is not None else self.host
        layer, n = self.kv.layers[i], host.rows(i)
        dst = _layer_parts(StoredKV(layer.k[:, :, :n], layer.v[:, :, :n], layer.pos[:n],
                                    *((layer.k_scale[:, :, :n], layer.v_scale[:, :, :n]) if host.fp8 else (None, None))))
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for s in (s for s in host.sections if s.layer == i):
                dst[s.part].copy_(host.tensor(s), non_blocking=self.cuda)
            layer.length, layer.head = n, n % layer.capacity if layer.capacity else 0
            self.copied.add(i)
            if self.cuda:
                for t in (layer.k, layer.v, layer.pos, layer.k_scale, layer.v_scale):
                    if t is not None:
                        t.record_stream(self.stream)  # allocated on the consumer's stream, written on this one
                self.events[i] = torch.cuda.Event()
                self.events[i].record(self.stream)
                host._copies[:] = [ev for ev in host._copies if not ev.query()] + [self.events[i]]

    def finish(self) -> DeviceLoad:
        """The load, once copy_layer has been called for every layer."""
        missing = [i for i in self.kv.layers if i not in self.copied and self.host.rows(i)]
        if missing:
            raise RuntimeError(f"DeviceLoader.finish: layers {missing} were never copied")
        return DeviceLoad(self.kv, self.events, self.host if self.cuda else None, self.started)


def to_device(host: HostKV, device, extra_capacity: int = 0, stream: torch.cuda.Stream | None = None) -> DeviceLoad:
    """Rebuild a KVCache of the shard on `device` with room for `extra_capacity` more rows. CUDA: copies
    run layer by layer on `stream` (default: a new side stream) with one event per layer (DeviceLoad.wait);
    a HostKV still being filled by to_host is waited for on that stream, not on the host."""
    loader = DeviceLoader(host, device, extra_capacity, stream)
    for i in host.layer_ids:
        loader.copy_layer(i)
    return loader.finish()


@dataclass
class HostEntry:
    id: int  # the context cache's entry id
    ids: np.ndarray  # the token ids whose KV the shard holds
    kv: HostKV
    rank_bytes: list[int] | None = None  # every CP rank's shard bytes, when the caller plans for all ranks
    last_used: int = 0
    hits: int = 0
    writing: bool = False  # its disk write is in flight: neither evicted nor moved up (a promotion copies it)
    written: bool = False  # its file is on disk on every rank: dropping it loses nothing

    def bytes_on(self, rank: int) -> int:
        return self.kv.nbytes if self.rank_bytes is None else self.rank_bytes[rank]

    @property
    def serves_from(self) -> int:
        """The fewest shared tokens it serves (a window-trimmed entry's document: context_cache.served_prefix)."""
        return self.kv.serves_from


class HostTier:
    """Host copies by entry id, LRU within `budget_bytes` on each of `ranks` ranks. As ContextCache:
    given every rank's bytes (`rank_bytes`), every rank makes the same evictions, so rank 0's plan holds
    everywhere; without them a rank counts its own shard."""

    def __init__(self, budget_bytes: int, ranks: int = 1, arena: PinnedArena | None = None):
        if budget_bytes <= 0:
            raise ValueError(f"the host cache budget must be > 0 bytes (--host-cache-gib), got {budget_bytes}")
        if arena is not None and arena.nbytes != budget_bytes:
            raise ValueError(f"the host tier's arena holds {arena.nbytes} bytes, its budget is {budget_bytes}")
        self.budget = budget_bytes
        self.arena = arena  # where to_host / read_kv_host carve this tier's buffers from (None: pageable)
        self.ranks = ranks
        self.entries: dict[int, HostEntry] = {}
        self._clock = itertools.count(1)
        self._stats = TierStats()

    def used(self, rank: int = 0) -> int:
        return sum(e.bytes_on(rank) for e in self.entries.values())

    @property
    def stats(self) -> TierStats:
        held = list(self.entries.values())  # one snapshot: the step loop may move entries meanwhile
        self._stats.entries = len(held)
        self._stats.bytes = sum(e.kv.nbytes for e in held)
        self._stats.unpinned_fallbacks = self.arena.fallbacks if self.arena is not None else 0
        return self._stats

    def plan_room(self, need: int | list[int], keep: int | None = None) -> list[int] | None:
        """Entry ids to evict (LRU first) so that `need` more bytes fit on every rank; None if they never can."""
        need = [need] * self.ranks if isinstance(need, int) else list(need)
        free = [self.budget - self.used(r) - need[r] for r in range(self.ranks)]
        victims = []
        for e in sorted(self.entries.values(), key=lambda e: e.last_used):
            if min(free) >= 0:
                break
            if e.id == keep:
                continue
            victims.append(e.id)
            free = [f + e.bytes_on(r) for r, f in enumerate(free)]
        return victims if min(free) >= 0 else None

    def put(self, entry_id: int, ids, kv: HostKV, rank_bytes: list[int] | None = None) -> list[HostEntry]:
        """Hold a shard (a demotion from the device); evicts LRU entries to make room and returns them
        (the caller may demote them further, to disk). A shard larger than the budget is refused (ValueError)."""
        if rank_bytes is not None and len(rank_bytes) != self.ranks:
            raise ValueError(f"rank_bytes has {len(rank_bytes)} values for {self.ranks} ranks")
        entry = HostEntry(entry_id, np.asarray(ids, dtype=np.int64), kv, rank_bytes)
        old = self.entries.pop(entry_id, None)
        victims_ids = self.plan_room([entry.bytes_on(r) for r in range(self.ranks)])
        if victims_ids is None:
            if old is not None:
                self.entries[entry_id] = old
            biggest = max(entry.bytes_on(r) for r in range(self.ranks))
            raise ValueError(f"a {biggest / 2**30:.2f} GiB shard does not fit "
                             f"the host cache budget of {self.budget / 2**30:.2f} GiB: raise --host-cache-gib")
        victims = [self.entries.pop(i) for i in victims_ids]
        self._stats.evictions += len(victims)
        entry.last_used = next(self._clock)
        self.entries[entry_id] = entry
        self._stats.demotions += 1
        return victims

    def hold(self, entry_id: int, ids, kv: HostKV, rank_bytes: list[int] | None = None) -> None:
        """Hold a shard whose room the caller planned (the scheduler, for every rank at once): nothing is
        evicted here. The tier may be over its budget within a step, until that step's promotion takes
        the entry it counted as leaving."""
        self.entries[entry_id] = HostEntry(entry_id, np.asarray(ids, dtype=np.int64), kv, rank_bytes,
                                           next(self._clock))
        self._stats.demotions += 1

    def take(self, entry_id: int) -> HostEntry | None:
        """Remove an entry that moves on (down to disk, or up to the device): not counted as an eviction."""
        return self.entries.pop(entry_id, None)

    def peek(self, ids, min_tokens: int = 1, whole: bool = False) -> tuple[HostEntry | None, int]:
        """lookup without counting or touching (a scheduler scans its queue with it); whole: see longest_prefix."""
        return longest_prefix(self.entries.values(), np.asarray(ids, dtype=np.int64), min_tokens, whole)

    def lookup(self, ids, min_tokens: int = 1) -> tuple[HostEntry | None, int]:
        """The entry sharing the longest prefix with `ids` and that length, capped at len(ids) - 1 (as
        ContextCache.lookup: one prompt token always runs); (None, 0) below `min_tokens`."""
        self._stats.lookups += 1
        best, best_n = self.peek(ids, min_tokens)
        if best is None:
            return None, 0
        self._stats.hits += 1
        best.hits += 1
        best.last_used = next(self._clock)
        return best, best_n

    def get(self, entry_id: int) -> HostEntry | None:
        e = self.entries.get(entry_id)
        if e is not None:
            e.last_used = next(self._clock)
        return e

    def load(self, entry_id: int, device, extra_capacity: int = 0, stream: torch.cuda.Stream | None = None,
             keep: bool = True) -> DeviceLoad:
        """Promote: start copying entry `entry_id` to `device` (to_device). keep=False drops the host copy
        (its buffer lives on in the DeviceLoad until the copies are done). The reload's seconds are
        observed when the load is synchronized (CPU: at once)."""
        e = self.entries[entry_id] if keep else self.entries.pop(entry_id)
        e.last_used = next(self._clock)
        load = to_device(e.kv, device, extra_capacity, stream)
        load.on_done = self._stats.observe_reload
        if not keep:
            load.host, load.release_host = e.kv, True  # its range goes back once the copies are done
        if not load.events:
            load.synchronize()
        return load

    def evict(self, entry_ids: list[int]) -> list[HostEntry]:
        """Drop entries: their buffers go back to the arena (released: the returned entries' bytes are gone)."""
        out = [self.entries.pop(i) for i in entry_ids if i in self.entries]
        for e in out:
            e.kv.release()
        self._stats.evictions += len(out)
        return out
