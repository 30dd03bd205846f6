"""The long-document service's engine: requests in, tokens out, over the whole parallel group.

Rank 0 runs the scheduler (`Service`): a bounded queue, admission within the context cache's
budget, and one step at a time. Each step is a list of operations that every rank executes
(`Executor`), broadcast from rank 0 over a CPU control group, so the ranks' KV shards, cache entries
and batch stay identical in shape:

    prefill  a prompt with no usable cache entry runs through the runner (any context strategy);
             its KV becomes a cache entry, and the request decodes on it
    extend   a prompt that begins with an entry's tokens runs only the rest, attending the entry's
             first m tokens (runtime/cascade.py): the prefill is skipped
    decode   one token for every running request, in one forward: each entry's context is read once
             for all requests on it, each request's own tokens beside it, merged by log-sum-exp
    finish   requests leave the batch; entries they held become evictable
    evict    entries removed, least recently used first, to make room inside the budget

The HTTP front end (starshard/server) talks to `Service` only: submit(), cancel through the ticket,
health(), stats(). Token events are delivered from the engine thread through the request's callback.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from starshard.config import ModelConfig, SamplingConfig
from starshard.engine.sampling import sample
from starshard.kernels.common import DECODE_MAX_ROWS
from starshard.runtime.cascade import CascadeAttention, CascadeGraph, OwnKV, SharedGroup, run_cascade
from starshard.runtime.context_cache import CacheEntry, ContextCache, kv_bytes
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.runtime.prompt import Prompt, build_chat_prompt, build_prompt, check_window

log = logging.getLogger("starshard.serve")

IDLE_TICK_S = 1.0  # rank 0 sends an empty step this often while idle, so the other ranks never time out


class QueueFull(Exception):
    """The waiting queue is full: the server answers 429."""


class EngineUnavailable(Exception):
    """The engine is down (a rank died or hung, or it is shutting down): the server answers 503."""


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class TokenEvent:
    token_id: int | None  # None on a final event that carries no token
    text: str  # the text this token adds (incremental detokenization; may be "")
    finish_reason: str | None  # None while running; "stop", "length", "cancelled", "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the context cache
    completion_tokens: int
    error: str | None = None


# ---------------------------------------------------------------------------- every rank: execution
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


class Executor:
    """Runs the scheduler's operations on this rank. The same instance state on every rank: the
    scheduler's decisions (rank 0) arrive as plain lists of dicts."""

    def __init__(self, runner, cache: ContextCache, cuda_graphs: bool = True):
        self.runner = runner
        self.model = runner.model
        self.cache = cache
        strategy = getattr(runner, "strategy", None)
        self.group = strategy.group if strategy is not None and strategy.cp > 1 else None
        self.cp = 1 if self.group is None else strategy.cp
        self.query_rank = 0 if self.group is None else strategy.query_rank
        self.is_query_rank = self.group is None or strategy.is_query_rank
        # Last-row logits -> token: plain sampling, or vocab-parallel over the TP group (every TP rank
        # gets the same token).
        self.sampler = runner.sample if isinstance(runner, ContextParallelRunner) else getattr(runner, "sampler", sample)
        self.rows: list[Row] = []
        self.pool: OwnKV | None = None  # the batch's own KV, rebuilt when rows join or leave
        attn = self.model.layers[0].attention
        self.kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self.dtype, self.device = attn.wo.weight.dtype, attn.wo.weight.device
        runner.cuda_graphs = False  # the runner's own graphs serve one request; the batch has its own (below)
        # Length-dependent RoPE (dynamic NTK, longrope) at the window's length for every request: cached
        # entries and batched rows then share one rotation.
        self.model.set_rope_length(None)
        # A decode step replays a CUDA graph once the batch has kept its rows for one step (a join or a
        # leave changes the graph's shapes); every rank decides alike from the same operations.
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._graph: CascadeGraph | None = None
        self._steady = 0  # decode steps since the rows last changed

    # -- sizes the scheduler plans with
    def token_bytes(self) -> int:
        """KV bytes of one token on one rank (k and v of every layer held, plus its position)."""
        el = torch.empty((), dtype=self.dtype).element_size()
        return len(self.model.layers) * (2 * self.kv_heads * self.head_dim * el + 8)

    def entry_bytes(self, n_tokens: int) -> int:
        """What a prefilled entry of n tokens allocates on a rank (the runner's cache sizing)."""
        cap = n_tokens if self.cp == 1 else -(-n_tokens // self.cp) + 256
        return cap * self.token_bytes()

    # -- operations
    def run(self, ops: list[dict]) -> dict[int, int]:
        """Apply `ops` in order -> {request id: sampled token} (the same on every rank). A step
        admits a request or decodes, never both, so each request gets at most one token a step."""
        tokens: dict[int, int] = {}
        with torch.inference_mode():
            for op in ops:
                kind = op["op"]
                if kind == "evict":
                    self.cache.evict(op["entries"])
                elif kind == "finish":
                    self._finish(op["rids"])
                elif kind == "prefill":
                    tokens[op["rid"]] = self._prefill(op)
                elif kind == "extend":
                    tokens[op["rid"]] = self._extend(op)
                elif kind == "decode":
                    tokens.update(self._decode())
                else:
                    raise ValueError(f"unknown service operation {kind!r}")
        return tokens

    def _gen(self, seed):
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> list[int]:
        """One token per row from last-row logits [B, V]: sampled on the query rank, then the same
        tokens on every rank of the CP group."""
        toks = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        if self.is_query_rank:
            for b, r in enumerate(rows):
                toks[b] = self.sampler(logits[b : b + 1], r.sampling, r.gen)[0]
        if self.group is not None:
            dist.broadcast(toks, src=dist.get_global_rank(self.group, self.query_rank), group=self.group)
        return toks.tolist()

    def _join(self, row: Row) -> None:
        self.rows.append(row)
        self._rebuild_pool()
        self._graph, self._steady = None, 0

    def _rebuild_pool(self) -> None:
        if not self.is_query_rank:
            return
        parts = [(r.pool, r.pool_row) for r in self.rows]
        extra = max([r.remaining for r in self.rows] + [1])
        self.pool = OwnKV.gather(parts, extra, self.model.layer_ids, self.kv_heads, self.head_dim, self.dtype,
                                 self.device)
        for b, r in enumerate(self.rows):
            r.pool, r.pool_row = self.pool, b

    def _new_row(self, op, entry: CacheEntry, prefix: int, pool: OwnKV | None, first: int, gen) -> Row:
        return Row(op["rid"], entry, prefix, len(op["ids"]), first, op["max_tokens"] - 1,
                   SamplingConfig(*op["sampling"]), gen, pool, 0)

    def _prefill(self, op) -> int:
        ids = op["ids"]
        prompt = Prompt(list(ids), op["context_len"], op["head_len"])
        kv = self.runner.new_cache(len(ids))
        gen = self._gen(op["sampling"][3])
        tok = int(self.runner.prefill(prompt, kv, SamplingConfig(*op["sampling"]), gen))
        self.runner.end_generation()
        entry = CacheEntry(op["entry"], np.asarray(ids, dtype=np.int64), kv, kv_bytes(kv), pinned=op["pinned"])
        self.cache.add(entry)
        self.cache.acquire(entry)
        pool = self._empty_pool() if self.is_query_rank else None
        self._join(self._new_row(op, entry, len(ids), pool, tok, gen))
        return tok

    def _empty_pool(self) -> OwnKV:
        return OwnKV(self.model.layer_ids, 1, self.kv_heads, self.head_dim, 1, self.dtype, self.device)

    def _extend(self, op) -> int:
        ids, m = op["ids"], op["prefix"]
        entry = self.cache.entries[op["entry"]]
        self.cache.acquire(entry)
        entry.hits += 1
        suffix = torch.tensor([ids[m:]], device=self.device)
        pos = torch.arange(m, len(ids), device=self.device)[None]
        pool = None
        if self.is_query_rank:
            pool = OwnKV(self.model.layer_ids, 1, self.kv_heads, self.head_dim, len(ids) - m, self.dtype, self.device)
        cascade = CascadeAttention([SharedGroup(entry.kv, [0], [m], len(entry))], pool, self.group, self.device)
        logits = run_cascade(self.model, suffix, pos, cascade)
        row = self._new_row(op, entry, m, pool, 0, self._gen(op["sampling"][3]))
        row.last_token = self._sample(logits, [row])[0]
        self._join(row)
        return row.last_token

    def _decode(self) -> dict[int, int]:
        rows = self.rows
        by_entry: dict[int, SharedGroup] = {}
        for b, r in enumerate(rows):
            g = by_entry.setdefault(r.entry.id, SharedGroup(r.entry.kv, [], [], len(r.entry)))
            g.rows.append(b)
            g.prefix.append(r.prefix)
        toks = torch.tensor([[r.last_token] for r in rows], device=self.device)
        pos = torch.tensor([[r.next_pos] for r in rows], device=self.device)
        if self._graph is not None:
            logits = self._graph.step(toks, pos)
        else:
            cascade = CascadeAttention(list(by_entry.values()), self.pool, self.group, self.device)
            if self.cuda_graphs and self._steady >= 1 and len(rows) <= DECODE_MAX_ROWS:
                self._graph = CascadeGraph(self.model, cascade, len(rows), self.device)
                logits = self._graph.step(toks, pos)
            else:
                logits = run_cascade(self.model, toks, pos, cascade)
        self._steady += 1
        out = {}
        for r, t in zip(rows, self._sample(logits, rows)):
            r.last_token, r.next_pos, r.remaining = t, r.next_pos + 1, r.remaining - 1
            out[r.rid] = t
        return out

    def _finish(self, rids: list[int]) -> None:
        gone = set(rids)
        for r in self.rows:
            if r.rid in gone:
                self.cache.release(r.entry)
        self.rows = [r for r in self.rows if r.rid not in gone]
        self._graph, self._steady = None, 0
        if self.rows:
            self._rebuild_pool()
        else:
            self.pool = None

    def own_bytes(self) -> int:
        return self.pool.nbytes() if self.pool is not None else 0


# ---------------------------------------------------------------------------- rank 0: scheduling
@dataclass
class Request:
    rid: int
    prompt: Prompt
    max_tokens: int
    sampling: SamplingParams
    on_event: Callable[[TokenEvent], None]
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    cached: int = 0
    cancelled: bool = False
    running: bool = False


class Ticket:
    def __init__(self, service: "Service", rid: int):
        self._service, self.rid = service, rid

    def cancel(self) -> None:
        self._service._cancel(self.rid)


def control_group():
    """A CPU (gloo) group over every rank for the step broadcasts; None in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD


class Service:
    """The engine behind the HTTP server (rank 0), and the step loop every rank runs.

    llm: a starshard.LLM (any runner but tensor / pipeline parallel, see below).
    cache_bytes: the context cache's budget per rank; max_batch: requests decoding together;
    max_queue: requests waiting beyond the batch before submit() answers QueueFull.
    """

    def __init__(self, llm, *, cache_bytes: int, max_batch: int = 16, max_queue: int = 64,
                 max_extend: int = 4096, model_name: str = "starshard", cuda_graphs: bool = True):
        runner = llm.runner
        if getattr(runner, "link", None) is not None:
            raise ValueError("the service does not run pipeline stages yet (--pp > 1): serve with --pp 1 and spread the "
                             "model with --tp and the document with --cp")
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} / {max_queue}")
        self.llm, self.config = llm, llm.config
        self.tokenizer = llm.tokenizer
        self.model_name = model_name
        self.max_model_len = self.config.max_position_embeddings
        self.max_batch, self.max_queue, self.max_extend = max_batch, max_queue, max_extend
        self.cache = ContextCache(cache_bytes)
        self.executor = Executor(runner, self.cache, cuda_graphs)
        strategy = getattr(runner, "strategy", None)
        self.reuse = strategy is None or strategy.name != "apb"  # APB's KV depends on the question
        self.control = control_group()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._lock = threading.Condition()
        self._waiting: list[Request] = []
        self._running: dict[int, Request] = {}
        self._rids = itertools.count(1)
        self._error: str | None = None
        self._stop = False
        self.counters = dict(prefill_tokens_total=0, decode_tokens_total=0, cached_tokens_total=0, requests_total=0)
        self._thread: threading.Thread | None = None

    # -- front end (rank 0)
    def chat_prompt(self, messages: list[dict]) -> Prompt:
        return build_chat_prompt(self.tokenizer, messages)

    def text_prompt(self, prompt: str | list[int]) -> Prompt:
        return build_prompt(self.tokenizer, prompt=prompt, raw=True)

    def submit(self, prompt: Prompt, *, max_tokens: int, sampling: SamplingParams, stop=None,
               on_event: Callable[[TokenEvent], None]) -> Ticket:
        check_window(self.config, len(prompt.ids), max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        SamplingConfig(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed)  # validates
        need = self.executor.entry_bytes(len(prompt.ids)) + self._own_bytes(len(prompt.ids) + max_tokens)
        if need > self.cache.budget:
            raise ValueError(
                f"this prompt's KV needs {need / 2**30:.3f} GiB per rank but the context cache budget is "
                f"{self.cache.budget / 2**30:.3f} GiB: shorten the prompt or start the server with a larger --cache-gib")
        with self._lock:
            if self._error is not None or self._stop:
                raise EngineUnavailable(self._error or "the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (--max-queue {self.max_queue}); "
                                "retry later")
            req = Request(next(self._rids), prompt, max_tokens, sampling, on_event)
            self._waiting.append(req)
            self.counters["requests_total"] += 1
            self._lock.notify()
        return Ticket(self, req.rid)

    def health(self) -> str | None:
        return self._error

    def stats(self) -> dict:
        with self._lock:
            return dict(queue_depth=len(self._waiting), running=len(self._running),
                        cache_bytes=self.cache.used_bytes, cache_budget_bytes=self.cache.budget,
                        cache_entries=len(self.cache.entries), cache_hits=self.cache.hits,
                        cache_lookups=self.cache.lookups, **self.counters)

    def _cancel(self, rid: int) -> None:
        with self._lock:
            for r in self._waiting:
                if r.rid == rid:
                    self._waiting.remove(r)
                    self._emit(r, None, "cancelled")
                    return
            if rid in self._running:
                self._running[rid].cancelled = True
                self._lock.notify()

    # -- the loop
    def start(self) -> None:
        """Rank 0: the engine thread. Other ranks: call serve_forever() instead."""
        self._thread = threading.Thread(target=self._loop, name="starshard-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def serve_forever(self) -> None:
        """Every rank but 0: execute the broadcast steps until rank 0 says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            ops = box[0]
            if ops is None:
                return
            self.executor.run(ops)

    def _loop(self) -> None:
        try:
            while True:
                ops = self._plan()
                if ops is None:  # shutting down
                    self._broadcast(None)
                    return
                self._broadcast(ops)
                tokens = self.executor.run(ops) if ops else {}
                self._deliver(tokens)
        except Exception as e:  # a dead or hung rank, or a bug: fail what is in flight, refuse the rest
            log.error("engine stopped: %s", e)
            with self._lock:
                self._error = f"the engine stopped: {type(e).__name__}: {e}"
                for r in list(self._running.values()) + self._waiting:
                    self._emit(r, None, "error", error=self._error)
                self._running.clear()
                self._waiting.clear()

    def _broadcast(self, ops) -> None:
        if self.control is not None:
            dist.broadcast_object_list([ops], src=0, group=self.control)

    def _own_bytes(self, tokens: int) -> int:
        return tokens * self.executor.token_bytes()

    def _plan(self) -> list[dict] | None:
        """The next step's operations (None: shut down)."""
        with self._lock:
            while not self._stop and not self._waiting and not self._running:
                if not self._lock.wait(IDLE_TICK_S) and self.control is not None:
                    return []  # keep the other ranks' broadcast from timing out
            if self._stop:
                return None
            ops: list[dict] = []
            cancelled = [r.rid for r in self._running.values() if r.cancelled]
            if cancelled:
                ops.append({"op": "finish", "rids": cancelled})
                for rid in cancelled:
                    self._emit(self._running.pop(rid), None, "cancelled")
            if self._waiting and len(self._running) < self.max_batch:
                op = self._admit(self._waiting[0])
                if op is not None:
                    req = self._waiting.pop(0)
                    ops.extend(op)
                    req.running = True
                    self._running[req.rid] = req
                    return ops  # the newcomer's first token; decoding resumes next step
            if self._running:
                ops.append({"op": "decode"})
            return ops

    def _admit(self, req: Request) -> list[dict] | None:
        """The operations that start `req`, or None while the cache has no room for it yet."""
        ids = np.asarray(req.prompt.ids, dtype=np.int64)
        own_running = self.executor.own_bytes()
        entry, m = self.cache.lookup(ids) if self.reuse else (None, 0)
        base = {"rid": req.rid, "ids": req.prompt.ids, "max_tokens": req.max_tokens,
                "sampling": (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.sampling.seed)}
        rest = len(ids) - m
        # Run only the rest when the cache holds most of the prompt and the rest is short. A prompt that
        # shares just a chat template's header with an entry is a new document: prefill it, cache it.
        if entry is not None and rest <= self.max_extend and rest <= m:
            own = self._own_bytes(len(ids) - m + req.max_tokens)
            victims = self._room_sparing(own, own_running, keep=entry.id)
            if victims is None:
                return None
            req.cached = m
            return ([{"op": "evict", "entries": victims}] if victims else []) + [{"op": "extend", "entry": entry.id,
                                                                                  "prefix": m, **base}]
        need = self.executor.entry_bytes(len(ids))
        victims = self.cache.plan_room(need + self._own_bytes(req.max_tokens), own_running)
        if victims is None:
            if not self._running:
                raise RuntimeError("the context cache cannot hold a prompt it accepted")  # submit() checks the size
            return None
        return ([{"op": "evict", "entries": victims}] if victims else []) + [
            {"op": "prefill", "entry": self.cache.next_id(), "context_len": req.prompt.context_len,
             "head_len": req.prompt.head_len, "pinned": not self.reuse, **base}]

    def _room_sparing(self, nbytes: int, other: int, keep: int) -> list[int] | None:
        victims = self.cache.plan_room(nbytes, other)
        if victims is not None and keep in victims:  # never evict the entry being reused
            entry = self.cache.entries[keep]
            self.cache.acquire(entry)
            try:
                victims = self.cache.plan_room(nbytes, other)
            finally:
                self.cache.release(entry)
        return victims

    def _deliver(self, tokens: dict[int, int]) -> None:
        finished = []
        with self._lock:
            for rid, tok in tokens.items():
                req = self._running.get(rid)
                if req is None:
                    continue
                first = not req.tokens
                req.tokens.append(tok)
                if first:
                    self.counters["prefill_tokens_total"] += len(req.prompt.ids) - req.cached
                    self.counters["cached_tokens_total"] += req.cached
                else:
                    self.counters["decode_tokens_total"] += 1
                eos = tok in self.llm.eos_ids
                text = "" if eos else self._detok(req)
                finish = "stop" if eos else ("length" if len(req.tokens) >= req.max_tokens else None)
                self._emit(req, tok, finish, text=text)
                if finish is not None:
                    finished.append(rid)
            for rid in finished:
                self._running.pop(rid, None)
        if finished:  # leave the batch before the next step (all ranks through the next broadcast)
            self._finish_now(finished)

    def _finish_now(self, rids: list[int]) -> None:
        ops = [{"op": "finish", "rids": rids}]
        self._broadcast(ops)
        self.executor.run(ops)

    def _detok(self, req: Request) -> str:
        """The text the newest token adds; held back while it ends inside a multi-byte character."""
        if self.tokenizer is None:
            return ""
        kept = [t for t in req.tokens if t not in self.llm.eos_ids]
        full = self.tokenizer.decode(kept, skip_special_tokens=True)
        if full.endswith("\ufffd") and len(req.tokens) < req.max_tokens:
            return ""
        new = full[len(req.text):] if full.startswith(req.text) else full
        req.text = full
        return new

    def _emit(self, req: Request, tok, finish, *, text: str = "", error: str | None = None) -> None:
        try:
            req.on_event(TokenEvent(tok, text, finish, len(req.prompt.ids), req.cached, len(req.tokens), error))
        except Exception:  # a callback of a client that went away must not stop the engine
            log.debug("dropping an event for request %d", req.rid, exc_info=True)
