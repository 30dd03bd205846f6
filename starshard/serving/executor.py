"""What every rank of the service runs: the scheduler's operations (serving/ops.py: prefill,
extend, decode, finish, evict; serving/scheduler.py decides them on rank 0) applied to this rank's
model, KV shards, cache entries and batch. Every rank holds the same entries and rows, each with its
own shard."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from starshard.config import SamplingConfig
from starshard.engine.sampling import sample
from starshard.kernels.common import DECODE_MAX_ROWS
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.runtime.prompt import Prompt
from starshard.serving.cascade import CascadeAttention, CascadeGraph, OwnKV, SharedGroup, run_cascade
from starshard.serving.context_cache import CacheEntry, ContextCache, kv_bytes
from starshard.serving.ops import Decode, Evict, Extend, Finish, Op, Prefill


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
    scheduler's decisions (rank 0) arrive as lists of operations (serving/ops.py)."""

    def __init__(self, runner, cache: ContextCache, cuda_graphs: bool = True):
        self.runner = runner
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
        self.pool: OwnKV | None = None  # the batch's own KV, rebuilt when rows join or leave
        attn = self.model.layers[0].attention
        self.kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        norm = self.model.layers[0].attention_norm.weight  # the compute dtype (projections may hold FP8)
        self.dtype, self.device = norm.dtype, norm.device
        self.kv_fp8 = runner.kv_fp8
        # Length-dependent RoPE (dynamic NTK, longrope) at the window's length for every request: cached
        # entries and batched rows then share one rotation.
        self.model.set_rope_length(None)
        # A decode step replays a CUDA graph once the batch has kept its rows for one step (a join or a
        # leave changes the graph's shapes); every rank decides alike from the same operations.
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._graph: CascadeGraph | None = None
        self._steady = 0  # decode steps since the rows last changed

    # -- sizes the scheduler plans with (pure arithmetic: rank 0 plans every rank's bytes)
    def token_bytes(self) -> int:
        """KV bytes of one token in a cache entry on one rank (k and v of every layer held, plus its position)."""
        if self.kv_fp8:  # e4m3 k and v plus one float32 scale each per head (engine/kv_cache.py)
            return len(self.model.layers) * (2 * self.kv_heads * (self.head_dim + 4) + 8)
        return self.own_token_bytes()

    def own_token_bytes(self) -> int:
        """KV bytes of one token in the own-KV pool: always the compute dtype (cascade.OwnKV)."""
        return len(self.model.layers) * (2 * self.kv_heads * self.head_dim * self.dtype.itemsize + 8)

    def entry_rank_bytes(self, prompt_len: int, context_len: int) -> list[int]:
        """What a prefilled entry of this prompt allocates on each CP rank: exactly its shard
        (StrategySpec.rank_rows; the runner allocates the same rows)."""
        rows = [prompt_len] if self.strategy is None else self.strategy.rank_rows(prompt_len, context_len)
        return [max(1, n) * self.token_bytes() for n in rows]

    def entry_bytes(self, n_tokens: int) -> int:
        """The largest shard of a prefilled entry of n tokens that are all context."""
        return max(self.entry_rank_bytes(n_tokens, n_tokens))

    def pool_rows(self) -> list[tuple[int, int]]:
        """(own tokens held, tokens it may still generate) of each running row: the pool's shape."""
        return [(r.next_pos - r.prefix, r.remaining) for r in self.rows]

    def pool_bytes(self, rows: list[tuple[int, int]]) -> int:
        """The own-KV pool the query rank holds for rows of (own tokens, remaining), padded as
        OwnKV.gather pads: every row gets room for the longest own part plus the most remaining."""
        if not rows:
            return 0
        cap = max(max(own for own, _ in rows) + max([left for _, left in rows] + [1]), 1)
        return len(rows) * cap * self.own_token_bytes()

    # -- operations
    def run(self, ops: list[Op]) -> dict[int, int]:
        """Apply `ops` in order -> {request id: sampled token} (the same on every rank). A step
        admits a request or decodes, never both, so each request gets at most one token a step."""
        tokens: dict[int, int] = {}
        with torch.inference_mode():
            for op in ops:
                match op:
                    case Evict():
                        self.cache.evict(op.entries)
                    case Finish():
                        self._finish(op.rids)
                    case Prefill():
                        tokens[op.rid] = self._prefill(op)
                    case Extend():
                        tokens[op.rid] = self._extend(op)
                    case Decode():
                        tokens.update(self._decode())
                    case _:
                        raise TypeError(f"unknown service operation {op!r}: expected one of serving/ops.py's")
        return tokens

    def _gen(self, seed):
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def _sample(self, logits: torch.Tensor, draws: list[tuple[SamplingConfig, torch.Generator | None]]) -> list[int]:
        """One token per row from last-row logits [B, V] and each row's (sampling, generator): sampled
        on the query rank, then the same tokens on every rank of the CP group."""
        toks = torch.zeros(len(draws), dtype=torch.long, device=logits.device)
        if self.is_query_rank:
            for b, (sampling, gen) in enumerate(draws):
                toks[b] = self.sampler(logits[b : b + 1], sampling, gen)[0]
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

    def _new_row(self, op: Prefill | Extend, entry: CacheEntry, prefix: int, pool: OwnKV | None, first: int,
                 gen) -> Row:
        return Row(op.rid, entry, prefix, len(op.ids), first, op.max_tokens - 1, op.sampling, gen, pool, 0)

    def _prefill(self, op: Prefill) -> int:
        ids = op.ids
        prompt = Prompt(list(ids), op.context_len, op.head_len)
        kv = self.runner.new_cache(len(ids), len(ids), op.context_len)  # exactly this rank's shard
        gen = self._gen(op.sampling.seed)
        tok = int(self.runner.prefill(prompt, kv, op.sampling, gen))
        self.runner.end_generation()
        rank_bytes = self.entry_rank_bytes(len(ids), op.context_len)
        if kv_bytes(kv) > rank_bytes[self.cp_rank]:  # the scheduler admitted by rank_bytes: it must not drift
            raise RuntimeError(f"CP rank {self.cp_rank}'s entry holds {kv_bytes(kv)} bytes, more than the "
                               f"{rank_bytes[self.cp_rank]} the scheduler counts (StrategySpec.rank_rows)")
        entry = CacheEntry(op.entry, np.asarray(ids, dtype=np.int64), kv, max(rank_bytes), pinned=op.pinned,
                           rank_bytes=rank_bytes)
        self.cache.add(entry)
        self.cache.acquire(entry)
        pool = self._empty_pool() if self.is_query_rank else None
        self._join(self._new_row(op, entry, len(ids), pool, tok, gen))
        return tok

    def _empty_pool(self) -> OwnKV:
        return OwnKV(self.model.layer_ids, 1, self.kv_heads, self.head_dim, 1, self.dtype, self.device)

    def _extend(self, op: Extend) -> int:
        ids, m = op.ids, op.prefix
        entry = self.cache.entries[op.entry]
        self.cache.acquire(entry)
        entry.hits += 1
        suffix = torch.tensor([ids[m:]], device=self.device)
        pos = torch.arange(m, len(ids), device=self.device)[None]
        pool = None
        if self.is_query_rank:
            pool = OwnKV(self.model.layer_ids, 1, self.kv_heads, self.head_dim, len(ids) - m, self.dtype, self.device)
        cascade = CascadeAttention([SharedGroup(entry.kv, [0], [m], len(entry))], pool, self.group, self.device)
        logits = run_cascade(self.model, suffix, pos, cascade)
        gen = self._gen(op.sampling.seed)
        tok = self._sample(logits, [(op.sampling, gen)])[0]
        self._join(self._new_row(op, entry, m, pool, tok, gen))
        return tok

    def _batch_cascade(self) -> CascadeAttention:
        """The batch's attention: one shared group per cache entry its rows use, and the own-KV pool."""
        by_entry: dict[int, SharedGroup] = {}
        for b, r in enumerate(self.rows):
            g = by_entry.setdefault(r.entry.id, SharedGroup(r.entry.kv, [], [], len(r.entry)))
            g.rows.append(b)
            g.prefix.append(r.prefix)
        return CascadeAttention(list(by_entry.values()), self.pool, self.group, self.device)

    def _decode(self) -> dict[int, int]:
        rows = self.rows
        toks = torch.tensor([[r.last_token] for r in rows], device=self.device)
        pos = torch.tensor([[r.next_pos] for r in rows], device=self.device)
        if self._graph is None and self.cuda_graphs and self._steady >= 1 and len(rows) <= DECODE_MAX_ROWS:
            self._graph = CascadeGraph(self.model, self._batch_cascade(), len(rows), self.device)
        if self._graph is not None:  # the rows kept since the capture: replay
            logits = self._graph.step(toks, pos)
        else:
            logits = run_cascade(self.model, toks, pos, self._batch_cascade())
        self._steady += 1
        out = {}
        for r, t in zip(rows, self._sample(logits, [(r.sampling, r.gen) for r in rows])):
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
