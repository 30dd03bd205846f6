"""The operations of one service step: what the scheduler (rank 0) decides and every rank's executor
applies, in order. A step is a list of them, broadcast from rank 0 as one pickled object (plain
dataclasses: the receiving ranks import this module, so the types arrive as they were sent).

A step runs one prefill-side action (a whole prefill, one chunk of a document's prefill, or an extend,
after any evictions, demotions and a promotion) or decodes, never both; finish and abort can come first
in either, and finish alone between steps when requests end.
"""
from __future__ import annotations

from dataclasses import dataclass

from starshard.config import SamplingConfig


@dataclass(frozen=True)
class Evict:
    """Remove these cache entries (least recently used first) to make room inside the budget, from the
    tier that holds each (the device, or the host tier)."""

    entries: list[int]


@dataclass(frozen=True)
class Demote:
    """Move entry `entry` one tier down instead of dropping it: from the device to "host" or "disk", or
    from the host tier to "disk". Each rank moves its own shard; the entry leaves the tier above (the
    budgets rank 0 planned count it gone). A disk write that fails on a rank leaves that rank without the
    file: a later promotion then falls back to a prefill on every rank. A disk write runs in the background
    (serving/disk_writer.py): a host entry stays in the host tier (servable, not evictable) until its write
    is committed on every rank; a device entry's shard is not servable until then."""

    entry: int
    to: str  # "host" | "disk"


@dataclass(frozen=True)
class Promote:
    """Bring an entry back to the device as cache entry `entry`: from the host tier (the same id), or from
    the disk tier (every rank loads its own file of exactly `ids`). Reusable only once complete on every
    rank; if any rank cannot load its shard, no rank keeps it, the lower tier's copy is dropped everywhere,
    and an Extend on it fails with code "reload_failed" (the scheduler prefills that request instead)."""

    entry: int
    source: str  # "host" | "disk"
    ids: list[int] | None  # the entry's token ids (disk; None for host: every rank holds them)
    rank_bytes: list[int]  # the entry's bytes on each CP rank, as the device budget counts them
    copy_of: int | None = None  # host: the entry copied, which stays in the host tier (its disk write is in flight)


@dataclass(frozen=True)
class Finish:
    """These requests leave the batch; the entries they held become evictable."""

    rids: list[int]


@dataclass(frozen=True)
class Prefill:
    """Run a whole prompt through the runner (any context strategy); its KV becomes cache entry
    `entry` and the request decodes on it."""

    rid: int
    ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    entry: int  # the new entry's id
    context_len: int  # the prompt's document part (Prompt.context_len)
    head_len: int
    pinned: bool  # not for reuse (APB: its KV depends on the question); dropped when its request ends


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill step of a document: prompt tokens [start, end) (runner.prefill_bounds with `chunk`)
    into cache entry `entry`. The first chunk (start 0, the only one that carries `ids`) allocates the
    entry at its exact per-rank shard for the chunked layout; until the last chunk the entry is filling:
    neither evictable nor reusable. The last chunk samples the first token and the request joins the
    batch."""

    rid: int
    entry: int
    start: int
    end: int
    chunk: int  # the prefill's step size (the shard layout depends on it)
    knee: int | None  # the steps' taper (partition.prefill_steps; the layout depends on it too); None: uniform
    prompt_len: int
    ids: list[int] | None  # the whole prompt on the first chunk; None after (every rank kept it)
    max_tokens: int
    sampling: SamplingConfig
    context_len: int
    head_len: int
    # A split reload's entry (ReadTail): its steps fill the entry only; the last one (a read that failed, the
    # rest computed) samples nothing and adds no row: the entry becomes reusable and the request extends it.
    fill: bool = False

    @property
    def last(self) -> bool:
        return self.end == self.prompt_len


@dataclass(frozen=True)
class ReadTail:
    """--disk-reload-policy split: every rank reads its own disk file of exactly `ids` from the end backward,
    down to the rows at positions >= `cut` (serving/tail_read.py), on a thread, while PrefillChunk(fill=True)
    steps compute the head [0, cut) into cache entry `entry`. Sent again with another cut: a re-plan."""

    entry: int
    ids: list[int]
    cut: int


@dataclass(frozen=True)
class JoinTail:
    """The head of `entry` is computed up to `cut`: each rank waits for its tail read and copies those rows
    after the head's, then one vote. Every rank read its tail: the entry is complete and reusable. Else
    the request `rid` fails this step with code "tail_failed" (an Extend after it is skipped), the entry stays
    filling with its head, and the scheduler computes the rest."""

    rid: int
    entry: int
    cut: int
    nbytes: int = 0  # the tail's bytes over every rank's shards (rank 0's reload rate learns from its read)


@dataclass(frozen=True)
class Abort:
    """Drop a filling entry (a document's prefill cancelled, timed out or failed between its chunks)."""

    rid: int
    entry: int


@dataclass(frozen=True)
class Extend:
    """Run only the prompt's tokens after its first `prefix`, which cache entry `entry` holds:
    attention reads the entry's first `prefix` tokens (cascade.py), the prefill is skipped."""

    rid: int
    ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    entry: int
    prefix: int


@dataclass(frozen=True)
class Decode:
    """One token for every running request, in one forward."""


Op = Evict | Demote | Promote | Finish | Prefill | PrefillChunk | ReadTail | JoinTail | Abort | Extend | Decode
