"""What every rank of the service runs: the scheduler's operations (serving/ops.py: prefill,
extend, decode, finish, evict, demote, promote; serving/scheduler.py decides them on rank 0) applied to
this rank's model, KV shards, cache entries (in every tier) and batch. Every rank holds the same entries
and rows, each with its own shard."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from starshard.config import SamplingConfig
from starshard.engine.kv_cache import KVCache
from starshard.engine.sampling import sample
from starshard.kernels.common import DECODE_MAX_ROWS, to_device
from starshard.planner import Layout, Workload, plan_memory
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.runtime.prompt import Prompt
from starshard.serving.cascade import CascadeAttention, CascadeGraph, OwnKV, SharedGroup, TableCascade, run_cascade
from starshard.serving.context_cache import CacheEntry, ContextCache, kv_bytes, trim_start
from starshard.serving.disk_writer import FAILED as WRITE_FAILED
from starshard.serving.disk_writer import QUEUED, WRITTEN
from starshard.serving.host_tier import to_host
from starshard.serving.kv_file import read_header
from starshard.serving.ops import (
    Abort,
    Decode,
    Demote,
    Evict,
    Extend,
    Finish,
    JoinTail,
    Op,
    Prefill,
    PrefillChunk,
    Promote,
    ReadTail,
)
from starshard.serving.step_clock import StepClock, mark, seconds_between, step_kind
from starshard.serving.tail_read import TailRead
from starshard.serving.tiers import Tiers

log = logging.getLogger("starshard.serve")

# A failed request's code (TokenEvent.error_code), as the votes carry it: 0 is success.
INSUFFICIENT_MEMORY, REJECTED, FAILED = 1, 2, 3
CODE_NAMES = {INSUFFICIENT_MEMORY: "insufficient_memory", REJECTED: "rejected", FAILED: "failed"}
# An extend whose entry could not be promoted on every rank: the scheduler prefills the request instead.
RELOAD_FAILED = "reload_failed"
# A split reload's tail could not be read on every rank (JoinTail): the scheduler computes the rest of the entry.
TAIL_FAILED = "tail_failed"
MEMORY_MARGIN = 1.05  # the pre-check wants this much more free memory than a step's estimate
# Table graphs (cascade.TableCascade): one CUDA graph per (batch size, own-KV capacity bucket), bound anew when the
# batch changes. Buckets are powers of two from TABLE_MIN_CAPACITY; each keeps one own-KV store of
# DECODE_MAX_ROWS rows that its graphs view, and the stores kept stay within TABLE_STORE_BYTES (least recently
# used bucket dropped first; a bucket whose store alone is larger is captured per batch, as before).
TABLE_MIN_CAPACITY = 128
TABLE_STORE_BYTES = 1 << 30
# The warm-up checks one kept graph against the per-batch path on a random entry of this many rows (relative
# error of the logits, max |delta| / max |logit|: bf16 steps that merge partials in another order differ ~1e-2).
TABLE_CHECK_ROWS = 300
TABLE_CHECK_TOL = 0.05


class InsufficientMemory(Exception):
    """The memory pre-check refused a step before it allocated."""


def _code(e: BaseException) -> int:
    if isinstance(e, (torch.OutOfMemoryError, InsufficientMemory)):
        return INSUFFICIENT_MEMORY
    return REJECTED if isinstance(e, ValueError) else FAILED


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 100 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Failure:
    """Why a request failed, decided alike on every rank: its code (CODE_NAMES) and a message naming
    the rank and the sizes."""

    code: str
    message: str


@dataclass
class Fault:
    """Test hook (Executor.faults): raise `error` for request `rid` in phase "prepare" (before any
    allocation), "compute" (after its prefill or extend forward, where the join allocates) or "decode" (a
    decode step it is in; one process only) on global rank `rank` (None: every rank)."""

    phase: str
    rid: int
    error: BaseException
    rank: int | None = None


@dataclass
class _Admission:
    """What a prefill or extend built on this rank, committed only once every rank voted success."""

    op: object
    kv: object = None  # a prefill's new entry KV
    prompt: Prompt | None = None  # a chunked prefill's prompt
    rank_bytes: list[int] | None = None
    entry: CacheEntry | None = None
    own: OwnKV | None = None  # an extend's own-token KV (query rank)
    new_entry: bool = True
    hit: bool = False
    gen: torch.Generator | None = None
    token: int = 0
    row: "Row | None" = None
    pool: OwnKV | None = None  # the batch's pool with the new row
    marks: list = field(default_factory=list)  # a timed chunked prefill's (start, end) per chunk (Executor._mark)
    untimed: tuple | None = None  # a split reload's last fill step and its marks, timed once the next is queued


@dataclass
class _ExtendBatch:
    """Extends that run as one forward (Executor._extend_together); `rid`: the first's, for the fault hook."""

    ops: list[Extend]

    @property
    def rid(self) -> int:
        return self.ops[0].rid


def _batched(ops: list[Op]) -> list:
    """The step's operations with each run of consecutive extends of one entry, with equal prefix and
    suffix lengths, as one list (one forward); everything else as it came."""
    out: list = []
    for op in ops:
        prev = out[-1] if out else None
        last = prev[-1] if isinstance(prev, list) else prev
        if (isinstance(op, Extend) and isinstance(last, Extend) and op.entry == last.entry
                and op.prefix == last.prefix and len(op.ids) == len(last.ids)):
            if isinstance(prev, list):
                prev.append(op)
            else:
                out[-1] = [last, op]
        else:
            out.append(op)
    return out


@dataclass
class Row:
    """A running request as every rank holds it."""

    rid: int
    entry: CacheEntry
    prefix: int  # leading tokens shared with the entry
    next_pos: int  # position of the next token to run
    last_token: int
    remaining: int  # tokens it may still generate after last_token
    sampling: SamplingConfig
    gen: torch.Generator | None
    pool: OwnKV | None  # own-token KV (query rank only) and its row in it
    pool_row: int = 0


@dataclass
class _Bucket:
    """The table graphs of one own-KV capacity: their shared store (query rank; None elsewhere) and the graph of
    each batch size."""

    store: OwnKV | None
    graphs: dict[int, CascadeGraph] = field(default_factory=dict)


@dataclass
class _Issued:
    """A decode step issued to the device and not read yet: its rows in batch order and their sampled
    tokens [B], on the device (every rank of the CP group holds them). On CUDA `host` is their page-locked copy,
    in flight until `ready`: reading waits for this step alone, not the one queued after it."""

    rows: list[Row]
    tokens: torch.Tensor
    step: int
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


