"""The long-document service's scheduler: requests in, tokens out, over the whole parallel group.

Rank 0 runs the scheduler (`Scheduler`): a bounded queue, admission within the context cache's
budget, and one step at a time. Each step is a list of typed operations (serving/ops.py) that every
rank executes (`Executor`, serving/executor.py), broadcast from rank 0 over a CPU control group, so
the ranks' KV shards, cache entries and batch stay identical in shape:

    prefill  a prompt with no usable cache entry runs through the runner (any context strategy);
             its KV becomes a cache entry, and the request decodes on it. With --prefill-chunk the
             document runs one chunk a step, and decode steps of the running batch take turns with
             its chunks (no stream stalls for a whole prefill)
    extend   a prompt that begins with an entry's tokens runs only the rest, attending the entry's
             first m tokens (serving/cascade.py): the prefill is skipped. A sliding-window model's entry is
             window-trimmed once prefilled (window_trim): it then serves only prompts sharing all of its
             document (context_cache.served_prefix)
    decode   one token for every running request, in one forward: each entry's context is read once
             for all requests on it, each request's own tokens beside it, merged by log-sum-exp
    finish   requests leave the batch; entries they held become evictable
    evict    entries removed, least recently used first, to make room inside the budget
    demote   with lower tiers (--host-cache-gib, --disk-cache-dir; serving/tiers.py) an evicted entry moves
             down instead: device -> host, the host tier's least recently used -> disk, else dropped. A disk
             write runs on each rank's writer thread while steps go on (serving/disk_writer.py), and is
             committed on every rank in the same step once every rank finished it; the host copy stays,
             servable, until then. Graceful shutdown writes the entries not on disk yet (--shutdown-write-s)
    promote  a prompt whose prefix a lower tier's entry holds (the same rule as extend) brings that entry
             back to the device (each rank its shard; all or none), then extends it; from disk only while
             the reload is expected to be faster than a prefill (serving/reload_policy.py). With
             --disk-reload-policy split a disk hit is served from both ends: its head prefilled in chunk
             steps (PrefillChunk fill) while every rank reads its file's tail backward (ReadTail), grafted
             where they meet (JoinTail); a tail that fails on any rank is computed instead

The HTTP front end (starshard/server, written against its `Backend` protocol) talks to `Scheduler`
only: submit(), cancel through the ticket, health(), stats(). Token events are delivered from the
scheduler's thread through the request's callback.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt, build_chat_prompt, build_prompt
from starshard.serving.cache_key import token_digest
from starshard.serving.context_cache import ContextCache, common_prefix, trim_start
from starshard.serving.executor import RELOAD_FAILED, TAIL_FAILED, Executor
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
from starshard.serving.reload_policy import DiskReloadPolicy, probe_prefill, probe_read
from starshard.serving.tail_read import TailRead
from starshard.serving.tiers import TierConfig, Tiers, server_key
from starshard.serving.warmup import RanksDisagree, warm_up
from starshard.strategies import get_spec
from starshard.strategies.flops import prefill_knee

log = logging.getLogger("starshard.serve")

IDLE_TICK_S = 1.0  # rank 0 sends an empty step this often while idle, so the other ranks never time out
WRITE_TICK_S = 0.1  # while disk writes are open: how often an idle rank 0 sends an empty step that settles them
SLOW_STEP_S = 1.0  # a step this long (a stall for every stream) is logged, with what it ran
GREEDY = SamplingConfig(temperature=0.0)  # a split reload's fill steps: their token is never used


def _per(rate: float | None, scale: float) -> str:
    return "unmeasured" if rate is None else f"{rate * scale:.3g}"


def default_prefill_chunk(device: torch.device, cp: int) -> int:
    """The prefill chunk the service runs unless told: 4096 rows per CP rank on CUDA, the whole prompt on CPU.
    4096: the smallest uniform chunk within 10% of a whole prefill (an 8B model at 128K on one H200: 1.09x;
    2048: 1.30x, fixed costs per step; docs/results.md, Service)."""
    return 4096 * cp if device.type == "cuda" else 0


class QueueFull(Exception):
    """The waiting queue is full: the server answers 429."""


class ServiceUnavailable(Exception):
    """The step loop is down (a rank died or hung, or it is shutting down): the server answers 503."""


@dataclass
class TokenEvent:
    token_id: int | None  # None on a final event that carries no token
    text: str  # the text this token adds (incremental detokenization; may be "")
    finish_reason: str | None  # None while running; "stop", "length", "cancelled", "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the context cache
    completion_tokens: int
    error: str | None = None
    # why it failed (finish_reason "error"): insufficient_memory, timeout, rejected, failed (executor.CODE_NAMES),
    # or unavailable (the engine stopped)
    error_code: str | None = None


# ---------------------------------------------------------------------------- rank 0: scheduling
@dataclass
class Request:
    rid: int
    prompt: Prompt
    max_tokens: int
    sampling: SamplingConfig
    on_event: Callable[[TokenEvent], None]
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    text_start: int = 0  # detokenization window: tokens [text_start, text_end) produced the last text sent
    text_end: int = 0
    cached: int = 0
    cancelled: bool = False
    running: bool = False
    ids: np.ndarray | None = None  # prompt.ids as an array (cache lookups)
    bounds: list[tuple[int, int]] = field(default_factory=list)  # a chunked prefill's steps
    step: int = 0  # the next of them
    entry: int = 0  # the entry its chunked prefill fills
    kind: tuple | None = None  # (the cache's entries it was classified against, Scheduler._classify's answer)
    reload_skipped: bool = False  # classified past a disk entry whose reload is expected slower than a prefill
    split: "_Split | None" = None  # a split reload that fills the entry this request then extends


@dataclass
class _Split:
    """A disk hit served from both ends (--disk-reload-policy split): the disk entry's `ids` (P tokens) are
    prefilled in Request.bounds up to `cut` while every rank reads the rest from its file; the request then
    extends the entry's first `m` tokens. cut == P: the rest is computed (a re-plan, or a failed tail)."""

    ids: list[int]
    m: int
    cut: int
    context_len: int  # the entry's document part (its prefill layout: Star's blocks)
    nbytes: int  # the entry's bytes over every rank's shards
    began: float = field(default_factory=time.monotonic)  # the tail read's start


@dataclass
class _Move:
    """A demote() request: the tokens whose entry moves, the tier it moves to, and its answer."""

    ids: np.ndarray
    to: str
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    rank_bytes: list[int] = field(default_factory=list)
    write: int | None = None  # to disk: the entry whose background write answers it once settled
    drop: int | None = None  # a host entry whose copy a step drops once its file is committed (then answered)


class Ticket:
    def __init__(self, scheduler: "Scheduler", rid: int):
        self._scheduler, self.rid = scheduler, rid

    def cancel(self) -> None:
        self._scheduler._cancel(self.rid)


