"""The context cache: prefilled prompts' KV kept resident (each rank its shard) so that a request
beginning with the same tokens (another question on the same document, a follow-up turn) runs only
the rest.

An entry holds the KV of one prefilled token sequence. Keys carry their global positions, so an
entry that keeps every key serves any prefix of itself: attention masks keys at positions >= the shared
length. A window-trimmed entry (a sliding-window model's local layers keep only the keys a continuation
after its document sees once the prefill ends: Scheduler(window_trim=)) serves only prompts that share
at least its document, or all but the last token of a prompt that is all document (`trim_start`,
`served_prefix`, the rule of every lookup). Entries
are evicted least-recently-used within a byte budget per rank, never while a request uses them. Every
rank holds the same entries (the service executes the same steps on every rank), each with its own
shard; the accounting counts every rank's shard (CacheEntry.rank_bytes), so the worst rank decides.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from starshard.engine.kv_cache import KVCache


def kv_bytes(cache: KVCache) -> int:
    """Bytes a KV cache holds allocated (capacity, not length: what the budget must cover)."""
    return sum(kv.nbytes() for kv in cache.layers.values())


@dataclass
class CacheEntry:
    id: int
    ids: np.ndarray  # the token ids whose KV the entry holds, in prompt order
    kv: KVCache | None  # this rank's shard; None on a rank that only plans (never)
    nbytes: int  # the largest shard's bytes (stats)
    users: int = 0
    last_used: int = 0
    pinned: bool = False  # not for reuse (APB: its KV depends on the question); dropped when unused
    hits: int = field(default=0)
    rank_bytes: list[int] | None = None  # each CP rank's shard in bytes (None: nbytes on one rank)
    filling: bool = False  # its prefill still runs chunk by chunk: not reusable yet (its request holds it)
    serves_from: int = 0  # the fewest shared tokens it serves (0: any; window-trimmed: its document's, served_prefix)
    context_len: int | None = None  # its prompt's document part (Star's layout depends on it; None: unknown)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def trimmed(self) -> bool:
        return self.serves_from > 0

    def bytes_on(self, rank: int) -> int:
        return self.nbytes if self.rank_bytes is None else self.rank_bytes[rank]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def served_prefix(entry, shared: int) -> int:
    """The leading tokens of a prompt that `entry` serves when they share `shared` tokens (0: none, the
    prompt is prefilled). An entry keeping every key serves any prefix of itself. A window-trimmed one of
    a document of C tokens (`entry.serves_from` = C: each local layer holds only the keys at positions
    >= C - (window - 1), and every key after them) serves a prompt sharing at least those C tokens: a
    continuation after m >= C tokens sees only keys past m - window. After m < C tokens it would need
    local keys the entry dropped: it serves none (a question after the whole document is the main case;
    a prompt reusing only part of a document is prefilled)."""
    return shared if shared >= getattr(entry, "serves_from", 0) else 0


def trim_start(context_len: int, length: int) -> int:
    """Where a window-trimmed entry of a `length`-token prompt whose document is `context_len` tokens begins
    to serve (Executor._trim's start, CacheEntry.serves_from): the document's end, at most length - 1. A
    prompt always runs its last token (longest_prefix's cap), so the same prompt sent again shares length - 1
    tokens: a prompt that is all document (the completions API) keeps one key more in each local layer and
    serves itself again, and any continuation of itself."""
    return min(context_len, length - 1)


def longest_prefix(entries, ids: np.ndarray, min_tokens: int = 1, whole: bool = False):
    """(the entry serving the longest prefix of `ids` (served_prefix), that length capped at len(ids) - 1, so
    at least one token always runs), or (None, 0) below `min_tokens`: the lookup of every cache tier.
    `entries`: objects with `.ids` (and `.serves_from`, else 0), already filtered by the caller.
    whole: no cap, `ids` may be an entry's own tokens (finding an entry to move, not a prompt to run: a
    window-trimmed entry serves no prefix shorter than itself)."""
    best, best_n, cap = None, 0, len(ids) if whole else len(ids) - 1
    for e in entries:
        n = served_prefix(e, min(common_prefix(e.ids, ids), cap))
        if n > best_n:
            best, best_n = e, n
    if best is None or best_n < min_tokens:
        return None, 0
    return best, best_n


class ContextCache:
    """Entries by id, LRU eviction inside `budget_bytes` on each of `ranks` CP ranks. The scheduler
    decides (on rank 0) and every rank applies the same calls, so the entries agree across the group."""

    def __init__(self, budget_bytes: int, ranks: int = 1):
        if budget_bytes <= 0:
            raise ValueError(f"the context cache budget must be > 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.ranks = ranks
        self.entries: dict[int, CacheEntry] = {}
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)
        self.lookups = 0
        self.hits = 0

    def used(self, rank: int) -> int:
        """Bytes CP rank `rank` holds in entries."""
        return sum(e.bytes_on(rank) for e in self.entries.values())

    @property
    def used_bytes(self) -> int:
        """The fullest rank's bytes."""
        return max(self.used(r) for r in range(self.ranks))

    def lookup(self, ids: np.ndarray, min_tokens: int = 1) -> tuple[CacheEntry | None, int]:
        """The reusable entry sharing the longest prefix with `ids` and that length (0: none).
        At least one prompt token is always left to run (its logits give the first new token)."""
        self.lookups += 1
        best, best_n = self.peek(ids, min_tokens)
        if best is not None:
            self.hits += 1
        return best, best_n

    def peek(self, ids: np.ndarray, min_tokens: int = 1, whole: bool = False) -> tuple[CacheEntry | None, int]:
        """lookup without counting (the scheduler scans its queue with it); whole: see longest_prefix."""
        return longest_prefix((e for e in self.entries.values() if not (e.pinned or e.filling)), ids, min_tokens,
                              whole)

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, entry: CacheEntry) -> None:
        if entry.kv is not None and entry.kv.trimmed and not entry.trimmed:  # it would serve shorter prefixes
            raise ValueError("ContextCache: a trimmed KV cache (local layers keep only their window) cannot be a "
                             "context cache entry unless marked CacheEntry.trimmed (served_prefix: it serves no "
                             "shorter prefix of itself)")
        self.entries[entry.id] = entry
        self.touch(entry)

    def touch(self, entry: CacheEntry) -> None:
        entry.last_used = next(self._clock)

    def acquire(self, entry: CacheEntry) -> None:
        entry.users += 1
        self.touch(entry)

    def release(self, entry: CacheEntry) -> None:
        entry.users -= 1
        self.touch(entry)
        if entry.users == 0 and entry.pinned:
            self.entries.pop(entry.id, None)

    def evictable(self) -> list[CacheEntry]:
        """Unused entries, least recently used first."""
        return sorted((e for e in self.entries.values() if e.users == 0), key=lambda e: e.last_used)

    def plan_room(self, need: int | list[int], keep: int | None = None) -> list[int] | None:
        """Entry ids to evict (LRU first) until `need` more bytes (one value per rank, or the same on
        every rank) fit on every rank beside its entries, never entry `keep` (the one about to be
        reused); None when even evicting every other unused entry leaves too little room."""
        need = [need] * self.ranks if isinstance(need, int) else list(need)
        free = [self.budget - self.used(r) - need[r] for r in range(self.ranks)]
        victims = []
        for e in self.evictable():
            if min(free) >= 0:
                break
            if e.id == keep:
                continue
            victims.append(e.id)
            free = [f + e.bytes_on(r) for r, f in enumerate(free)]
        return victims if min(free) >= 0 else None

    def evict(self, entry_ids: list[int]) -> None:
        busy = [i for i in entry_ids if i in self.entries and self.entries[i].users]
        if busy:
            raise RuntimeError(f"context cache entries {busy} cannot be evicted while requests use them")
        for i in entry_ids:
            self.entries.pop(i, None)