class Executor:
    """Runs the scheduler's operations on this rank. The same instance state on every rank: the
    scheduler's decisions (rank 0) arrive as lists of operations (serving/ops.py)."""

    def __init__(self, runner, cache: ContextCache, cuda_graphs: bool = True, *, control=None, config=None,
                 tp: int = 1):
        self.runner = runner
        self.tiers: Tiers | None = None  # the host and disk tiers (Scheduler sets them: they need token_bytes)
        self.lost: set[int] = set()  # entries whose promotion failed: an extend on one fails with RELOAD_FAILED
        # Demotions to disk not yet settled (entry id, in op order: the same on every rank, whatever happened
        # locally), and those settled since rank 0's scheduler last drained them: (entry id, committed)
        self.writes: dict[int, None] = {}
        self.settled: list[tuple[int, bool]] = []
        self.control = control  # the gloo group over every rank (the step broadcast's); None in one process
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.config, self.tp = config, tp  # the model's config and tp, for a step's working set (work_bytes)
        self.faults: list[Fault] = []  # test hook: errors to raise for given requests (Fault)
        # rank 0's scheduler: (op, seconds) of each completed prefill (whole, or its chunks' sum) and promotion,
        # which its disk reload policy learns from (serving/reload_policy.py); None: nothing is timed
        self.on_timing: Callable[[Op, float], None] | None = None
        self.model = runner.model
        self.cache = cache
        strategy = getattr(runner, "strategy", None)
        self.strategy = strategy  # None: one rank holds the whole prompt (one process, or tp only)
        self.cp = 1 if strategy is None else strategy.cp
        self.cp_rank = 0 if strategy is None else strategy.rank
        self.group = strategy.group if strategy is not None and strategy.cp > 1 else None
        self.query_rank = 0 if self.group is None else strategy.query_rank
        self.is_query_rank = self.group is None or strategy.is_query_rank
        # Last-row logits -> token: plain sampling, or vocab-parallel over the TP group (every TP rank
        # gets the same token).
        self.sampler = runner.sample if isinstance(runner, ContextParallelRunner) else getattr(runner, "sampler", sample)
        self.rows: list[Row] = []
        self.filling: dict[int, _Admission] = {}  # entry id -> a document whose prefill runs chunk by chunk
        # entry id -> its split reload's tail being read (ReadTail), or why it could not start
        self.tails: dict[int, TailRead | BaseException] = {}
        self.pool: OwnKV | None = None  # the batch's own KV, rebuilt when rows join or leave
        attn = self.model.layers[0].attention
        self.kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        norm = self.model.layers[0].attention_norm.weight  # the compute dtype (projections may hold FP8)
        self.dtype, self.device = norm.dtype, norm.device
        self.kv_fp8 = runner.kv_fp8
        # A finished prefill's local layers keep only what a continuation after its document sees (_trim)
        self.window_trim = False
        # Length-dependent RoPE (dynamic NTK, longrope) at the window's length for every request: cached
        # entries and batched rows then share one rotation.
        self.model.set_rope_length(None)
        # A decode step replays the CUDA graph of the batch's rows, captured at their first step (a join or a
        # leave changes the graph's shapes); every rank decides alike from the same operations.
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._graph: CascadeGraph | None = None
        self._captured = False  # a capture ran in this process: later ones need no eager run first
        # A batch on one entry replays the kept graph of its shape instead (_table_graph): 16-bit KV, global layers.
        self.table_graphs = self.cuda_graphs and not self.kv_fp8 and all(
            self.model.config.layer_window(i) is None for i in self.model.layer_ids)
        self._tables: dict[int, _Bucket] = {}  # capacity bucket -> its graphs, least recently used first
        self.clock: StepClock | None = None  # benchmarks: each step's device time and the idle time between steps
        # The host one step ahead: a decode step's tokens stay on the device, the next decode takes them as its
        # inputs there, and they are read at the end of the next step, once its work is queued (the device never
        # waits for the host between decode steps). False: read at the end of their own step (serialized).
        self.lookahead = True
        self._issued: _Issued | None = None
        self._decodes = 0  # decode steps issued
        self.trace: list[tuple[str, int]] | None = None  # test hook: ("issue" | "read", decode step) in order

    # -- sizes the scheduler plans with (pure arithmetic: rank 0 plans every rank's bytes)
    def token_bytes(self) -> int:
        """KV bytes of one token in a cache entry on one rank (k and v of every layer held, plus its position)."""
        if self.kv_fp8:  # e4m3 k and v plus one float32 scale each per head (engine/kv_cache.py)
            return len(self.model.layers) * (2 * self.kv_heads * (self.head_dim + 4) + 8)
        return self.own_token_bytes()

    def own_token_bytes(self) -> int:
        """KV bytes of one token in the own-KV pool: always the compute dtype (cascade.OwnKV)."""
        return len(self.model.layers) * (2 * self.kv_heads * self.head_dim * self.dtype.itemsize + 8)

    def entry_rank_bytes(self, prompt_len: int, context_len: int, chunk: int | None = None,
                         knee: int | None = None) -> list[int]:
        """What a prefilled entry of this prompt allocates on each CP rank: exactly its shard
        (StrategySpec.rank_rows; the runner allocates the same rows), prefilled `chunk` tokens a step,
        tapered after `knee` held tokens."""
        rows = [prompt_len] if self.strategy is None else self.strategy.rank_rows(prompt_len, context_len, chunk, knee)
        return [max(1, n) * self.token_bytes() for n in rows]

    def entry_bytes(self, n_tokens: int) -> int:
        """The largest shard of a prefilled entry of n tokens that are all context."""
        return max(self.entry_rank_bytes(n_tokens, n_tokens))

    def pool_rows(self) -> list[tuple[int, int]]:
        """(own tokens held, tokens it may still generate) of each running row: the pool's shape."""
        return [(r.next_pos - r.prefix, r.remaining) for r in self.rows]

    @staticmethod
    def pool_extra(remaining: list[int]) -> int:
        """Own-KV room per row beyond the longest own part, for rows that may still generate `remaining` tokens:
        the most remaining, + 1 beside another row, which may keep the batch decoding one step past this row's
        last token before the host reads it (lookahead). A row alone is never decoded past its last token."""
        return max(remaining + [0]) + (len(remaining) > 1)

    @classmethod
    def pool_capacity(cls, rows: list[tuple[int, int]]) -> int:
        """The own-KV pool's rows of capacity for rows of (own tokens, remaining), as OwnKV.gather sizes it."""
        return max(max(own for own, _ in rows) + cls.pool_extra([left for _, left in rows]), 1)

    def pool_bytes(self, rows: list[tuple[int, int]]) -> int:
        """The own-KV pool the query rank holds for rows of (own tokens, remaining) (pool_capacity)."""
        if not rows:
            return 0
        return len(rows) * self.pool_capacity(rows) * self.own_token_bytes()

    # -- failure containment (every rank takes the same decision: votes over the control group)
    def free_bytes(self) -> int | None:
        """Bytes this rank may still allocate (free on the card plus what torch holds unused); None
        off CUDA, where the memory pre-check is skipped. Tests override it."""
        if self.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def work_bytes(self, rows: int) -> int:
        """The working set of one forward of `rows` rows on this rank (the planner's activation peak of
        one layer and the last row's logits; attention assumed fused)."""
        if self.config is None or rows <= 0:
            return 0
        w = Workload(rows, rows, 0, None, self.dtype.itemsize)
        return plan_memory(self.config, Layout(tp=self.tp), w).worst.activations

    def _inject(self, rid: int, phase: str) -> None:
        for f in self.faults:
            if f.rid == rid and f.phase == phase and f.rank in (None, self.rank):
                raise f.error

    def _vote(self, code: int, need: int) -> list[tuple[int, int, int]]:
        """Every rank's (code, free bytes or -1, need bytes), the same list on every rank: one gloo
        all-gather on the control group (the one the step broadcast uses). Only a failing rank's free
        bytes are read (its message names them): a step queries the memory once, in its pre-check."""
        free = self.free_bytes() if code else None
        mine = (code, -1 if free is None else free, need)
        if self.control is None:
            return [mine]
        t = torch.tensor(mine, dtype=torch.long)
        out = [torch.zeros(3, dtype=torch.long) for _ in range(dist.get_world_size(self.control))]
        dist.all_gather(out, t, group=self.control)
        return [tuple(int(x) for x in o) for o in out]

    def _failure(self, votes, error: BaseException | None, what: str) -> Failure:
        """The request's error from the votes (identical on every rank; rank 0's message is sent)."""
        rank, (code, free, need) = next((r, v) for r, v in enumerate(votes) if v[0])
        free_s = "its free memory is unknown (not CUDA)" if free < 0 else f"{_size(free)} are free there"
        if code == INSUFFICIENT_MEMORY:
            msg = (f"out of memory: this request's {what} needs {_size(need)} on rank {rank} (its new KV and the "
                   f"step's working set) but {free_s}; other requests are unaffected; retry later, or start the "
                   f"server with a lower --cache-gib or --prefill-chunk")
        elif error is not None and rank == self.rank:
            msg = f"{what} failed on rank {rank}: {type(error).__name__}: {error}"
        else:
            msg = f"{what} failed on rank {rank} (see that rank's log)"
        return Failure(CODE_NAMES[code], msg)

    def _contained(self, op, prepare, compute, what: str):
        """prepare (host work and allocations, no collectives) / vote / compute (the forwards) / vote:
        a failure on any rank rolls the op back on every rank -> (result, None) or (None, Failure).
        Nothing is committed before both votes: a rollback drops what prepare and compute built.
        An exception raised on only some ranks inside a collective leaves the peers waiting there: that
        stays the dead-rank path (the dist timeout ends the server)."""
        state, err, code, need = None, None, 0, 0
        try:
            self._inject(op.rid, "prepare")
            state, need = prepare(op)
        except Exception as e:  # noqa: BLE001 (contained: every rank decides by the vote)
            err, code = e, _code(e)
        votes = self._vote(code, need)
        if any(v[0] for v in votes):
            state = None  # freed before empty_cache
            return None, self._fail(op, votes, err, what)
        result = None
        try:
            result = compute(op, state)
            self._inject(op.rid, "compute")
        except Exception as e:  # noqa: BLE001
            err, code = e, _code(e)
        votes = self._vote(code, need)
        if any(v[0] for v in votes):
            state = result = None
            return None, self._fail(op, votes, err, what)
        return result, None

    def _fail(self, op, votes, err, what: str) -> Failure:
        if err is not None:
            # Out of memory and refusals are the request's; anything else is a bug: keep its traceback.
            log.error("request %d: %s failed on this rank: %s: %s", op.rid, what, type(err).__name__, err,
                      exc_info=err if _code(err) == FAILED else None)
            err.__traceback__ = None  # its frames hold the step's tensors
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self._failure(votes, err, what)

    def _check_memory(self, need: int) -> None:
        """The memory pre-check: refuse a step that would not fit, before it allocates."""
        free = self.free_bytes()
        if free is not None and free < MEMORY_MARGIN * need:
            raise InsufficientMemory(f"needs {need} bytes, {free} free")

    # -- operations
    def run(self, ops: list[Op]) -> tuple[dict[int, int], dict[int, Failure]]:
        """Apply `ops` in order -> ({request id: sampled token}, {request id: its failure}), the same on
        every rank. A failed request's memory is freed on every rank; the others go on."""
        tokens: dict[int, int] = {}
        failures: dict[int, Failure] = {}
        earlier = self._issued  # a decode issued by an earlier step: read below, after this step's work is queued
        decodes = self._decodes
        if self.clock is not None and ops:
            self.clock.begin(step_kind(ops))
        with torch.inference_mode():
            for op in _batched(ops):
                match op:
                    case Evict():
                        self.cache.evict(op.entries)
                        if self.tiers is not None and self.tiers.host is not None:
                            self.tiers.host.evict(op.entries)
                    case Demote():
                        self._demote(op)
                    case Promote():
                        t0 = time.perf_counter()  # up to the vote: the slowest rank's load
                        if self._promote(op) and self.on_timing is not None:
                            self.on_timing(op, time.perf_counter() - t0)
                    case Extend() if op.rid in failures:  # its split reload's tail failed in this step
                        pass
                    case Extend() | list() if self._lost(op, failures):
                        pass
                    case Finish():
                        self._finish(op.rids)
                    case Prefill():
                        start = self._mark() if self.on_timing is not None else None
                        self._admit(op, self._prefill_prepare, self._prefill_compute, "prefill", tokens, failures)
                        if op.rid in tokens and start is not None:
                            self.on_timing(op, self._seconds([(start, self._mark())]))
                    case PrefillChunk():
                        self._prefill_chunk(op, tokens, failures)
                    case ReadTail():
                        self._read_tail(op)
                    case JoinTail():
                        self._join_tail(op, failures)
                    case Abort():
                        self._abort(op.entry)
                    case Extend():
                        self._admit(op, self._extend_prepare, self._extend_compute, "extend", tokens, failures)
                    case list():  # extends of one entry with one shape: one forward
                        self._extend_together(op, tokens, failures)
                    case Decode():
                        self._decode_contained(tokens, failures)
                    case _:
                        raise TypeError(f"unknown service operation {op!r}: expected one of serving/ops.py's")
        if self.clock is not None and ops:
            if self._decodes == decodes and all(isinstance(op, Decode) for op in ops):
                self.clock.cancel()  # nothing was left to issue (max_tokens): not a step of the device's
            else:
                self.clock.end()
        if earlier is not None:
            if self._issued is earlier:
                self._issued = None
            tokens.update(self._read(earlier))
        if self._issued is not None and not self.lookahead:
            tokens.update(self._read(self._issued))
            self._issued = None
        self.settle_writes()
        return tokens, failures

    def _read(self, issued: _Issued) -> dict[int, int]:
        """An issued decode's tokens on the host (waits for that step alone: later ones stay queued); each
        row's host copy of its last token follows."""
        if issued.ready is not None:
            issued.ready.synchronize()  # not a copy on the stream: it would wait for the step queued after this one
            vals = issued.host.tolist()
        else:
            vals = issued.tokens.tolist()
        if self.trace is not None:
            self.trace.append(("read", issued.step))
        out = {}
        for r, t in zip(issued.rows, vals):
            r.last_token = out[r.rid] = t
        return out

    def _decode_inputs(self, rows: list[Row]) -> torch.Tensor:
        """The rows' last tokens [B, 1] on the device: from the issued decode (not read yet) where a row was
        in it, else the host's copy (a row that joined since, or whose token was read)."""
        issued = self._issued
        if issued is None:
            return to_device([[r.last_token] for r in rows], self.device)
        if len(issued.rows) == len(rows) and all(a is b for a, b in zip(issued.rows, rows)):
            return issued.tokens[:, None]
        at = {id(r): j for j, r in enumerate(issued.rows)}
        sel = to_device([at.get(id(r), -1) for r in rows], self.device)
        host = to_device([r.last_token for r in rows], self.device)
        return torch.where(sel >= 0, issued.tokens[sel.clamp(min=0)], host)[:, None]

    # -- the lower tiers (serving/tiers.py): moves rank 0 decided, each rank moving its own shard
    def _demote(self, op: Demote) -> None:
        """One tier down: device -> host or disk, or host -> disk. A disk write runs on the disk tier's writer
        thread (serving/disk_writer.py) while the steps go on, and is committed or given up on every rank at
        once (settle_writes). From the host tier the entry stays there, servable and not evictable, until
        then; from the device its shard waits in a host buffer of its own (not counted in the host budget: a
        free range of its pinned arena, given back when the write settles, or pageable memory)."""
        tiers = self.tiers
        e = self.cache.entries.get(op.entry)
        if e is not None and e.users:
            raise RuntimeError(f"context cache entry {op.entry} cannot be demoted while requests use it")
        he = tiers.host.entries.get(op.entry) if e is None and tiers.host is not None else None
        if op.to == "disk" and not (he is not None and (he.writing or he.written)):
            self.writes[op.entry] = None  # settled on every rank, also if nothing could be queued here
        try:
            if e is not None:  # from the device
                self.cache.evict([op.entry])
                if op.to == "host":
                    host = to_host(e.kv, arena=tiers.arena, serves_from=e.serves_from, context_len=e.context_len)
                    host.synchronize()  # the device memory is free (for this step's allocation) once copied
                    tiers.host.hold(e.id, e.ids, host, e.rank_bytes)
                    on_disk = tiers.disk is not None and tiers.disk.entry_for(e.ids) is not None
                    tiers.host.entries[e.id].written = on_disk  # dropping it later loses nothing
                elif tiers.disk.holds(e.ids):  # promoted from this very file: nothing to copy (a pageable copy
                    tiers.writer.submit(e.id, e.ids, None, staged=False)  # of a 128K shard stalls the loop ~10 s)
                else:  # staged in a free range of the host tier's pinned arena if any (a fast copy), else pageable
                    host = to_host(e.kv, arena=tiers.arena, serves_from=e.serves_from, context_len=e.context_len)
                    host.synchronize()
                    tiers.writer.submit(e.id, e.ids, host, staged=True)
                return
            if he is not None and not (he.writing or he.written):  # from the host tier: only to disk
                tiers.writer.submit(he.id, he.ids, he.kv, staged=False)
                he.writing = True
        except Exception as err:  # noqa: BLE001 (e.g. no pinned memory left): dropped here; a promotion falls back
            log.warning("demoting cache entry %d to %s failed on rank %d (dropped): %s: %s", op.entry, op.to,
                        self.rank, type(err).__name__, err)

    def settle_writes(self) -> None:
        """After every step, on every rank: one all-gather over the control group of each open disk write's
        state; a write every rank finished is committed (listed: promotable from disk; a host copy becomes
        droppable), one any rank failed is given up everywhere once every rank is done with it (each removes
        its file; a host entry stays in the host tier, a shard that came from the device is dropped)."""
        if not self.writes:
            return
        writer = self.tiers.writer
        ids = list(self.writes)
        mine = torch.tensor([writer.jobs[i].state if i in writer.jobs else WRITE_FAILED for i in ids],
                            dtype=torch.long)
        every = [mine]
        if self.control is not None:
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.control))]
            dist.all_gather(every, mine, group=self.control)
        for k, entry in enumerate(ids):
            states = [int(t[k]) for t in every]
            if QUEUED in states:
                continue
            del self.writes[entry]
            job = writer.jobs.pop(entry, None)
            ok = all(s == WRITTEN for s in states)
            he = self.tiers.host.entries.get(entry) if self.tiers.host is not None else None
            if job is not None and not job.staged and he is not None and he.kv is job.pending.host:
                he.writing, he.written = False, ok
            if job is not None:
                if ok:
                    self.tiers.disk.commit(job.pending)
                else:
                    self.tiers.disk.abandon(job.pending)
                if job.staged:
                    job.pending.host.release()
            if not ok:
                failed = [r for r, s in enumerate(states) if s != WRITTEN]
                log.warning("cache entry %d: its disk write failed on rank(s) %s (this rank's file %s: %s); %s",
                            entry, failed, "none" if job is None else job.pending.path,
                            "removed" if job is not None and job.pending.wrote else "not written",
                            "it stays in the host tier" if job is not None and not job.staged else "dropped")
            if self.rank == 0:  # rank 0's scheduler drains them (demote() requests wait on them)
                self.settled.append((entry, ok))

    def _promote(self, op: Promote) -> bool:
        """Load this rank's shard back to the device, then one vote: the entry becomes reusable only when
        every rank has its shard; otherwise no rank keeps it and the lower tier's copy is dropped on every
        rank (a disk load that failed removed its file already), so the request is prefilled instead."""
        tiers, kv, ids, serves_from, context_len = self.tiers, None, None, 0, None
        src = op.entry if op.copy_of is None else op.copy_of
        try:
            self._check_memory(op.rank_bytes[self.cp_rank])
            if op.source == "host":
                he = tiers.host.get(src)
                ids, serves_from, context_len = he.ids, he.serves_from, he.kv.context_len
                load = tiers.host.load(src, self.device)
                load.synchronize()
                kv = load.kv
            else:
                ids = np.asarray(op.ids, dtype=np.int64)
                found = tiers.disk.entry_for(ids)
                if found is None:
                    raise FileNotFoundError(f"rank {self.rank} holds no disk cache file of these {len(ids)} tokens")
                kv, serves_from = tiers.disk.load(found, self.device, arena=tiers.arena), found.serves_from
                context_len = found.context_len
            if kv_bytes(kv) > op.rank_bytes[self.cp_rank]:
                raise RuntimeError(f"the reloaded shard holds {kv_bytes(kv)} bytes, more than the "
                                   f"{op.rank_bytes[self.cp_rank]} the scheduler counts")
            if kv.trimmed and serves_from <= 0:  # it would serve prefixes whose local keys it dropped
                raise RuntimeError("the reloaded shard is window-trimmed but carries no serves_from")
        except Exception as e:  # noqa: BLE001 (contained: every rank decides by the vote)
            log.warning("promoting cache entry %d from %s failed on rank %d: %s: %s", op.entry, op.source, self.rank,
                        type(e).__name__, e)
            kv = None
        if not all(v[0] == 0 for v in self._vote(0 if kv is not None else FAILED, 0)):
            kv = None
            self.lost.add(op.entry)
            if op.source == "host":
                if op.copy_of is None:  # a copy's source is being written: it stays (settle_writes decides)
                    tiers.host.evict([op.entry])
            else:
                found = tiers.disk.entry_for(op.ids)
                if found is not None:
                    tiers.disk.remove(found.name)
            return False
        if op.source == "host" and op.copy_of is None:
            he = tiers.host.take(op.entry)  # moved up, copies done: its pinned range is free for the next demotion
            if he is not None:
                he.kv.release()
        # a window-trimmed entry comes back serving only what it served before (served_prefix)
        self.cache.add(CacheEntry(op.entry, ids, kv, max(op.rank_bytes), rank_bytes=list(op.rank_bytes),
                                  serves_from=serves_from, context_len=context_len))
        return True

    # -- a split reload (--disk-reload-policy split): the head computed, the tail read meanwhile
    def _read_tail(self, op: ReadTail) -> None:
        """Start (or retarget) this rank's read of its file's rows at positions >= op.cut; a read that cannot
        start is kept as its error, for JoinTail's vote."""
        tail = self.tails.get(op.entry)
        try:
            if isinstance(tail, TailRead):
                tail.retarget(op.cut)
                return
            if tail is not None:
                return
            disk = self.tiers.disk
            found = disk.entry_for(op.ids)
            if found is None:
                raise FileNotFoundError(f"rank {self.rank} holds no disk cache file of these {len(op.ids)} tokens")
            if found.shared:
                raise ValueError("its shard is rebuilt from another layout's files, not read from one file")
            # reading starts once the head's first chunk allocated the entry (_prefill_chunk attaches it)
            self.tails[op.entry] = TailRead(found.path, read_header(found.path, disk.key, disk.rank), op.cut,
                                            disk.readers, rate=disk.read_limit)
        except Exception as e:  # noqa: BLE001 (contained: JoinTail votes)
            self.tails[op.entry] = e

    def _join_tail(self, op: JoinTail, failures) -> None:
        """Graft this rank's tail after the computed head, then one vote (JoinTail). A file whose tail failed on
        any rank is dropped on every rank, as a failed promotion's (_promote)."""
        st, tail = self.filling.get(op.entry), self.tails.pop(op.entry, None)
        first = None  # set once grafted
        before = st.kv.next_position if st is not None else None
        try:
            if st is None:
                raise RuntimeError(f"cache entry {op.entry} is not being filled here")
            if not isinstance(tail, TailRead):
                raise tail if isinstance(tail, BaseException) else RuntimeError("no tail read was started")
            at = tail.join(op.cut)  # its rows copied into the entry meanwhile; the compute stream waits for them
            tail.complete(st.kv, at)
            first = at
            if kv_bytes(st.kv) > st.rank_bytes[self.cp_rank]:
                raise RuntimeError(f"the grafted shard holds {kv_bytes(st.kv)} bytes, more than the "
                                   f"{st.rank_bytes[self.cp_rank]} the scheduler counts")
            ok = True
        except Exception as e:  # noqa: BLE001 (contained: every rank decides by the vote)
            log.warning("cache entry %d: reading its tail (positions >= %d) from disk failed on rank %d: %s: %s",
                        op.entry, op.cut, self.rank, type(e).__name__, e)
            ok = False
        if all(v[0] == 0 for v in self._vote(0 if ok else FAILED, 0)):
            self._filled(op.entry)
            if self.on_timing is not None and tail.nbytes:  # this rank read something: a rate
                self.on_timing(op, tail.seconds)
            return
        if isinstance(tail, TailRead):
            tail.abandon()  # the rest is computed into rows its copies may still be writing
        if first is not None:  # grafted here, failed elsewhere: back to the head alone
            for layer in st.kv.layers.values():
                layer.length, layer.head = first, first % layer.capacity
            st.kv.next_position = before
        found = self.tiers.disk.entry_for(st.entry.ids) if st is not None else None
        if found is not None and not found.shared:
            self.tiers.disk.remove(found.name)
        failures[op.rid] = Failure(TAIL_FAILED, f"cache entry {op.entry}'s tail could not be read on every rank; "
                                                "the rest is computed")

    def _lost(self, op: Extend | list, failures) -> bool:
        """An extend of an entry whose promotion failed fails with RELOAD_FAILED (the scheduler prefills it)."""
        ops = op if isinstance(op, list) else [op]
        if ops[0].entry not in self.lost:
            return False
        self.lost.discard(ops[0].entry)
        for o in ops:
            failures[o.rid] = Failure(RELOAD_FAILED, f"cache entry {o.entry} could not be reloaded on every rank")
        return True

    def _admit(self, op, prepare, compute, what, tokens, failures) -> None:
        result, failure = self._contained(op, prepare, compute, what)
        if failure is not None:
            failures[op.rid] = failure
            return
        tokens[op.rid] = self._commit(result)

    def _gen(self, seed):
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def _sample(self, logits: torch.Tensor, draws: list[tuple[SamplingConfig, torch.Generator | None]]) -> list[int]:
        """One token per row from last-row logits [B, V] and each row's (sampling, generator), on the host."""
        return self._sample_on_device(logits, draws).tolist()

    def _sample_on_device(self, logits: torch.Tensor, draws) -> torch.Tensor:
        """The tokens [B] on the device: sampled on the query rank, then the same on every rank of the CP group."""
        toks = torch.zeros(len(draws), dtype=torch.long, device=logits.device)
        if self.is_query_rank:
            for b, (sampling, gen) in enumerate(draws):
                toks[b] = self.sampler(logits[b : b + 1], sampling, gen)[0]
        if self.group is not None:
            dist.broadcast(toks, src=dist.get_global_rank(self.group, self.query_rank), group=self.group)
        return toks

    def _gather_pool(self, rows: list[Row]) -> OwnKV | None:
        """The batch's own-KV pool for `rows` (query rank; None elsewhere), built beside the old one:
        nothing changes until _set_rows commits it."""
        if not self.is_query_rank or not rows:
            return None
        parts = [(r.pool, r.pool_row) for r in rows]
        return OwnKV.gather(parts, self.pool_extra([r.remaining for r in rows]), self.model.layer_ids, self.kv_heads,
                            self.head_dim, self.dtype, self.device)

    def _set_rows(self, rows: list[Row], pool: OwnKV | None) -> None:
        self.rows, self.pool = rows, pool
        if pool is not None:
            for b, r in enumerate(rows):
                r.pool, r.pool_row = pool, b
        self._graph = None

    def _new_row(self, op: Prefill | Extend, entry: CacheEntry, prefix: int, pool: OwnKV | None, first: int,
                 gen) -> Row:
        return Row(op.rid, entry, prefix, len(op.ids), first, op.max_tokens - 1, op.sampling, gen, pool, 0)

    def _pool_need(self, own: int, remaining: int) -> int:
        """The query rank's pool after a row of (own, remaining) joins, while the old one is held."""
        if not self.is_query_rank:
            return 0
        return self.pool_bytes(self.pool_rows() + [(own, remaining)]) + self.pool_bytes(self.pool_rows())

    def _prefill_prepare(self, op: Prefill):
        L = len(op.ids)
        rank_bytes = self.entry_rank_bytes(L, op.context_len)
        rows = rank_bytes[self.cp_rank] // self.token_bytes()
        need = rank_bytes[self.cp_rank] + max(self.work_bytes(rows), self._pool_need(0, op.max_tokens - 1))
        self._check_memory(need)
        kv = self.runner.new_cache(L, L, op.context_len)  # exactly this rank's shard
        return _Admission(op, kv=kv, rank_bytes=rank_bytes), need

    def _prefill_compute(self, op: Prefill, st: "_Admission") -> "_Admission":
        ids = op.ids
        prompt = Prompt(list(ids), op.context_len, op.head_len)
        st.gen = self._gen(op.sampling.seed)
        try:
            st.token = int(self.runner.prefill(prompt, st.kv, op.sampling, st.gen))
        finally:
            self.runner.end_generation()
        rank_bytes = st.rank_bytes
        if kv_bytes(st.kv) > rank_bytes[self.cp_rank]:  # the scheduler admitted by rank_bytes: it must not drift
            raise RuntimeError(f"CP rank {self.cp_rank}'s entry holds {kv_bytes(st.kv)} bytes, more than the "
                               f"{rank_bytes[self.cp_rank]} the scheduler counts (StrategySpec.rank_rows)")
        st.entry = CacheEntry(op.entry, np.asarray(ids, dtype=np.int64), st.kv, max(rank_bytes), pinned=op.pinned,
                              rank_bytes=rank_bytes, context_len=op.context_len)
        self._trim(st.entry, op.context_len)
        own = self._empty_pool() if self.is_query_rank else None
        st.row = self._new_row(op, st.entry, len(ids), own, st.token, st.gen)
        st.pool = self._gather_pool(self.rows + [st.row])
        return st

    def _commit(self, st: "_Admission") -> int:
        """Past both votes: the new entry and row become the executor's (no allocation here)."""
        if st.new_entry:
            self.cache.add(st.entry)
        self.cache.acquire(st.entry)
        if st.hit:
            st.entry.hits += 1
        self._set_rows(self.rows + [st.row], st.pool)
        return st.token

    # -- a document's prefill, one chunk a step (the entry is "filling" between its chunks)
    def _prefill_chunk(self, op: PrefillChunk, tokens, failures) -> None:
        # Every chunk is voted on: each allocates its working set, the first the entry, the last the pool.
        start = self._mark() if self.on_timing is not None else None
        st, failure = self._contained(op, self._chunk_prepare, self._chunk_compute, "prefill")
        if failure is not None:
            self._abort(op.entry)  # a later chunk's entry is filling on every rank
            failures[op.rid] = failure
            return
        if start is not None:
            st.marks.append((start, self._mark()))
            if op.fill:  # a split reload re-plans after each step, by the step before's time: no host wait
                if st.untimed is not None:
                    self.on_timing(st.untimed[0], self._seconds([st.untimed[1]]))
                st.untimed = (op, st.marks[-1])
        if op.start == 0:
            self.cache.add(st.entry)
            self.cache.acquire(st.entry)  # held by its request: neither evicted nor reused while it fills
            self.filling[op.entry] = st
            tail = self.tails.get(op.entry)
            if op.fill and isinstance(tail, TailRead):  # its rows go straight into the entry while the head runs
                try:
                    tail.attach(st.kv)
                except Exception as e:  # noqa: BLE001 (JoinTail votes on it)
                    self.tails[op.entry] = e
        if op.last and op.fill:  # complete: the request extends it next (its own hold)
            self._filled(op.entry)
        elif op.last:
            del self.filling[op.entry]
            st.entry.filling = False
            self._set_rows(self.rows + [st.row], st.pool)
            tokens[op.rid] = st.token
            if self.on_timing is not None:
                self.on_timing(op, self._seconds(st.marks))

    def _filled(self, entry_id: int) -> None:
        """A split reload's entry holds all its rows: reusable, no longer held by the fill."""
        st = self.filling.pop(entry_id)
        st.entry.filling = False
        self.cache.release(st.entry)
        tail = self.tails.pop(entry_id, None)  # a read a re-plan stopped (the rest was computed)
        if isinstance(tail, TailRead):
            tail.abandon()

    def _mark(self):
        """Now on this rank's compute stream: a CUDA event (a middle chunk's kernels still run when its step
        returns, and a decode step between chunks waits for them), else the host clock."""
        return mark(self.device.type == "cuda")

    @staticmethod
    def _seconds(spans: list) -> float:
        """The summed seconds of (start, end) marks, once the stream has passed the last end."""
        if spans and not isinstance(spans[-1][1], float):
            spans[-1][1].synchronize()
        return sum(seconds_between(a, b) for a, b in spans)

    def _chunk_prepare(self, op: PrefillChunk):
        rows = -(-(op.end - op.start) // self.cp)  # this step's rows per rank
        pool = self._pool_need(0, op.max_tokens - 1) if op.last else 0
        if op.start:
            st = self.filling[op.entry]
            need = max(self.work_bytes(rows), pool)
            self._check_memory(need)
            return st, need
        L = op.prompt_len
        rank_bytes = self.entry_rank_bytes(L, op.context_len, op.chunk, op.knee)
        need = rank_bytes[self.cp_rank] + max(self.work_bytes(rows), pool)
        self._check_memory(need)
        kv = self.runner.new_cache(L, L, op.context_len, op.chunk, op.knee)  # exactly this rank's shard, chunked layout
        entry = CacheEntry(op.entry, np.asarray(op.ids, dtype=np.int64), kv, max(rank_bytes), rank_bytes=rank_bytes,
                           filling=True, context_len=op.context_len)
        return _Admission(op, kv=kv, rank_bytes=rank_bytes, entry=entry, gen=self._gen(op.sampling.seed),
                          prompt=Prompt(list(op.ids), op.context_len, op.head_len)), need

    def _chunk_compute(self, op: PrefillChunk, st: "_Admission") -> "_Admission":
        tok = self.runner.prefill_step(st.prompt, st.kv, op.start, op.end, op.sampling, st.gen)
        if not op.last:
            return st
        self.runner.end_generation()
        if kv_bytes(st.kv) > st.rank_bytes[self.cp_rank]:
            raise RuntimeError(f"CP rank {self.cp_rank}'s entry holds {kv_bytes(st.kv)} bytes, more than the "
                               f"{st.rank_bytes[self.cp_rank]} the scheduler counts (StrategySpec.rank_rows)")
        st.token = int(tok)
        self._trim(st.entry, op.context_len)
        if op.fill:
            return st
        own = self._empty_pool() if self.is_query_rank else None
        L = op.prompt_len
        st.row = Row(op.rid, st.entry, L, L, st.token, op.max_tokens - 1, op.sampling, st.gen, own, 0)
        st.pool = self._gather_pool(self.rows + [st.row])
        return st

    def local_windows(self) -> dict[int, int]:
        """{layer: window} of the model's local layers as it runs now (run_without_windows drops them)."""
        return {i: layer.attention.extras["window"] for i, layer in zip(self.model.layer_ids, self.model.layers)
                if "window" in layer.attention.extras}

    def _trim(self, entry: CacheEntry, context_len: int) -> None:
        """A document's prefill ended: with window_trim, each local layer of its entry keeps only the keys
        at positions >= C - (window - 1), C = trim_start(context_len, its length) (KVCache.compact_local): all a
        continuation after the document sees. The entry then serves only prompts sharing its first C tokens
        (context_cache.served_prefix). Its bytes on each rank become what that rank holds now: which
        positions a CP rank holds depends on the strategy's layout, so the ranks all-gather their sizes
        (the control group, a few bytes) and every rank records the same list (rank 0's scheduler plans
        with it, in every tier). The host and disk tiers move it as it is, serves_from with it (host_tier.to_host,
        kv_file)."""
        C = trim_start(context_len, len(entry))
        windows = {i: w for i, w in self.local_windows().items() if C - (w - 1) > 0}
        if not self.window_trim or entry.pinned or not windows:  # pinned (APB): never reused, dropped when done
            return
        entry.kv.compact_local(windows, C)
        mine = kv_bytes(entry.kv)
        rank_bytes = [mine]
        if self.cp > 1:
            t = torch.tensor([self.cp_rank, mine], dtype=torch.long)
            out = [torch.zeros(2, dtype=torch.long) for _ in range(dist.get_world_size(self.control))]
            dist.all_gather(out, t, group=self.control)
            rank_bytes = [0] * self.cp
            for r, n in (o.tolist() for o in out):
                rank_bytes[r] = n  # the TP ranks of one CP rank hold equal shards
        entry.rank_bytes, entry.nbytes, entry.serves_from = rank_bytes, max(rank_bytes), C

    def _abort(self, entry_id: int) -> None:
        """Drop a filling entry on this rank (its prefill was cancelled, timed out or failed)."""
        tail = self.tails.pop(entry_id, None)
        if isinstance(tail, TailRead):
            tail.abandon()
        if self.filling.pop(entry_id, None) is None:
            return
        self.cache.entries.pop(entry_id, None)
        self.runner.end_generation()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _empty_pool(self) -> OwnKV:
        return OwnKV(self.model.layer_ids, 1, self.kv_heads, self.head_dim, 1, self.dtype, self.device)

    def _extend_prepare(self, op: Extend):
        ids, m = op.ids, op.prefix
        own = len(ids) - m
        entry = self.cache.entries[op.entry]
        need = self.work_bytes(own) + (own * self.own_token_bytes() if self.is_query_rank else 0)
        need += self._pool_need(own, op.max_tokens - 1)
        self._check_memory(need)
        pool = None
        if self.is_query_rank:
            pool = OwnKV(self.model.layer_ids, 1, self.kv_heads, self.head_dim, own, self.dtype, self.device)
        return _Admission(op, entry=entry, own=pool, new_entry=False, hit=True), need

    def _extend_compute(self, op: Extend, st: "_Admission") -> "_Admission":
        ids, m, entry = op.ids, op.prefix, st.entry
        suffix = to_device([ids[m:]], self.device)
        pos = torch.arange(m, len(ids), device=self.device)[None]
        cascade = CascadeAttention([SharedGroup(entry.kv, [0], [m], len(entry))], st.own, self.group, self.device)
        logits = run_cascade(self.model, suffix, pos, cascade)
        st.gen = self._gen(op.sampling.seed)
        st.token = self._sample(logits, [(op.sampling, st.gen)])[0]
        st.row = self._new_row(op, entry, m, st.own, st.token, st.gen)
        st.pool = self._gather_pool(self.rows + [st.row])
        return st

    def _extend_together(self, ops: list[Extend], tokens, failures) -> None:
        """Several requests' extends of one entry, with equal prefix and suffix lengths, in one forward
        (one shared group of len(ops) rows, one own pool). If the batch fails on any rank, every rank
        retries each alone, so a failing request still fails alone."""
        group = _ExtendBatch(ops)
        result, failure = self._contained(group, self._together_prepare, self._together_compute, "extend")
        if failure is not None:
            for op in ops:
                self._admit(op, self._extend_prepare, self._extend_compute, "extend", tokens, failures)
            return
        for st in result:
            self.cache.acquire(st.entry)
            st.entry.hits += 1
            tokens[st.op.rid] = st.token
        self._set_rows(self.rows + [st.row for st in result], result[0].pool)

    def _together_prepare(self, group: "_ExtendBatch"):
        ops, B = group.ops, len(group.ops)
        for op in ops[1:]:  # _contained injects the first's
            self._inject(op.rid, "prepare")
        own = len(ops[0].ids) - ops[0].prefix
        need = self.work_bytes(B * own) + (B * own * self.own_token_bytes() if self.is_query_rank else 0)
        if self.is_query_rank:
            rows = self.pool_rows() + [(own, op.max_tokens - 1) for op in ops]
            need += self.pool_bytes(rows) + self.pool_bytes(self.pool_rows())
        self._check_memory(need)
        pool = None
        if self.is_query_rank:
            pool = OwnKV(self.model.layer_ids, B, self.kv_heads, self.head_dim, own, self.dtype, self.device)
        return _Admission(ops[0], entry=self.cache.entries[ops[0].entry], own=pool, new_entry=False, hit=True), need

    def _together_compute(self, group: "_ExtendBatch", st: "_Admission") -> list["_Admission"]:
        ops, m, entry = group.ops, group.ops[0].prefix, st.entry
        B, n = len(ops), len(ops[0].ids)
        suffix = to_device([op.ids[m:] for op in ops], self.device)
        pos = torch.arange(m, n, device=self.device)[None].expand(B, n - m)
        cascade = CascadeAttention([SharedGroup(entry.kv, list(range(B)), [m] * B, len(entry))], st.own, self.group,
                                   self.device)
        logits = run_cascade(self.model, suffix, pos, cascade)
        gens = [self._gen(op.sampling.seed) for op in ops]
        toks = self._sample(logits, [(op.sampling, g) for op, g in zip(ops, gens)])
        out = []
        for b, (op, g, t) in enumerate(zip(ops, gens, toks)):
            a = _Admission(op, entry=entry, new_entry=False, hit=True, gen=g, token=t)
            a.row = self._new_row(op, entry, m, st.own, t, g)
            a.row.pool_row = b
            out.append(a)
        pool = self._gather_pool(self.rows + [a.row for a in out])
        for a in out:
            a.pool = pool
        for op in ops[1:]:
            self._inject(op.rid, "compute")
        return out

    def _batch_cascade(self) -> CascadeAttention:
        """The batch's attention: one shared group per cache entry its rows use, and the own-KV pool."""
        by_entry: dict[int, SharedGroup] = {}
        for b, r in enumerate(self.rows):
            g = by_entry.setdefault(r.entry.id, SharedGroup(r.entry.kv, [], [], len(r.entry)))
            g.rows.append(b)
            g.prefix.append(r.prefix)
        return CascadeAttention(list(by_entry.values()), self.pool, self.group, self.device)

    def _decode_contained(self, tokens: dict[int, int], failures: dict[int, "Failure"]) -> None:
        """A decode step. Without peers (tp = cp = 1) a failure in it is contained: the row it names
        (a fault's), else the newest row (the last to add memory) leaves and the rest go on. With
        peers it is not: the ranks would disagree inside the forward's collectives."""
        if self.control is not None:
            self._decode()
            return
        try:
            for r in self.rows:
                self._inject(r.rid, "decode")
            self._decode()
        except Exception as e:  # noqa: BLE001
            rid = next((f.rid for f in self.faults if f.error is e), None)
            victim = next((r for r in self.rows if r.rid == rid), self.rows[-1])
            log.error("request %d: decode failed: %s: %s", victim.rid, type(e).__name__, e)
            self._graph = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._finish([victim.rid])
            failures[victim.rid] = self._failure([(_code(e), -1 if self.free_bytes() is None else self.free_bytes(),
                                                   self.pool_bytes(self.pool_rows()))], e, "decode step")

    def _decode(self) -> None:
        """Issue a decode step of the batch; its tokens are read at the end of the next step (Executor.run).
        Nothing is issued once every row's last token is (max_tokens): the step then reads them at once instead
        of after one more decode."""
        rows = self.rows
        if all(r.remaining <= 0 for r in rows):
            return
        toks = self._decode_inputs(rows)
        pos = to_device([[r.next_pos] for r in rows], self.device)
        if self._graph is None and self.cuda_graphs and len(rows) <= DECODE_MAX_ROWS:
            graph = self._table_graph(rows)
            if graph is not None and self.pool is not None:
                self._set_rows(rows, graph.cascade.own)  # the rows' own KV now lives in the graph's pool
            # Otherwise captured at a batch's first step: recording costs the host about what an eager step does,
            # and with the host one step ahead it overlaps the device's work on the steps before.
            self._graph = graph or CascadeGraph(self.model, self._batch_cascade(), len(rows), self.device,
                                                warm=self._captured)
        if self._graph is not None:  # the rows kept since the capture: replay
            logits = self._graph.step(toks, pos)
            self._captured = True  # a capture succeeded: the lazy initialisations are done
        else:
            logits = run_cascade(self.model, toks, pos, self._batch_cascade())
        tokens = self._sample_on_device(logits, [(r.sampling, r.gen) for r in rows])
        for r in rows:
            r.next_pos, r.remaining = r.next_pos + 1, r.remaining - 1
        self._decodes += 1
        if self.trace is not None:
            self.trace.append(("issue", self._decodes))
        host = ready = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tokens.device))
        self._issued = _Issued(list(rows), tokens, self._decodes, host, ready)

    def _table_graph(self, rows: list[Row]) -> CascadeGraph | None:
        """The kept graph of this batch's shape bound to its entry, prefixes and own KV, or None where it does not
        qualify (rows on several entries, FP8 KV, windowed layers, a store over TABLE_STORE_BYTES). Decided from
        what every rank holds alike (the rows, the settings), so the ranks of a group capture together."""
        if not self.table_graphs or len({r.entry.id for r in rows}) != 1:
            return None
        cap = self.pool_capacity(self.pool_rows())
        bucket = max(TABLE_MIN_CAPACITY, 1 << (cap - 1).bit_length())
        graph = self._kept_graph(len(rows), bucket)
        if graph is not None:
            try:
                graph.cascade.bind(rows[0].entry.kv, [r.prefix for r in rows], self.pool)
            except ValueError as e:  # nothing bound: this batch captures its own graph
                log.warning("decode graph of %d rows: %s; captured for this batch", len(rows), e)
                return None
        return graph

    def _kept_graph(self, batch: int, bucket: int) -> CascadeGraph | None:
        """The table graph of `batch` rows and own-KV capacity `bucket` (made on first use; captured at its
        first step), or None where the bucket's store is over TABLE_STORE_BYTES."""
        if self._store_bytes(bucket) > TABLE_STORE_BYTES:
            return None
        b = self._tables.pop(bucket, None)
        if b is None:
            while self._tables and sum(map(self._store_bytes, [bucket, *self._tables])) > TABLE_STORE_BYTES:
                self._tables.pop(next(iter(self._tables)))
            store = None
            if self.is_query_rank:
                store = OwnKV(self.model.layer_ids, DECODE_MAX_ROWS, self.kv_heads, self.head_dim, bucket, self.dtype,
                              self.device)
            b = _Bucket(store)
        self._tables[bucket] = b  # the most recently used last
        if batch not in b.graphs:
            cascade = TableCascade(self.model.layer_ids, batch, self.kv_heads, self.head_dim, b.store, self.dtype,
                                   self.device, self.group)
            b.graphs[batch] = CascadeGraph(self.model, cascade, batch, self.device, warm=self._captured)
        return b.graphs[batch]

    def _store_bytes(self, capacity: int) -> int:
        """A capacity bucket's own-KV store: DECODE_MAX_ROWS rows of `capacity` tokens."""
        return DECODE_MAX_ROWS * capacity * self.own_token_bytes()

    def kept_graphs(self) -> int:
        """Decode graphs kept across batches (0: off, or none made yet); read from other threads (a snapshot)."""
        return sum(len(b.graphs) for b in list(self._tables.values())) if self.table_graphs else 0

    def prepare_tables(self, max_rows: int) -> int:
        """Capture the table graphs of 1..max_rows rows (at most DECODE_MAX_ROWS) at the smallest capacity on
        an empty entry (the warm-up, on the whole model): a short question's first batch of each size then
        replays, with nothing to capture -> graphs captured. Then one is checked against the per-batch path
        (_check_tables); a failed capture or check turns the kept graphs off, logged. Every rank at once (the
        steps' collectives)."""
        if not self.table_graphs:
            return 0
        empty = KVCache(self.model.layer_ids, 1, self.kv_heads, self.head_dim, 1, self.dtype, self.device)
        n = 0
        try:
            for batch in range(1, min(max_rows, DECODE_MAX_ROWS) + 1):
                graph = self._kept_graph(batch, TABLE_MIN_CAPACITY)
                if graph is None or graph.graph is not None:
                    continue
                pool = None
                if self.is_query_rank:
                    pool = OwnKV(self.model.layer_ids, batch, self.kv_heads, self.head_dim, 1, self.dtype, self.device)
                graph.cascade.bind(empty, [1] * batch, pool)
                zeros = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
                graph.step(zeros, zeros)  # captured, replayed once over nothing
                self._captured = True
                n += 1
            off = self._check_tables()
        except Exception as e:  # noqa: BLE001 (the batches are captured one by one instead, as before)
            off = f"capturing one failed ({type(e).__name__}: {e})"
        if off:
            log.warning("decode graphs that serve any entry are off: %s; each batch captures its own", off)
            self.table_graphs = False
            self._tables.clear()
            return 0
        return n

    def _check_tables(self) -> str | None:
        """One kept graph's step against the per-batch path on a random entry of TABLE_CHECK_ROWS rows, once per
        process (the table's offsets read on this device): None when the logits agree, else why not."""
        graph = self._kept_graph(1, TABLE_MIN_CAPACITY)
        if graph is None:
            return None
        g = torch.Generator(device=self.device).manual_seed(0)
        n = TABLE_CHECK_ROWS
        entry = KVCache(self.model.layer_ids, 1, self.kv_heads, self.head_dim, n, self.dtype, self.device)
        pos = torch.arange(n, device=self.device)
        for i in self.model.layer_ids:
            k, v = (torch.randn(1, self.kv_heads, n, self.head_dim, generator=g, device=self.device, dtype=self.dtype)
                    for _ in range(2))
            entry.layer(i).append(k, v, pos)
        pools = [OwnKV(self.model.layer_ids, 1, self.kv_heads, self.head_dim, 2, self.dtype, self.device)
                 if self.is_query_rank else None for _ in range(2)]
        tok = torch.full((1, 1), 1, dtype=torch.long, device=self.device)
        at = torch.full((1, 1), n, dtype=torch.long, device=self.device)
        graph.cascade.bind(entry, [n], pools[0])
        got = graph.step(tok, at).float().clone()
        want = run_cascade(self.model, tok, at, CascadeAttention([SharedGroup(entry, [0], [n], n)], pools[1],
                                                                  self.group, self.device)).float()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
        return None if err <= TABLE_CHECK_TOL else f"a kept graph's logits differ from the per-batch path's by {err:.3g}"

    def _finish(self, rids: list[int]) -> None:
        gone = set(rids)
        for r in self.rows:
            if r.rid in gone:
                self.cache.release(r.entry)
        rows = [r for r in self.rows if r.rid not in gone]
        self._set_rows(rows, self._gather_pool(rows))