def control_group():
    """A CPU (gloo) group over every rank for the step broadcasts; None in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD


class Scheduler:
    """The backend behind the HTTP server (rank 0), and the step loop every rank runs.

    llm: a starshard.LLM over any layout without pipeline stages (one process, tp, cp, tp x cp).
    cache_bytes: the context cache's budget per rank; max_batch: requests decoding together;
    max_queue: requests waiting beyond the batch before submit() answers QueueFull.
    prefill_chunk: prompt tokens one prefill step runs (0: the whole prompt); a document's chunks take
    turns with the batch's decode steps; prefill_taper: later chunks shrink as the held prefix grows, so that no
    step costs more than about twice the first (partition.prefill_steps; the knee: prefill_knee_tokens, else the
    model's FLOP knee x cp; False: uniform chunks). request_timeout: seconds from arrival after which a request
    ends with an error (code "timeout") and is freed; None: no limit. tiers: the host and disk tiers'
    budgets per rank (serving/tiers.py; None: the device only). warmup: before the first step, run every
    kernel shape the service will use once (serving/warmup.py; None: on with CUDA, off on CPU); warmup_tokens:
    the longest document it prefills (None: the longest the window and cache budget admit). window_trim: a
    sliding-window model's entries keep only the keys of their local layers at positions >= C - (window - 1)
    once prefilled, C the prompt's context (document) length (Executor._trim): a long document's entry holds
    its global layers whole and a window (plus the question) of the rest; such an entry serves only prompts
    that share at least its document (context_cache.served_prefix; a prompt sharing less is prefilled).
    False: every key is kept and any shared prefix is served. The host and disk tiers keep a trimmed entry as
    it is (each layer its rows and window, and the fewest shared tokens it serves: serving/host_tier.py, kv_file.py).
    """

    def __init__(self, llm, *, cache_bytes: int, max_batch: int = 16, max_queue: int = 64,
                 max_extend: int = 4096, model_name: str = "starshard", cuda_graphs: bool = True,
                 prefill_chunk: int = 0, prefill_taper: bool = True, prefill_knee_tokens: int | None = None,
                 request_timeout: float | None = None,
                 tiers: TierConfig | None = None, warmup: bool | None = None, warmup_tokens: int | None = None,
                 window_trim: bool = True):
        runner = llm.runner
        if getattr(runner, "link", None) is not None:
            raise ValueError("the service does not run pipeline stages yet (--pp > 1): serve with --pp 1 and spread the "
                             "model with --tp and the document with --cp")
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} / {max_queue}")
        if prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk must be >= 0 tokens (0: the whole prompt), got {prefill_chunk}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {request_timeout}")
        # Sliding windows, soft-caps and scales run exactly: the prefill is the runner's, and the cascade
        # attention (serving/cascade.py) takes each layer's. A model the LLM runs without its windows (--fp8
        # attention) is held within its sliding window per request (LLM.check_length), as by LLM.generate.
        self.llm, self.config = llm, llm.config
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.max_model_len = self.config.max_position_embeddings
        self.max_batch, self.max_queue, self.max_extend = max_batch, max_queue, max_extend
        strategy = getattr(runner, "strategy", None)
        self.cache = ContextCache(cache_bytes, ranks=1 if strategy is None else strategy.cp)
        self.control = control_group()
        self.executor = Executor(runner, self.cache, cuda_graphs, control=self.control, config=self.config,
                                 tp=llm.parallel.tp)
        self.reuse = strategy is None or get_spec(strategy.name).context_cache  # APB's KV depends on the question
        self.prefill_chunk = prefill_chunk
        if prefill_chunk:
            try:  # a strategy that refuses a chunk (APB: its passing blocks need each host's whole block)
                runner.prefill_bounds(2 * prefill_chunk, 2 * prefill_chunk - 1, prefill_chunk)
            except ValueError as e:
                log.info("--prefill-chunk %d: each prompt is prefilled whole (%s)", prefill_chunk, e)
                self.prefill_chunk = 0
        self.prefill_knee = None  # the chunks' taper (partition.prefill_steps)
        if prefill_knee_tokens is not None and prefill_knee_tokens < 1:
            raise ValueError(f"--prefill-knee must be >= 1 token, got {prefill_knee_tokens}")
        if prefill_taper and self.prefill_chunk:
            # A model served without its windows (run_without_windows) attends globally on every layer.
            cfg = self.config if llm.unwindowed is None else replace(self.config, sliding_window=None)
            knee = prefill_knee(cfg)
            # Over a CP group a step also pays fixed per-layer collectives (the queries' all-gather, the
            # partials' all-to-all): steps may carry cp times the attention before they cost as much relative
            # to that fixed part (4 x H200, 512K ring: a 16K step's fixed part ~0.3 s; docs/results.md).
            self.prefill_knee = prefill_knee_tokens or (None if knee is None else knee * self.executor.cp)
        self.request_timeout = request_timeout
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.tiers: Tiers | None = None
        self._tier_version = 0  # bumped when a step moved entries between tiers (cached classifications go stale)
        if tiers is not None and tiers.any:
            if not self.reuse:  # APB: the KV depends on the question, so an entry is never reused, in any tier
                raise ValueError(f"--host-cache-gib / --disk-cache-dir: --cp-strategy {strategy.name}'s cache entries "
                                 "depend on the question and are never reused, so they are not tiered; drop those "
                                 "flags or serve with another --cp-strategy")
            ex = self.executor
            key = (server_key(llm, ex.dtype, self.prefill_chunk, self.prefill_knee) if tiers.disk_dir is not None
                   else None)
            self.tiers = ex.tiers = Tiers(tiers, ranks=ex.cp, cp_rank=ex.cp_rank, token_bytes=ex.token_bytes(),
                                          key=key, control=self.control)
        self.window_trim = window_trim and self.reuse and bool(self.executor.local_windows())
        self.executor.window_trim = self.window_trim
        self.reload_policy: DiskReloadPolicy | None = None  # rank 0 decides every promotion: it alone measures
        if self.tiers is not None and self.tiers.disk is not None:
            self.reload_policy = DiskReloadPolicy(tiers.disk_reload)
            self._skip_logged: set[str] = set()  # disk entries whose skip was logged (once each)
            self._flops = functools.lru_cache(maxsize=256)(self._prefill_flops)  # a long ring prompt's: ~0.1 s
            if self.rank == 0:
                self.executor.on_timing = self._observe
                self.tiers.writer.on_written = self._wake_to_settle
                # the rates this key measured on this device before a restart (reload_policy.RATES_FILE)
                device = llm.device
                self._rates_at = f"{key.digest}/{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
                if self.reload_policy.load(self.tiers.disk.path, self._rates_at):
                    log.info("disk cache: the reload rates of the last run on %s (reload %s s/GB, prefill %s s/PFLOP)",
                             self.tiers.disk.path, _per(self.reload_policy.reload.per_unit, 1e9),
                             _per(self.reload_policy.prefill.per_unit, 1e15))
                if self.reload_policy.mode == "split":
                    self._probe_rates(device)
        self._lock = threading.Condition()
        self._waiting: list[Request] = []
        self._running: dict[int, Request] = {}
        self._prefilling: Request | None = None  # the one document whose prefill runs chunk by chunk
        self._decoded = False  # the last step was a decode (decode first: the next one is prefill-side)
        self._turn = "short"  # which class of prefill-side work goes first when both have some
        self.step_log: collections.deque = collections.deque(maxlen=4096)  # (kind D/P/E, rid) of each step
        self.slow_steps: collections.deque = collections.deque(maxlen=16)  # (seconds, ops) of steps >= SLOW_STEP_S
        self._rids = itertools.count(1)
        self._error: str | None = None
        self._stop = False
        self.counters = dict(prefill_tokens_total=0, decode_tokens_total=0, cached_tokens_total=0, requests_total=0,
                             prefill_chunks_total=0, cancelled_total=0, timeouts_total=0, reload_failures_total=0,
                             split_reloads_total=0, tail_failures_total=0)
        self.errors: dict[str, int] = {}  # failed requests by error code
        self._thread: threading.Thread | None = None
        self._moves: list[_Move] = []  # demote() requests waiting for a step
        self._moved: list[_Move] = []  # those in the step running now
        self.warmup = self.executor.device.type == "cuda" if warmup is None else warmup
        self.warmup_tokens = warmup_tokens
        self.warmup_phases_s: dict[str, float] | None = None  # the warm-up's seconds by phase (warmup.py warm_up)
        self._warmed = threading.Event()  # rank 0: the scheduler thread's warm-up is over (start() waits)
        self._warm_error: BaseException | None = None  # the ranks disagree: start() raises it
        self._move_writes: dict[int, list[_Move]] = {}  # demote() requests waiting for their disk write, by entry
        self._written = False  # rank 0's writer finished a write: the next (idle) step settles it
        self._drops: list[_Move] = []  # demote() requests from the host tier, written: their host copy goes next
        self.longest_step_s = 0.0  # the longest step since a caller last reset it (bench serve --tiers)
        # graceful shutdown: seconds to write the entries not on disk yet down to it (--shutdown-write-s)
        self.shutdown_write_s = tiers.shutdown_write_s if self.tiers is not None and self.tiers.disk else 0.0

    # -- front end (rank 0)
    def chat_prompt(self, messages: list[dict]) -> Prompt:
        return build_chat_prompt(self.tokenizer, messages)

    def text_prompt(self, prompt: str | list[int]) -> Prompt:
        return build_prompt(self.tokenizer, prompt=prompt, raw=True)

    def submit(self, prompt: Prompt, *, max_tokens: int, sampling: SamplingConfig, stop=None,
               on_event: Callable[[TokenEvent], None]) -> Ticket:
        self.llm.check_length(len(prompt.ids), max_tokens, budget="max_tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        need = self.holdings(prompt, max_tokens)  # alone, on an empty cache
        if max(need) > self.cache.budget:
            raise ValueError(self._refusal(prompt, max_tokens, need))
        with self._lock:
            if self._error is not None or self._stop:
                raise ServiceUnavailable(self._error or "the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (--max-queue {self.max_queue}); "
                                "retry later")
            req = Request(next(self._rids), prompt, max_tokens, sampling, on_event,
                          ids=np.asarray(prompt.ids, dtype=np.int64))
            self._waiting.append(req)
            self.counters["requests_total"] += 1
            self._lock.notify()
        return Ticket(self, req.rid)

    def health(self) -> str | None:
        return self._error

    def stats(self) -> dict:
        with self._lock:
            p = self._prefilling
            left = 0 if p is None else len(p.prompt.ids) - (p.bounds[p.step - 1][1] if p.step else 0)
            return dict(queue_depth=len(self._waiting), running=len(self._running), prefilling_tokens_left=left,
                        cache_bytes=self.cache.used_bytes, cache_budget_bytes=self.cache.budget,
                        cache_entries=len(self.cache.entries), cache_hits=self.cache.hits,
                        cache_lookups=self.cache.lookups, errors_by_code=dict(self.errors),
                        slow_steps=list(self.slow_steps), tiers=self._tier_stats(), warmup_s=self.warmup_s,
                        warmup_phases_s=None if self.warmup_phases_s is None else dict(self.warmup_phases_s),
                        decode_graphs_kept=self.executor.kept_graphs(), **self.counters)

    def _tier_stats(self) -> dict:
        """Per tier (device, and host / disk when configured): bytes and entries held now, hits, and for the
        lower tiers demotions into them, promotions out of them and reload seconds (tier_stats.TierStats)."""
        out = dict(device=dict(bytes=self.cache.used_bytes, entries=len(self.cache.entries), hits=self.cache.hits,
                               lookups=self.cache.lookups))
        if self.tiers is not None:
            out |= self.tiers.stats()
        if self.reload_policy is not None and "disk" in out:
            out["disk"]["skipped_slower_than_prefill"] = self.reload_policy.skipped
        return out

    def _cancel(self, rid: int) -> None:
        with self._lock:
            for r in self._waiting:
                if r.rid == rid:
                    self._waiting.remove(r)
                    self.counters["cancelled_total"] += 1
                    self._emit(r, None, "cancelled")
                    return
            req = self._running.get(rid)
            if req is None and self._prefilling is not None and self._prefilling.rid == rid:
                req = self._prefilling
            if req is not None:
                req.cancelled = True
                self._lock.notify()

    # -- the loop
    def start(self) -> None:
        """Rank 0: the scheduler thread, returning once its warm-up is over. Other ranks: call serve_forever()
        instead. RanksDisagree: the ranks' warm-ups differ (their flags do); the server must not start."""
        self._thread = threading.Thread(target=self._loop, name="starshard-engine", daemon=True)
        self._thread.start()
        self._warmed.wait()
        if self._warm_error is not None:
            raise self._warm_error

    @property
    def warmup_s(self) -> float | None:
        """The warm-up's seconds (None: it did not run, or failed)."""
        return None if self.warmup_phases_s is None else sum(self.warmup_phases_s.values())

    def _warm_up(self) -> None:
        """The warm-up (serving/warmup.py), on the thread that runs the steps (cuDNN keeps its plans per
        thread). A failure is logged and the server serves cold; RanksDisagree is raised."""
        if not self.warmup:
            return
        ok = 1
        try:
            self.warmup_phases_s = warm_up(self, self.warmup_tokens)
        except RanksDisagree:
            raise
        except Exception as e:  # noqa: BLE001 (the kernels then compile on first use)
            ok = 0
            log.error("warm-up failed, serving cold (kernels compile on first use): %s: %s", type(e).__name__, e,
                      exc_info=not isinstance(e, ValueError))
        if self.control is not None:  # a rank that failed alone may hold other state: refuse to start
            t = torch.tensor([ok], dtype=torch.long)
            out = [torch.zeros_like(t) for _ in range(dist.get_world_size(self.control))]
            dist.all_gather(out, t, group=self.control)
            if len({int(o) for o in out}) > 1:
                raise RanksDisagree(f"the warm-up failed on ranks {[r for r, o in enumerate(out) if not o]} only "
                                    "(see their logs); restart, or start with --no-warmup")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step loop (and the other ranks'); with a disk tier, the entries held only on the device or
        in the host tier are first written to disk for up to `shutdown_write_s` seconds (_write_down)."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout + self.shutdown_write_s)
        self._close_tiers()

    # -- benchmarks: an explicit move down a tier (launch/bench.py serve --tiers; the server never calls it)
    def demote(self, ids, to: str, timeout: float = 3600.0) -> list[int]:
        """Move the cache entry sharing the longest prefix with `ids` down to tier `to` ("host" or "disk")
        in the next step, the way an eviction moves it (a host entry only to "disk"), and wait for that
        step. -> the entry's bytes on each CP rank. ValueError: that tier is off, no entry shares a prefix
        with `ids`, a request uses it, or it does not fit the host tier."""
        if to not in ("host", "disk"):
            raise ValueError(f"demote: the tier is 'host' or 'disk', got {to!r}")
        move = _Move(np.asarray(ids, dtype=np.int64), to)
        with self._lock:
            if self._error is not None or self._stop:
                raise ServiceUnavailable(self._error or "the server is shutting down")
            self._moves.append(move)
            self._lock.notify()
        if not move.done.wait(timeout):
            raise TimeoutError(f"demote: no step moved the entry within {timeout:g} s")
        if move.error is not None:
            raise ValueError(f"demote to {to}: {move.error}")
        return move.rank_bytes

    def _move_ops(self, move: "_Move") -> list[Op]:
        """The ops of one demote() request (rank 0, under the lock)."""
        tiers, cp = self.tiers, self.executor.cp
        if tiers is None or getattr(tiers, move.to) is None:
            raise ValueError(f"there is no {move.to} tier (start with "
                             f"{'--host-cache-gib' if move.to == 'host' else '--disk-cache-dir / --disk-cache-gib'})")
        e, _ = self.cache.peek(move.ids, whole=True)  # a document's own tokens find its entry, trimmed or not
        if e is not None:
            if e.users:
                raise ValueError(f"context cache entry {e.id} is used by {e.users} running requests")
            move.rank_bytes = list(e.rank_bytes) if e.rank_bytes is not None else [e.nbytes] * cp
            if move.to == "disk":
                move.write = e.id
                return [self._to_disk(e.id, e.ids, move.rank_bytes)]
            drop, writes, fits = self._host_room(move.rank_bytes, set(), [0] * cp)
            if not fits:
                raise ValueError(f"its {max(move.rank_bytes) / 2**30:.2f} GiB shard does not fit the host tier "
                                 f"({tiers.host.budget / 2**30:.2f} GiB per rank, --host-cache-gib) beside the "
                                 f"entries being written to disk or not yet written; retry once they are")
            return [Evict(drop)] * bool(drop) + [self._to_disk(h, None, None) for h in writes] + [Demote(e.id, "host")]
        h, _ = tiers.host.peek(move.ids, whole=True) if tiers.host is not None else (None, 0)
        if h is not None and move.to == "disk":
            move.rank_bytes = list(h.rank_bytes or [h.kv.nbytes] * cp)
            move.write = h.id
            return [self._to_disk(h.id, h.ids, move.rank_bytes)]
        raise ValueError("no cache entry on the device" + (" or in the host tier" if move.to == "disk" else "")
                         + " shares a prefix with these tokens")

    def _requested_moves(self) -> list[Op]:
        """One waiting demote() request's ops (one a step: each plans on the tiers as the last one left them)."""
        while self._moves:
            move = self._moves.pop(0)
            try:
                ops = self._move_ops(move)
            except ValueError as e:
                move.error = str(e)
                move.done.set()
                continue
            self._moved.append(move)
            return ops
        return []

    def _moves_done(self, error: str | None = None) -> None:
        """Answer the demote() requests of the step just run (with `error`: every one still waiting too)."""
        if not self._moved and error is None:  # the common step: no lock taken (only this thread moves them)
            return
        with self._lock:
            for move in self._moved + (self._moves if error else []):
                if move.write is not None and error is None and move.error is None:
                    self._move_writes.setdefault(move.write, []).append(move)  # answered by _writes_done
                    continue
                move.error = move.error or error
                move.done.set()
            self._moved.clear()
            if error:
                self._moves.clear()
                for move in [m for moves in self._move_writes.values() for m in moves] + self._drops:
                    move.error = move.error or error
                    move.done.set()
                self._move_writes.clear()
                self._drops.clear()

    def _writes_done(self) -> None:
        """The disk writes every rank settled in the step just run (rank 0): the tiers changed, and the
        demote() requests waiting on them are answered."""
        settled, self.executor.settled = self.executor.settled, []
        if settled:
            self._tier_version += 1
        if not self._move_writes:
            return
        # a move whose write failed is answered with the error; one that wrote, or found its file on disk
        # already, ends with a step that drops its host copy (the entry then lives on disk only)
        with self._lock:
            for entry, ok in settled:
                for move in self._move_writes.pop(entry, []):
                    if ok and self.tiers.host is not None and entry in self.tiers.host.entries:
                        move.write, move.drop = None, entry  # a move ends on disk only: a step drops the host copy
                        self._drops.append(move)
                        continue
                    move.error = move.error or (None if ok else "its disk write failed on a rank (see the log)")
                    move.done.set()
            for entry in [e for e in self._move_writes if e not in self.executor.writes]:  # on disk already
                for move in self._move_writes.pop(entry):
                    if self.tiers.host is not None and entry in self.tiers.host.entries:
                        move.write, move.drop = None, entry
                        self._drops.append(move)
                    else:
                        move.done.set()

    def _wake_to_settle(self) -> None:
        """Rank 0's writer thread finished a write: an idle loop sends a step now to settle it."""
        with self._lock:
            self._written = True
            self._lock.notify()

    def _write_down(self) -> None:
        """Graceful shutdown with a disk tier (rank 0): the entries held only on the device or in the host
        tier are written to disk, most recently used first, within the disk budget and --shutdown-write-s,
        so that a restart on the same --disk-cache-dir serves them from there; the writes evictions queued
        before the stop are finished first, within the same limit. The requests still running
        are cut off first (as without a write-down). Steps go on meanwhile, one or two writes queued at a
        time (a device shard waits for its write in host memory of its own); what the limit cuts off is
        left unwritten (a write in progress leaves a temporary file, removed at the next start)."""
        tiers, limit = self.tiers, self.shutdown_write_s
        if not limit or tiers is None or tiers.disk is None:
            return
        t0, ex, cp = time.monotonic(), self.executor, self.executor.cp
        with self._lock:
            running = list(self._running)
            self._running.clear()
        if running:
            self._step([Finish(running)])
        p = self._prefilling
        if p is not None:
            self._step([Abort(p.rid, p.entry)])
            self._prefilling = None
        device = sorted((e for e in self.cache.entries.values() if not e.pinned and not e.users and not e.filling),
                        key=lambda e: -e.last_used)
        host = sorted((e for e in tiers.host.entries.values() if not (e.written or e.writing)),
                      key=lambda e: -e.last_used) if tiers.host is not None else []
        room = [tiers.disk.budget - sum(tiers.disk._writing.values())] * cp  # writes in flight keep their room
        todo = []
        for kind, e in [("device", e) for e in device] + [("host", e) for e in host]:
            if tiers.disk.entry_for(e.ids) is not None:
                continue  # on disk already
            rank_bytes = (list(e.rank_bytes) if e.rank_bytes is not None else
                          [e.nbytes if kind == "device" else e.kv.nbytes] * cp)
            need = [b + 8 * len(e.ids) + (1 << 20) for b in rank_bytes]  # the file's token ids and header
            if all(n <= r for n, r in zip(need, room)):
                room = [r - n for r, n in zip(room, need)]
                todo.append((e.id, e.ids, rank_bytes))
        if not todo and not ex.writes:
            return
        # evictions' writes in flight are waited for too: the writer drops what is still queued at close
        total = sum(max(b) for _, _, b in todo)
        log.info("shutdown: writing %d cache entries, %.2f GiB per rank at most, to %s (at most %g s, "
                 "--shutdown-write-s)%s", len(todo), total / 2**30, tiers.disk.path, limit,
                 f"; {len(ex.writes)} writes in flight first" if ex.writes else "")
        written, done_bytes, queued, n = 0, 0, {}, len(todo)
        while (todo or ex.writes) and time.monotonic() - t0 < limit:
            ops = []
            if todo and len(ex.writes) < 2:
                entry, ids, rank_bytes = todo.pop(0)
                queued[entry] = max(rank_bytes)
                ops = [self._to_disk(entry, ids, rank_bytes)]
            self._step(ops)
            for entry, ok in ex.settled:
                if ok and entry in queued:
                    written += 1
                    done_bytes += queued[entry]
                    log.info("shutdown: %d of %d entries written (%.2f GiB) in %.1f s", written, n,
                             done_bytes / 2**30, time.monotonic() - t0)
            ex.settled.clear()
            if not ops:
                time.sleep(0.05)
        left = len(todo) + len(ex.writes)
        log.info("shutdown: wrote %d cache entries (%.2f GiB per rank at most) to %s in %.1f s%s", written,
                 done_bytes / 2**30, tiers.disk.path, time.monotonic() - t0,
                 f"; {left} not written (--shutdown-write-s {limit:g} reached)" if left else "")

    def _step(self, ops: list[Op]) -> None:
        """One step of housekeeping ops on every rank (shutdown)."""
        self._broadcast(ops)
        self.executor.run(ops)

    def _close_tiers(self) -> None:
        if self.tiers is not None:
            if self.reload_policy is not None and self.rank == 0:
                self.reload_policy.save(self.tiers.disk.path, self._rates_at)  # for the next server here
            self.tiers.close()  # the disk tier's lock: a new server may take the directory

    def serve_forever(self) -> None:
        """Every rank but 0: the warm-up, then execute the broadcast steps until rank 0 says stop."""
        self._warm_up()
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            ops = box[0]
            if ops is None:
                self._close_tiers()
                return
            self.executor.run(ops)

    def _loop(self) -> None:
        try:
            self._warm_up()
        except Exception as e:  # noqa: BLE001 (RanksDisagree: start() raises it)
            self._warm_error = e
            with self._lock:
                self._error = f"the engine did not start: {type(e).__name__}: {e}"
            return
        finally:
            self._warmed.set()
        try:
            while True:
                ops = self._plan()
                if ops is None:  # shutting down
                    self._moves_done("the server is shutting down")
                    self._write_down()
                    self._broadcast(None)
                    return
                self._broadcast(ops)
                t0 = time.perf_counter()
                tokens, failures = self.executor.run(ops)  # also an empty step: every rank settles disk writes
                if any(isinstance(op, (Evict, Demote, Promote)) for op in ops):
                    self._tier_version += 1
                self._deliver(tokens, failures)
                self._moves_done()
                self._writes_done()
                self._time_step(ops, time.perf_counter() - t0)
        except Exception as e:  # a dead or hung rank, or a bug: fail what is in flight, refuse the rest
            log.error("engine stopped: %s", e)
            with self._lock:
                self._error = f"the engine stopped: {type(e).__name__}: {e}"
                for r in list(self._running.values()) + self._waiting:
                    self._emit(r, None, "error", error=self._error, code="unavailable")
                self._running.clear()
                self._waiting.clear()
            self._moves_done(self._error)

    def _time_step(self, ops: list[Op], seconds: float) -> None:
        """Log a slow step (kernel compilation, a CUDA-graph capture, a long chunk): operators see what
        stalled the streams; stats() keeps the last few. A step's time ends when its tokens are read,
        so a step without tokens (a middle chunk) is counted in the next one. The log line is only for a slow
        step that other requests waited on (streams running, or requests queued): a lone document's chunks are
        not a stall."""
        self.longest_step_s = max(self.longest_step_s, seconds)
        if seconds < SLOW_STEP_S:
            return
        what = ", ".join(f"{type(op).__name__}" + (f" {op.start}:{op.end}" if isinstance(op, PrefillChunk) else "")
                         for op in ops)
        self.slow_steps.append((round(seconds, 3), what))
        own = {op.rid for op in ops if hasattr(op, "rid") and not isinstance(op, Decode)}
        with self._lock:
            waited = sum(1 for rid in self._running if rid not in own) + sum(1 for r in self._waiting
                                                                             if r.rid not in own)
        if waited:
            log.warning("slow step: %.2f s (%s; %d requests waited)", seconds, what, waited)

    def _broadcast(self, ops) -> None:
        if self.control is not None:
            dist.broadcast_object_list([ops], src=0, group=self.control)

    def entry_rank_bytes(self, prompt_len: int, context_len: int) -> list[int]:
        """A new document's entry on each CP rank, laid out as this service prefills it (its chunk and taper)."""
        return self.executor.entry_rank_bytes(prompt_len, context_len, self.prefill_chunk or None, self.prefill_knee)

    def holdings(self, prompt: Prompt, max_tokens: int, prefix: int = 0,
                 running: list[tuple[int, int]] = ()) -> list[int]:
        """Bytes each CP rank needs beside the cache's entries to start this request: its new entry's
        shard (none when it extends a cached entry's first `prefix` tokens), and on the query rank the
        own-KV pool rebuilt with it (its own tokens outside the entry and max_tokens) while the old pool
        and its own tokens' KV are still held. `running`: the running rows' (own tokens, remaining)."""
        ex, L = self.executor, len(prompt.ids)
        need = [0] * ex.cp if prefix else self.entry_rank_bytes(L, prompt.context_len)
        own = L - prefix if prefix else 0  # a prefill's tokens (Star's question too) are in its entry
        running = list(running)
        need[ex.query_rank] += (ex.pool_bytes(running + [(own, max_tokens - 1)]) + ex.pool_bytes(running)
                                + own * ex.own_token_bytes())
        return need

    def _refusal(self, prompt: Prompt, max_tokens: int, need: list[int]) -> str:
        """Why a prompt can never fit, with each rank's GiB and what would fit (--cache-gib, or a larger --cp)."""
        ex, L, gib = self.executor, len(prompt.ids), 2**30
        sizes = " | ".join(f"{n / gib:.3g}" for n in need)
        if ex.strategy is None or ex.cp == 1:
            what = f"{sizes} GiB (its KV: {L} tokens, and {max_tokens} new tokens)"
        else:
            pool = need[ex.query_rank] - self.entry_rank_bytes(L, prompt.context_len)[ex.query_rank]
            what = (f"per rank {sizes} GiB (entry shard of {L} tokens over cp={ex.cp} {ex.strategy.name}; rank "
                    f"{ex.query_rank} also holds {max_tokens} new tokens: {pool / gib:.3g} GiB)")
        fixes = [f"start with --cache-gib {math.ceil(max(need) / gib * 10) / 10:.1f}"]
        wider = self._wider_cp(prompt, max_tokens)
        if wider is not None:
            fixes.append(f"with --cp {wider[0]} ({wider[1] / gib:.3g} GiB per rank)")
        return (f"this prompt needs {what} but the context cache budget is {self.cache.budget / gib:.3g} GiB per rank "
                f"(--cache-gib): {', or '.join(fixes)}")

    def _wider_cp(self, prompt: Prompt, max_tokens: int) -> tuple[int, int] | None:
        """(cp, worst rank's bytes) of the smallest of 2, 4, 8 x cp with the same strategy and tp that fits
        the budget (the same per-rank arithmetic), or None."""
        ex, L = self.executor, len(prompt.ids)
        if ex.strategy is None or get_spec(ex.strategy.name).single_rank:
            return None
        options = ex.strategy.spec_options()
        if options.get("query_rank") == ex.cp - 1:
            options.pop("query_rank")  # the default: the last rank of the wider group
        pool = ex.pool_bytes([(0, max_tokens - 1)])
        for cp in (2 * ex.cp, 4 * ex.cp, 8 * ex.cp):
            rows = get_spec(ex.strategy.name).rank_rows(cp, L, prompt.context_len, options, self.prefill_chunk or None,
                                                        self.prefill_knee)
            worst = max(max(rows) * ex.token_bytes(), rows[options.get("query_rank", cp - 1)] * ex.token_bytes() + pool)
            if worst <= self.cache.budget:
                return cp, worst
        return None

    def _plan(self) -> list[Op] | None:
        """The next step's operations (None: shut down): housekeeping (cancelled and timed-out requests),
        then a decode if rows run and the last step was not one, else one prefill-side action."""
        with self._lock:
            while (not self._stop and not self._waiting and not self._running and self._prefilling is None
                   and not self._moves and not self._drops):
                if self._written:  # an empty step settles the disk write (serving/executor.py, settle_writes)
                    self._written = False
                    return []
                tick = WRITE_TICK_S if self.executor.writes else IDLE_TICK_S
                if not self._lock.wait(tick) and (self.control is not None or self.executor.writes):
                    return []  # keep the other ranks' broadcast from timing out; settle the disk writes
            if self._stop:
                return None
            ops = self._housekeeping()
            if self._drops:  # demote() moves whose files are committed: their host copies go (answered after)
                self._moved += self._drops
                ops.append(Evict(sorted({m.drop for m in self._drops})))
                self._drops = []
            moves = self._requested_moves() if self._moves else []
            if moves:  # a step of its own: the next plan sees the entry gone
                return ops + moves
            if self._running and not self._decoded:
                self._decoded = True
                return self._logged(ops + [Decode()])
            action = self._prefill_side()
            if action:
                self._decoded = False
                return self._logged(ops + action)
            if self._running:
                self._decoded = True
                return self._logged(ops + [Decode()])
            if not ops:  # waiting work that cannot start yet: wait for a change, not in a busy loop
                self._lock.wait(0.05)
            return ops

    def _logged(self, ops: list[Op]) -> list[Op]:
        for op in ops:
            match op:
                case Decode():
                    self.step_log.append(("D", None))
                case Prefill() | PrefillChunk():
                    self.step_log.append(("P", op.rid))
                    self.counters["prefill_chunks_total"] += 1
                case Extend():
                    self.step_log.append(("E", op.rid))
        return ops

    def _expired(self, req: Request, now: float) -> bool:
        return self.request_timeout is not None and now - req.arrived > self.request_timeout

    def _time_out(self, req: Request, now: float) -> None:
        self.counters["timeouts_total"] += 1
        self._fail(req, "timeout", f"the request ran past --request-timeout {self.request_timeout:g} s: "
                                   f"{now - req.arrived:.2f} s since it arrived")

    def _housekeeping(self) -> list[Op]:
        """Finish cancelled and timed-out rows, abort a cancelled or timed-out document prefill, and
        fail timed-out waiting requests."""
        ops: list[Op] = []
        now = time.monotonic()
        gone = [r for r in self._running.values() if r.cancelled or self._expired(r, now)]
        if gone:
            ops.append(Finish([r.rid for r in gone]))
        for r in gone:
            del self._running[r.rid]
            self._end_early(r, now)
        p = self._prefilling
        if p is not None and (p.cancelled or self._expired(p, now)):
            ops.append(Abort(p.rid, p.entry))
            self._prefilling = None
            self._end_early(p, now)
        for r in [r for r in self._waiting if self._expired(r, now)]:
            self._waiting.remove(r)
            self._time_out(r, now)
        return ops

    def _end_early(self, req: Request, now: float) -> None:
        if req.cancelled:
            self.counters["cancelled_total"] += 1
            self._emit(req, None, "cancelled")
        else:
            self._time_out(req, now)

    def _prefill_side(self) -> list[Op] | None:
        """One prefill-side action. Two classes, each in arrival order, take turns when both have work:
        short admissions (an extend of a cached document) and document work (the next chunk of the
        document being prefilled, else the oldest new document once its holdings fit). A request for
        the document still filling is parked until it completes, then extends."""
        short, doc = self._short_work(), self._doc_work()
        pick = short if doc is None or (short is not None and self._turn == "short") else doc
        if pick is None:
            return None
        self._turn = "doc" if pick is short else "short"
        return pick()

    def _classify(self, req: Request):
        """("short", entry, m) for an extend of a cached entry, "parked" for a request the filling
        document will serve, else "doc". Kept per request until the entries change: the queue is scanned
        every step, and comparing a long prompt with every entry is not free."""
        p = self._prefilling
        key = (tuple((e.id, e.filling) for e in self.cache.entries.values()), None if p is None else p.rid,
               self._tier_version)
        if req.kind is None or req.kind[0] != key:
            req.kind = (key, self._classify_now(req))
        return req.kind[1]

    def _classify_now(self, req: Request):
        entry, m = self.cache.peek(req.ids) if self.reuse else (None, 0)
        if entry is not None and self._extends(len(req.ids), m):
            return "short", entry, m
        if self.tiers is not None:
            tier, lower, m = self.tiers.peek(req.ids)
            p = self._prefilling
            if tier == "disk" and p is not None and p.split is not None and np.array_equal(p.split.ids, lower.ids):
                return "parked", None, 0  # its split reload is under way
            cut = self._split_cut(lower) if tier == "disk" and self._extends(len(req.ids), m) else None
            if cut is not None and 0 < cut < len(lower.ids):
                need = self._promoted_bytes(tier, lower)
                alone = self.holdings(req.prompt, req.max_tokens, m)
                if max(a + b for a, b in zip(need, alone)) <= self.cache.budget:
                    return "split", (lower, cut), m
            if cut is not None:  # planned: 0 reloads whole, P prefills (a cut inside that did not fit: as below)
                req.reload_skipped = cut == len(lower.ids)
            else:
                req.reload_skipped = (tier == "disk" and self._extends(len(req.ids), m)
                                      and not self._reload_pays(req, lower, m))
            if req.reload_skipped:  # a miss on disk: the host tier's entry, if any, else a prefill
                tier, lower, m = self.tiers.peek(req.ids, disk=False)
            if lower is not None and self._extends(len(req.ids), m):
                need = self._promoted_bytes(tier, lower)
                alone = self.holdings(req.prompt, req.max_tokens, m)
                if max(a + b for a, b in zip(need, alone)) <= self.cache.budget:  # else: a prefill (smaller budget)
                    return "promote", (tier, lower), m
        p = self._prefilling
        if p is not None and self.reuse:
            m = min(common_prefix(p.ids, req.ids), len(req.ids) - 1)
            if m < self._serves_from(p.prompt):  # its entry will not serve this prompt (served_prefix)
                m = 0
            if m > 0 and self._extends(len(req.ids), m):
                return "parked", None, 0
        return "doc", None, 0

    def _serves_from(self, prompt: Prompt) -> int:
        """The fewest shared tokens the entry of this prompt serves once prefilled (Executor._trim's rule)."""
        C = trim_start(prompt.context_len, len(prompt.ids))
        trims = self.window_trim and any(C - (w - 1) > 0 for w in self.executor.local_windows().values())
        return C if trims else 0

    def _extends(self, n: int, m: int) -> bool:
        # Run only the rest when the cache holds most of the prompt and the rest is short. A prompt that
        # shares just a chat template's header with an entry is a new document: prefill it, cache it.
        return n - m <= self.max_extend and n - m <= m

    def _short_work(self):
        """The waiting extends that can start now, oldest first, as a thunk that admits them, or None.
        Several start in one step (the executor runs those on one entry with one shape in one forward):
        questions arriving together then wait one step for their first token, not one step each. The
        ones after the first start only without evictions (plan_room saw the cache before the first's)."""
        picks, running = [], self.executor.pool_rows()
        for req in self._waiting:
            kind, entry, m = self._classify(req)
            if kind not in ("short", "promote"):
                continue
            if len(self._running) + len(picks) >= self.max_batch or (kind == "promote" and picks):
                break  # a promotion starts alone: its room is planned on the tiers as they are
            need = self.holdings(req.prompt, req.max_tokens, m, running)
            if kind == "promote":
                need = [a + b for a, b in zip(need, self._promoted_bytes(*entry))]
            victims = self.cache.plan_room(need, keep=entry.id if kind == "short" else None)
            if victims is None or (picks and victims):
                break
            picks.append((req, kind, entry, m, victims))
            running = running + [(len(req.ids) - m, req.max_tokens - 1)]
            if kind == "promote":
                break
        if not picks:
            return None

        def admit():
            ops: list[Op] = []
            for req, kind, entry, m, victims in picks:
                self.cache.lookup(req.ids)  # counted once per admitted request
                req.cached = m
                self._start(req)
                if kind == "promote":
                    promote = self._promote(req, *entry)
                    moving = promote.source == "host" and promote.copy_of is None
                    ops += self._make_room(victims, promoting=promote.entry if moving else None)
                    ops.append(promote)
                    entry_id = promote.entry
                else:
                    ops += self._make_room(victims)
                    entry_id = entry.id
                ops.append(Extend(rid=req.rid, ids=req.prompt.ids, max_tokens=req.max_tokens, sampling=req.sampling,
                                  entry=entry_id, prefix=m))
            return ops
        return admit

    # -- the lower tiers (rank 0 plans every move; serving/tiers.py)
    def _promoted_bytes(self, tier: str, lower) -> list[int]:
        """A lower tier entry's bytes on each CP rank once back on the device."""
        if tier == "host":
            return list(lower.rank_bytes) if lower.rank_bytes is not None else [lower.kv.nbytes] * self.executor.cp
        return self.tiers.disk_bytes[token_digest(lower.ids)]

    def _reload_pays(self, req: Request, lower, m: int) -> bool:
        """The disk reload policy's verdict on promoting disk entry `lower` for `req`'s first m tokens
        (a skip logged once per entry, with both estimates)."""
        digest = token_digest(lower.ids)
        nbytes = sum(self.tiers.disk_bytes[digest])
        verdict = self.reload_policy.decide(nbytes, self._flops(m, min(req.prompt.context_len, m)))
        if not verdict.promote and digest not in self._skip_logged:
            self._skip_logged.add(digest)
            log.info("disk cache entry of %d tokens: reloading its %.2f GB (every rank's shards) is expected to take "
                     "%.2f s, prefilling its %d shared tokens %.2f s: prefilled instead (the file stays; "
                     "--disk-reload-policy always reloads)", len(lower.ids), nbytes / 1e9, verdict.reload_s, m,
                     verdict.prefill_s)
        return verdict.promote

    def _prefill_flops(self, prompt_len: int, context_len: int) -> float | None:
        """The slowest rank's FLOPs of prefilling this prompt (the strategy's FLOP model, strategies/flops.py);
        None where the model does not apply (e.g. fewer context tokens than Star's ranks)."""
        ex = self.executor
        try:
            spec = get_spec("dense" if ex.strategy is None else ex.strategy.name)
            return max(r.total for r in spec.prefill_flops(self.config, prompt_len, context_len, ex.strategy))
        except (ValueError, NotImplementedError):
            return None

    def _observe(self, op: Op, seconds: float) -> None:
        """The executor's time of a completed promotion or prefill, or of a split reload's fill step or tail
        read (rank 0): the disk reload policy's rates."""
        match op:
            case Promote(source="disk"):
                self.reload_policy.observe_reload(seconds, sum(op.rank_bytes))
                self.reload_policy.save(self.tiers.disk.path, self._rates_at)
            case JoinTail():
                self.reload_policy.observe_reload(seconds, op.nbytes)
                self.reload_policy.save(self.tiers.disk.path, self._rates_at)
            case PrefillChunk(fill=True):
                flops = self._head_flops(op.end, op.context_len)
                if flops is not None and op.start:
                    before = self._head_flops(op.start, op.context_len)
                    flops = None if before is None else flops - before
                if flops:
                    self.reload_policy.observe_prefill(seconds, flops)
            case Prefill() | PrefillChunk():
                flops = self._flops(len(op.ids) if isinstance(op, Prefill) else op.prompt_len, op.context_len)
                if flops:
                    self.reload_policy.observe_prefill(seconds, flops)

    def _promote(self, req: Request, tier: str, lower) -> Promote:
        """The op that brings `lower` back to the device (the lookup counted in its tier's stats)."""
        if tier == "host":
            self.tiers.host.lookup(req.ids)
            if lower.writing:  # its disk write is in flight: a copy comes up, the host entry stays until settled
                return Promote(entry=self.cache.next_id(), source="host", ids=None,
                               rank_bytes=self._promoted_bytes(tier, lower), copy_of=lower.id)
            return Promote(entry=lower.id, source="host", ids=None, rank_bytes=self._promoted_bytes(tier, lower))
        self.tiers.disk.get(req.ids, only=self.tiers.disk_bytes)
        return Promote(entry=self.cache.next_id(), source="disk", ids=lower.ids.tolist(),
                       rank_bytes=self._promoted_bytes(tier, lower))

    # -- a split reload (--disk-reload-policy split; reload_policy.py): the head computed while the tail is read
    def _context_of(self, lower) -> int | None:
        """The context_len disk entry `lower` was prefilled with, where its layout depends on it (Star: its file
        records it; None in a file written before it did), else its length (the exact strategies ignore it)."""
        if not getattr(self.executor.strategy, "query_phase", False):
            return len(lower.ids)
        return getattr(lower, "context_len", None)

    def _head_flops(self, c: int, context_len: int) -> float | None:
        """The slowest rank's FLOPs of prefilling a prompt's first c tokens (0 for none)."""
        return self._flops(c, min(context_len, c)) if c else 0.0

    def _probe_rates(self, device) -> None:
        """--disk-reload-policy split without saved rates: probe the missing ones now, so that the first disk hit
        is split too (reload_policy.probe_read / probe_prefill)."""
        policy, disk = self.reload_policy, self.tiers.disk
        probed = []
        if policy.reload.per_unit is None:
            policy.reload.per_unit = probe_read(sorted(disk.path.glob("*.kv")), disk.readers)
            probed.append(f"reload {_per(policy.reload.per_unit, 1e9)} s/GB")
        if policy.prefill.per_unit is None:
            policy.prefill.per_unit = probe_prefill(device, self.executor.dtype)
            probed.append(f"prefill {_per(policy.prefill.per_unit, 1e15)} s/PFLOP")
        if probed:
            log.info("disk cache: no saved reload rates in %s; probed %s", disk.path, ", ".join(probed))

    def _split_cut(self, lower) -> int | None:
        """Where to cut disk entry `lower` between a computed head and a read tail (_plan_cut), or None where the
        policy decides as "auto": another mode, no chunks, nothing measured yet, a window-trimmed file (its local
        layers keep only their window), an entry rebuilt from another layout's files (no one file holds its
        tail), or a Star file that does not record its document's length."""
        policy = self.reload_policy
        if policy is None or policy.mode != "split" or not self.prefill_chunk or lower.serves_from \
                or getattr(lower, "shared", False):
            return None
        ctx = self._context_of(lower)
        if ctx is None:
            return None
        return self._plan_cut(lower.ids, ctx, sum(self.tiers.disk_bytes[token_digest(lower.ids)]))

    def _plan_cut(self, ids, ctx: int, nbytes: int, done: int = 0, read_s: float = 0.0,
                  live: tuple[float, float] | None = None) -> int | None:
        """The chunk bound >= `done` (the head computed so far) where computing the head of an entry of `ids`
        (document part `ctx`, `nbytes` over every rank's shards) and reading the rest are expected to finish
        together, `read_s` seconds into the read (reload_policy.split); None: a rate or FLOP model missing."""
        P = len(ids)
        cuts = [done] + [e for _, e in self.llm.runner.prefill_bounds(P, ctx, self.prefill_chunk, self.prefill_knee)
                         if e > done]
        base = self._head_flops(done, ctx)
        flops = [self._head_flops(c, ctx) for c in cuts]
        keep = [k for k, f in enumerate(flops) if f is not None and base is not None]
        if not keep:
            return None
        return self.reload_policy.split([cuts[k] for k in keep], [flops[k] - base for k in keep],
                                        [nbytes * (P - cuts[k]) / P for k in keep], read_s, live)

    def _split_start(self, req: Request, lower, cut: int, m: int):
        """The first step of a split reload (a thunk), once the entry and the request's own part fit: the tail
        read starts on every rank and the head's first chunk runs."""
        need = self.holdings(req.prompt, req.max_tokens, m, running=self.executor.pool_rows())
        need = [a + b for a, b in zip(need, self._promoted_bytes("disk", lower))]
        victims = self.cache.plan_room(need)
        if victims is None:
            return None

        def start():
            self.cache.lookup(req.ids)  # counted once per admitted request
            self.tiers.disk.get(req.ids, only=self.tiers.disk_bytes)  # a disk hit: counted, touched
            ids = lower.ids.tolist()
            ctx = self._context_of(lower)
            entry = self.cache.next_id()
            ops = self._make_room(victims)
            self._waiting.remove(req)
            req.bounds = self.llm.runner.prefill_bounds(len(ids), ctx, self.prefill_chunk, self.prefill_knee)
            req.step, req.entry = 0, entry
            req.split = _Split(ids, m, cut, ctx, sum(self.tiers.disk_bytes[token_digest(ids)]))
            self._prefilling = req
            self.counters["split_reloads_total"] += 1
            return ops + [ReadTail(entry, ids, cut), self._fill_op(req)]
        return start

    def _next_fill(self, req: Request):
        """A split reload's next step: its next head chunk (re-planned by the rates measured meanwhile), or,
        the head done, the tail's graft and the request's extend, or the last computed chunk and the extend."""
        s, P = req.split, len(req.split.ids)
        done = req.bounds[req.step - 1][1]
        retarget = []
        if s.cut < P:
            cut = self._plan_cut(s.ids, s.context_len, s.nbytes, done, time.monotonic() - s.began,
                                 self._tail_progress(req))
            if cut is not None and cut != s.cut:
                s.cut = cut
                retarget = [ReadTail(req.entry, s.ids, cut)]  # P: the reader stops, the rest is computed
        if done < s.cut and req.bounds[req.step][1] < P:
            return lambda: retarget + [self._fill_op(req)]
        if len(self._running) >= self.max_batch:  # it joins the batch with its extend
            return None
        victims = self.cache.plan_room(self.holdings(req.prompt, req.max_tokens, s.m,
                                                     running=self.executor.pool_rows()))
        if victims is None:
            return None

        def finish():
            ops = retarget + self._make_room(victims)
            if done == s.cut:
                ops.append(JoinTail(req.rid, req.entry, s.cut, s.nbytes * (P - s.cut) // P))
                req.cached = max(0, s.m - s.cut)
            else:
                ops.append(self._fill_op(req))  # the last chunk: the entry complete
                req.cached = 0
            self._prefilling = None
            req.running = True
            self._running[req.rid] = req
            return ops + [Extend(rid=req.rid, ids=req.prompt.ids, max_tokens=req.max_tokens, sampling=req.sampling,
                                 entry=req.entry, prefix=s.m)]
        return finish

    def _tail_progress(self, req: Request) -> tuple[float, float] | None:
        """Rank 0's tail read so far as (seconds per byte, bytes read) over every rank's shards, once it has read a
        block: the ranks read their shards at once, so rank 0's share of the entry's bytes scales both."""
        tail = self.executor.tails.get(req.entry)
        if not isinstance(tail, TailRead):
            return None
        nbytes, seconds = tail.progress()
        if nbytes <= 0:
            return None
        share = tail.header.payload_bytes / req.split.nbytes
        return seconds / nbytes * share, nbytes / share

    def _fill_op(self, req: Request) -> PrefillChunk:
        start, end = req.bounds[req.step]
        req.step += 1
        s = req.split
        return PrefillChunk(rid=req.rid, entry=req.entry, start=start, end=end, chunk=self.prefill_chunk,
                            knee=self.prefill_knee, prompt_len=len(s.ids), ids=s.ids if start == 0 else None,
                            max_tokens=1, sampling=GREEDY, context_len=s.context_len, head_len=0, fill=True)

    def _compute_rest(self, rid: int) -> None:
        """A split reload's tail failed on some rank (its file dropped): the head stays, the rest is computed."""
        req = self._running.pop(rid, None)
        if req is None:
            return
        self.counters["tail_failures_total"] += 1
        log.warning("request %d: its cached document's tail could not be read on every rank; computing the rest", rid)
        req.running, req.cached = False, 0
        req.split.cut = len(req.split.ids)
        self._prefilling = req
        self._tier_version += 1

    def _make_room(self, victims: list[int], promoting: int | None = None) -> list[Op]:
        """The ops that free the device's `victims` (least recently used first): each moves one tier down,
        to the host tier when its shard fits there beside the host entries that must stay (those being
        written to disk, and those not on disk yet: their writes start here, in the background, so that
        they may be dropped later), else to disk (written in the background), else it is dropped.
        `promoting`: a host entry this step brings up (its room counts as free; never a victim). Pinned
        (APB) entries are never tiered."""
        tiers = self.tiers
        if not victims:
            return []
        if tiers is None:
            return [Evict(victims)]
        ops: list[Op] = []
        drop: list[int] = []
        gone = {promoting} if promoting is not None else set()
        started: set[int] = set()  # host entries whose write this step starts
        arriving = [0] * self.executor.cp
        for v in victims:
            e = self.cache.entries[v]
            rank_bytes = list(e.rank_bytes) if e.rank_bytes is not None else [e.nbytes] * self.executor.cp
            if e.pinned:
                drop.append(v)
                continue
            fits = False
            if tiers.host is not None:
                out, writes, fits = self._host_room(rank_bytes, gone, arriving, started)
                started.update(writes)
                ops += [self._to_disk(h, None, None) for h in writes]
                if fits:
                    drop += out
                    gone.update(out)
                    arriving = [a + b for a, b in zip(arriving, rank_bytes)]
                    ops.append(Demote(v, "host"))
                    continue
            if tiers.disk is not None:
                ops.append(self._to_disk(v, e.ids, rank_bytes))
            else:
                drop.append(v)
        return ([Evict(drop)] if drop else []) + ops

    def _to_disk(self, entry: int, ids, rank_bytes) -> Op:
        """A demotion to disk (a host entry's: ids and rank_bytes None, read from it)."""
        if ids is None:
            he = self.tiers.host.entries[entry]
            ids, rank_bytes = he.ids, he.rank_bytes or [he.kv.nbytes] * self.executor.cp
        if self.tiers.disk is None:
            return Evict([entry])
        self.tiers.disk_bytes[token_digest(ids)] = list(rank_bytes)  # what a promotion of the file will need
        return Demote(entry, "disk")

    def _host_room(self, need: list[int], gone: set[int], arriving: list[int],
                   started: set[int] = frozenset()) -> tuple[list[int], list[int], bool]:
        """(host entries to drop, host entries whose disk write to start, whether `need` then fits on every
        rank beside the entries not `gone` and the bytes `arriving` this step). Least recently used first;
        an entry is dropped only when nothing is lost (its file is on disk, or there is no disk tier); one
        being written stays; one not yet written stays too, its write started (droppable once committed)."""
        host, disk = self.tiers.host, self.tiers.disk
        if any(n > host.budget for n in need):
            return [], [], False  # never fits: no write is started for it
        kept = [e for e in host.entries.values() if e.id not in gone]
        free = [host.budget - sum(e.bytes_on(r) for e in kept) - arriving[r] - need[r] for r in range(len(need))]
        later = list(free)  # the room once the writes in flight and those started here are committed
        drop, writes = [], []
        for e in sorted(kept, key=lambda e: e.last_used):
            if min(free) >= 0:
                break
            if e.written or disk is None:
                drop.append(e.id)
                free = [f + e.bytes_on(r) for r, f in enumerate(free)]
            elif min(later) >= 0:
                continue  # enough is being written already
            elif not e.writing and e.id not in started:
                writes.append(e.id)
            later = [f + e.bytes_on(r) for r, f in enumerate(later)]
        return drop, writes, min(free) >= 0

    def _doc_work(self):
        """The next chunk of the document being prefilled, else the oldest new document's first step
        once its holdings fit (a thunk), or None."""
        p = self._prefilling
        if p is not None:
            return self._next_chunk(p)
        req = next((r for r in self._waiting if self._classify(r)[0] in ("doc", "split")), None)
        if req is None:
            return None
        kind, split, m = self._classify(req)
        if kind == "split":
            return self._split_start(req, *split, m)
        L, chunk = len(req.ids), self.prefill_chunk
        bounds = [(0, L)] if not chunk else self.llm.runner.prefill_bounds(L, req.prompt.context_len, chunk,
                                                                            self.prefill_knee)
        if len(bounds) == 1 and len(self._running) >= self.max_batch:
            return None  # it joins the batch in this very step
        victims = self.cache.plan_room(self.holdings(req.prompt, req.max_tokens, running=self.executor.pool_rows()))
        if victims is None:
            if not self._running and not self.executor.filling:
                raise RuntimeError("the context cache cannot hold a prompt it accepted")  # submit() checks the size
            return None

        def start():
            if self.reuse:
                self.cache.lookup(req.ids)  # counted once per admitted request
            if req.reload_skipped:
                self.reload_policy.skipped += 1
            entry = self.cache.next_id()
            evict = self._make_room(victims)
            if not chunk:
                self._start(req)
                return evict + [Prefill(rid=req.rid, ids=req.prompt.ids, max_tokens=req.max_tokens,
                                        sampling=req.sampling, entry=entry, context_len=req.prompt.context_len,
                                        head_len=req.prompt.head_len, pinned=not self.reuse)]
            self._waiting.remove(req)
            req.bounds, req.step, req.entry = bounds, 0, entry
            self._prefilling = req
            return evict + [self._chunk_op(req)]
        return start

    def _next_chunk(self, req: Request):
        if req.split is not None:
            return self._next_fill(req)
        if req.step == len(req.bounds) - 1:  # the last chunk joins the batch: a slot and the pool's room
            if len(self._running) >= self.max_batch:
                return None
            ex = self.executor
            running = ex.pool_rows()
            need = [0] * ex.cp
            need[ex.query_rank] = ex.pool_bytes(running + [(0, req.max_tokens - 1)]) + ex.pool_bytes(running)
            victims = self.cache.plan_room(need)
            if victims is None:
                return None
            return lambda: self._make_room(victims) + [self._chunk_op(req)]
        return lambda: [self._chunk_op(req)]

    def _chunk_op(self, req: Request) -> PrefillChunk:
        start, end = req.bounds[req.step]
        req.step += 1
        if end == len(req.ids):  # the last chunk: the request joins the batch with its first token
            self._prefilling = None
            req.running = True
            self._running[req.rid] = req
        return PrefillChunk(rid=req.rid, entry=req.entry, start=start, end=end, chunk=self.prefill_chunk,
                            knee=self.prefill_knee,
                            prompt_len=len(req.ids), ids=req.prompt.ids if start == 0 else None,
                            max_tokens=req.max_tokens, sampling=req.sampling, context_len=req.prompt.context_len,
                            head_len=req.prompt.head_len)

    def _start(self, req: Request) -> None:
        self._waiting.remove(req)
        req.running = True
        self._running[req.rid] = req

    def _deliver(self, tokens: dict[int, int], failures: dict | None = None) -> None:
        finished = []
        with self._lock:
            for rid, failure in (failures or {}).items():  # rolled back on every rank: nothing to finish
                if failure.code == RELOAD_FAILED:
                    self._requeue(rid)
                    continue
                if failure.code == TAIL_FAILED:
                    self._compute_rest(rid)
                    continue
                req = self._running.pop(rid, None)
                if req is None and self._prefilling is not None and self._prefilling.rid == rid:
                    req, self._prefilling = self._prefilling, None
                if req is not None:
                    self._fail(req, failure.code, failure.message)
            for rid, tok in tokens.items():
                req = self._running.get(rid)
                if req is None or req.cancelled:  # finished, or cancelled since: nothing more is streamed
                    continue
                first = not req.tokens
                req.tokens.append(tok)
                if first:
                    self.counters["prefill_tokens_total"] += len(req.prompt.ids) - req.cached
                    self.counters["cached_tokens_total"] += req.cached
                else:
                    self.counters["decode_tokens_total"] += 1
                eos = tok in self.llm.eos_ids and not req.sampling.ignore_eos
                text = "" if eos else self._detok(req)
                finish = "stop" if eos else ("length" if len(req.tokens) >= req.max_tokens else None)
                self._emit(req, tok, finish, text=text)
                if finish is not None:
                    finished.append(rid)
            for rid in finished:
                self._running.pop(rid, None)
        if finished:  # leave the batch before the next step (all ranks through the next broadcast)
            self._finish_now(finished)

    def _requeue(self, rid: int) -> None:
        """A request whose entry could not be promoted on every rank waits again in its arrival order; the
        lower tier's copy is gone, so it is prefilled (or finds another entry)."""
        req = self._running.pop(rid, None)
        if req is None:
            return
        self.counters["reload_failures_total"] += 1
        log.warning("request %d: its cached document could not be reloaded on every rank; prefilling it", rid)
        req.running, req.cached, req.kind = False, 0, None
        self._waiting.insert(next((i for i, r in enumerate(self._waiting) if r.arrived > req.arrived),
                                  len(self._waiting)), req)
        self._tier_version += 1

    def _finish_now(self, rids: list[int]) -> None:
        ops = [Finish(rids)]
        self._broadcast(ops)
        self._deliver(*self.executor.run(ops))  # the tokens of a decode issued before (Executor.lookahead)

    def _fail(self, req: Request, code: str, message: str) -> None:
        """End `req` with an error the server maps by its code; the others and the server go on."""
        log.warning("request %d failed (%s): %s", req.rid, code, message)
        self.errors[code] = self.errors.get(code, 0) + 1
        self._emit(req, None, "error", error=message, code=code)

    def _detok(self, req: Request) -> str:
        """The text the newest token adds; held back while it ends inside a multi-byte character.
        Decodes a short window (from the last emitted piece on), not the whole answer each step: the
        difference of two decodes from the same start keeps the tokenizer's spacing right."""
        if self.tokenizer is None:
            return ""
        toks = req.tokens  # called for non-EOS tokens only: EOS ends the request
        before = self.tokenizer.decode(toks[req.text_start:req.text_end], skip_special_tokens=True)
        after = self.tokenizer.decode(toks[req.text_start:], skip_special_tokens=True)
        if after.endswith("\ufffd") and len(toks) < req.max_tokens:
            return ""
        req.text_start, req.text_end = req.text_end, len(toks)
        return after[len(before):]

    def _emit(self, req: Request, tok, finish, *, text: str = "", error: str | None = None,
              code: str | None = None) -> None:
        try:
            req.on_event(TokenEvent(tok, text, finish, len(req.prompt.ids), req.cached, len(req.tokens), error,
                                    code))
        except Exception:  # a callback of a client that went away must not stop the step loop
            log.debug("dropping an event for request %d", req.rid, exc_info=True)
