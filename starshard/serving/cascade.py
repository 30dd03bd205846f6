"""Shared-prefix ("cascade") attention for the service's batch: every request attends a cached
context (a shared prefix, sharded over the CP group) plus its own tokens, and the two partials merge
by log-sum-exp (the same merge the CP group uses for its shards).

    shared: the rows of all requests on one cache entry form one query block against the entry's
            KV, so the long context is read once per step for the whole batch; a request that
            shares only the first m tokens masks the rest by position (key visible iff pos < m).
    own:    each request's tokens after the shared prefix (its question, then what it generated),
            held in one batched pool [B, Hkv, cap, D] on the CP group's query rank.

Exact: attention over the union of the two key sets equals attention over the whole sequence.
A layer's window, logit soft-cap and scale (engine/model.py Attention.extras) apply in both parts: a
local layer's row sees the keys at positions (p - window, p] of its own position p, in the entry (those
before its prefix) and in its pool alike.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from starshard.engine.kv_cache import KVCache
from starshard.kernels.attention import attention
from starshard.kernels.common import DECODE_MAX_ROWS, to_device
from starshard.kernels.decode import decode_attention, table_row
from starshard.parallel.context.group_merge import merge_over_group
from starshard.parallel.context.merge import merge_partials

_NO_KEY = 2**62  # position of an empty pool slot: after every query, so causality hides it


class OwnKV:
    """The batch's own-token KV: per layer k, v [B, Hkv, cap, D] and positions [B, cap]; row b's
    first lengths[b] slots are filled. Kept in the compute dtype also with an FP8 KV cache: it holds a
    question and the generated tokens, a few hundred entries per request. The layers' tensors are views of
    one [layers, B, ...] tensor per kind, so moving rows between pools (a request joins or leaves the
    batch) is a few copies per row, not per layer and row: ~1,500 per change at 32 layers x 16 rows were
    the host's time with the device idle."""

    def __init__(self, layer_ids, batch: int, n_kv_heads: int, head_dim: int, capacity: int, dtype, device,
                 within: "OwnKV | None" = None):
        """`within`: a pool of this capacity and at least `batch` rows whose first rows this one's tensors view
        (the table graphs of one capacity share one store: one batch runs at a time)."""
        self.layer_ids = list(layer_ids)
        if within is not None:
            if within.capacity != capacity or within.batch < batch or within.layer_ids != self.layer_ids:
                raise ValueError(f"a pool of {batch} x {capacity} cannot view one of {within.batch} x "
                                 f"{within.capacity}")
            self.all_k, self.all_v = within.all_k[:, :batch], within.all_v[:, :batch]
            self.all_pos = within.all_pos[:, :batch]
        else:
            n = len(self.layer_ids)
            self.all_k = torch.zeros(n, batch, n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
            self.all_v = torch.zeros_like(self.all_k)
            self.all_pos = torch.full((n, batch, capacity), _NO_KEY, dtype=torch.long, device=device)
        self.k = {i: self.all_k[j] for j, i in enumerate(self.layer_ids)}
        self.v = {i: self.all_v[j] for j, i in enumerate(self.layer_ids)}
        self.pos = {i: self.all_pos[j] for j, i in enumerate(self.layer_ids)}
        self.lengths = [0] * batch
        self._lengths = torch.zeros(batch, dtype=torch.long, device=device)  # the same, read by captured steps
        self._rows = torch.arange(batch, device=device)
        self.capacity = capacity

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.all_k, self.all_v, self.all_pos))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v [B, Hkv, L, D], pos [B, L]: row b's L new entries go after its filled slots."""
        L = k.shape[2]
        slots = self._lengths[:, None] + torch.arange(L, device=k.device)  # [B, L], on the device: no sync
        rows = self._rows[:, None].expand_as(slots)
        self.k[layer][rows, :, slots] = k.transpose(1, 2)
        self.v[layer][rows, :, slots] = v.transpose(1, 2)
        self.pos[layer][rows, slots] = pos

    def advance(self, n: int) -> None:
        """After every layer appended: each row holds n more entries."""
        self.lengths = [x + n for x in self.lengths]
        self._lengths += n

    @staticmethod
    def gather(parts: list[tuple["OwnKV", int]], extra: int, layer_ids, n_kv_heads, head_dim, dtype, device) -> "OwnKV":
        """A new pool holding row r of pool p for each (p, r) in `parts`, with room for `extra` more
        entries per row (requests join and leave the batch between steps). One copy per kind and row, all
        layers at once, straight into place: no temporary as large as the pool."""
        lengths = [p.lengths[r] for p, r in parts]
        out = OwnKV(layer_ids, len(parts), n_kv_heads, head_dim, max(max(lengths + [0]) + extra, 1), dtype, device)
        for b, ((p, r), n) in enumerate(zip(parts, lengths)):
            if p.layer_ids != out.layer_ids:
                raise ValueError(f"a pool of layers {p.layer_ids} gathered into one of {out.layer_ids}")
            if n:
                out.all_k[:, b, :, :n] = p.all_k[:, r, :, :n]
                out.all_v[:, b, :, :n] = p.all_v[:, r, :, :n]
                out.all_pos[:, b, :n] = p.all_pos[:, r, :n]
        out.lengths = lengths
        out._lengths.copy_(to_device(lengths, device))
        return out


def _with_own(layer: int, q, k, v, pos, out, lse, own: OwnKV | None, group, **extras) -> torch.Tensor:
    """A step's attention once the shared partial (out, lse) is in: the rows' new k, v appended to their own pool
    and attended there (the query rank), merged by lse, then over the CP group -> out."""
    if own is not None:
        own.append(layer, k, v, pos)
        o, s = attention(q, own.k[layer], own.v[layer], q_pos=pos, k_pos=own.pos[layer], causal=True, **extras)
        out, lse = merge_partials(out, lse, o, s)
    if group is not None:
        out, lse = merge_over_group(out, lse, group)
    return out


@dataclass
class SharedGroup:
    """Rows of the batch that attend one cache entry: `kv` its KV (this rank's shard), `prefix[j]`
    the number of leading tokens row rows[j] shares, `full` the entry's length."""

    kv: KVCache
    rows: list[int]
    prefix: list[int]
    full: int


class CascadeAttention:
    """The attention hook of every layer for one service step (installed per step by the
    scheduler): shared partials per cache entry, the own partial on the query rank, merged by lse,
    then over the CP group."""

    def __init__(self, groups: list[SharedGroup], own: OwnKV | None, group=None, device=None):
        self.groups, self.own, self.group = groups, own, group
        # Row indices and query positions per group, made once on the device: a captured step
        # replays them, and attend() copies nothing from the host.
        up = functools.partial(to_device, device=device or "cpu")  # non-blocking: no step waits on these copies
        self._rows = [up(g.rows) for g in groups]
        self._last = [up(g.prefix) - 1 for g in groups]  # keys at positions < prefix
        # A local layer's window starts at each query's own position, which the one shared call per entry
        # (every row at position prefix - 1) cannot say: there the rows of one prefix attend together at
        # their own positions, the entry's keys past that prefix moved out of reach (position _NO_KEY).
        self._windowed = []
        for g in groups:
            parts = {}
            for r, m in zip(g.rows, g.prefix):
                parts.setdefault(m, []).append(r)
            self._windowed.append([(up(rows), None if m >= g.full else up(m)) for m, rows in parts.items()])

    def hook(self, layer: int):
        return functools.partial(self.attend, layer)

    def attend(self, layer: int, q, k, v, pos, cache=None, sparse=None, *, window=None, softcap=None, scale=None,
               **other):  # the service's steps run dense: sparse unused
        if other:  # e.g. attention sinks: the lse merges here would count one per partial
            raise ValueError(f"the service's cascade attention does not run {', '.join(sorted(other))} yet: run this "
                             "model with `starshard infer` or LLM.generate")
        extras = dict(softcap=softcap, scale=scale)
        B, Hq, L, D = q.shape
        out = q.new_zeros(B, Hq, L, D)
        lse = torch.full((B, Hq, L), float("-inf"), dtype=torch.float32, device=q.device)
        for g, rows, last, parts in zip(self.groups, self._rows, self._last, self._windowed):
            kv = g.kv.layer(layer)
            if kv.length == 0:  # this rank holds none of the entry (a short prompt on a CP group)
                continue
            s = kv.stored()  # an FP8 entry stays e4m3 (dequantized by attention where its kernel cannot read it)
            if window is None:
                # Decode-sized blocks are always masked by position (a no-op where every row shares the whole
                # entry): one split-KV kernel variant serves every batch, so a new batch compiles nothing.
                causal = len(g.rows) * L <= DECODE_MAX_ROWS or any(p < g.full for p in g.prefix)
                blocks = [(rows, last[:, None].expand(len(g.rows), L), s.pos, causal)]
            else:
                blocks = [(r, pos[r], s.pos if m is None else torch.where(s.pos < m, s.pos, _NO_KEY), True)
                          for r, m in parts]
            for r, qpos, k_pos, causal in blocks:
                n = len(r)
                qg = q[r].transpose(0, 1).reshape(1, Hq, n * L, D)  # rows as one query block
                o, ls = attention(qg, s.k, s.v, q_pos=qpos.reshape(1, -1), k_pos=k_pos, causal=causal,
                                  k_scale=s.k_scale, v_scale=s.v_scale, window=window, **extras)
                out[r] = o.reshape(Hq, n, L, D).transpose(0, 1).to(out.dtype)
                lse[r] = ls.reshape(Hq, n, L).transpose(0, 1)
        return _with_own(layer, q, k, v, pos, out, lse, self.own, self.group, window=window, **extras)


class TableCascade:
    """CascadeAttention for a batch whose rows all attend one cache entry, with everything a step reads fixed in
    place: the entry is named through a device table (kernels/decode.py `table`: its k, v, positions and
    length per layer), each row's prefix sits in a device buffer, and the own-KV pool is this object's. So one
    CUDA graph of a batch size and pool capacity serves every entry and every composition of that shape:
    `bind` rewrites the table, the prefixes and the pool (a few copies) where CascadeGraph would capture anew
    (~30 ms of host time with the device idle). Token-major 16-bit entries and global layers only
    (`bind` raises ValueError otherwise). The own pool views the first `batch` rows of `store` (shared by the
    graphs of one capacity); None: no own pool (a CP rank other than the query rank). `use_triton`:
    decode_attention's (tests run the kernel under TRITON_INTERPRET on CPU)."""

    def __init__(self, layer_ids, batch: int, n_kv_heads: int, head_dim: int, store: OwnKV | None, dtype, device,
                 group=None, use_triton: bool | None = None):
        self.layer_ids, self.batch, self.group, self.use_triton = list(layer_ids), batch, group, use_triton
        self.own = None if store is None else OwnKV(layer_ids, batch, n_kv_heads, head_dim, store.capacity, dtype,
                                                     device, within=store)
        self.table = torch.zeros(len(self.layer_ids), 4, dtype=torch.long, device=device)
        self._index = {i: j for j, i in enumerate(self.layer_ids)}
        self.last = torch.zeros(batch, dtype=torch.long, device=device)  # each row's prefix - 1
        row = torch.zeros(1, 1, n_kv_heads, head_dim, dtype=dtype, device=device).permute(0, 2, 1, 3)
        self.anchors = (row, row, torch.zeros(1, dtype=torch.long, device=device))  # one token-major row

    def bind(self, kv: KVCache, prefixes: list[int], pool: OwnKV | None) -> None:
        """Make the next steps attend entry `kv` (row b sharing its first prefixes[b] tokens) and own pool `pool`
        (copied into this one). Raises ValueError, changing nothing, where the entry or pool does not fit."""
        if len(prefixes) != self.batch:
            raise ValueError(f"{len(prefixes)} rows for a graph of {self.batch}")
        rows = []
        for i in self.layer_ids:
            layer = kv.layer(i)
            if layer.fp8 or layer.trimmed:
                raise ValueError(f"layer {i}: an e4m3 or window-trimmed entry is read through its own kernels")
            s = layer.stored()
            rows.append(table_row(s.k, s.v, s.pos, layer.length, self.anchors))
        if (pool is None) != (self.own is None) or (pool is not None and (
                pool.batch != self.batch or pool.capacity > self.own.capacity)):
            raise ValueError("the own-KV pool does not fit this graph's")
        up = functools.partial(to_device, device=self.table.device)
        self.table.copy_(up(rows))
        self.last.copy_(up([m - 1 for m in prefixes]))
        if pool is not None and pool is not self.own:
            if pool.layer_ids != self.own.layer_ids:
                raise ValueError(f"a pool of layers {pool.layer_ids} for a graph of {self.own.layer_ids}")
            n = pool.capacity
            for src, dst in ((pool.all_k, self.own.all_k), (pool.all_v, self.own.all_v),
                             (pool.all_pos, self.own.all_pos)):
                if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
                    src = src.clone()  # another graph's view of the same store
                dst.narrow(3 if dst.dim() == 5 else 2, 0, n).copy_(src)  # k, v [layers, B, Hkv, cap, D]; pos [.., cap]
            self.own.all_pos[:, :, n:].fill_(_NO_KEY)
            self.own.lengths = list(pool.lengths)
            self.own._lengths.copy_(pool._lengths)

    def hook(self, layer: int):
        return functools.partial(self.attend, layer)

    def attend(self, layer: int, q, k, v, pos, cache=None, sparse=None, *, window=None, softcap=None, scale=None,
               **other):
        if other or window is not None:
            raise ValueError(f"TableCascade: layer {layer} has {', '.join(sorted(other)) or 'a window'}: "
                             "run the batch through CascadeAttention")
        B, Hq, L, D = q.shape
        qg = q.transpose(0, 1).reshape(1, Hq, B * L, D)  # rows as one query block
        o, ls = decode_attention(qg, *self.anchors[:2], q_pos=self.last[:, None].expand(B, L).reshape(1, -1),
                                 k_pos=self.anchors[2], causal=True, scale=scale, softcap=softcap,
                                 table=self.table[self._index[layer]], use_triton=self.use_triton)
        out = o.reshape(Hq, B, L, D).transpose(0, 1)
        lse = ls.reshape(Hq, B, L).transpose(0, 1)
        return _with_own(layer, q, k, v, pos, out, lse, self.own, self.group, softcap=softcap, scale=scale)


def _forward(model, tokens: torch.Tensor, positions: torch.Tensor,
             cascade: CascadeAttention | TableCascade) -> torch.Tensor:
    with model.attention_hooks([cascade.hook(i) for i in model.layer_ids]):
        logits = model(tokens, positions=positions, cache=None, last_only=True)
    return logits[:, -1]


def run_cascade(model, tokens: torch.Tensor, positions: torch.Tensor, cascade: CascadeAttention) -> torch.Tensor:
    """One forward of tokens [B, L] at positions [B, L] with every layer attending through
    `cascade` -> last-row logits [B, V] (float32). The hooks hold for this forward only."""
    logits = _forward(model, tokens, positions, cascade)
    if cascade.own is not None:
        cascade.own.advance(tokens.shape[1])
    return logits


class CascadeGraph:
    """The batch's one-token decode step replayed from a CUDA graph (decode is host-bound: one
    forward is hundreds of small launches). One graph serves one batch composition: the cascade's
    groups and own-KV pool are fixed, the tokens and positions are copied into static buffers, and
    each row's next own-KV slot is read on the device. `capture=False` runs the same step eagerly
    through the same buffers (what the CPU tests check). Every rank of a CP group captures and
    replays together (the lse merge's all-reduces are inside).

    The capture only records: no device sync and no emptied allocator cache (torch.cuda.graph does
    both), so it runs while the device still works through the steps queued before it. `warm` False
    first runs the step once off the capture stream (lazy initialisations outside the capture: the
    process's first capture); that run writes the own-KV slot which the replay then writes again with
    the same values."""

    _stream: torch.cuda.Stream | None = None  # one capture stream per process, reused

    def __init__(self, model, cascade: CascadeAttention | TableCascade, batch: int, device, capture: bool = True,
                 warm: bool = False):
        self.model, self.cascade, self.capture, self.warm = model, cascade, capture, warm
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graph, self.logits = None, None

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tok.copy_(tokens)
        self.pos.copy_(positions)
        if not self.capture:
            self.logits = _forward(self.model, self.tok, self.pos, self.cascade)
        elif self.graph is None:
            if CascadeGraph._stream is None:
                CascadeGraph._stream = torch.cuda.Stream()
            side, main = CascadeGraph._stream, torch.cuda.current_stream()
            side.wait_stream(main)  # the static buffers' copies above, and every step before
            with torch.cuda.stream(side):
                if not self.warm:
                    _forward(self.model, self.tok, self.pos, self.cascade)
                graph = torch.cuda.CUDAGraph()  # its own memory pool: a pool shared by graphs that are released
                # and captured again trips torch 2.11's allocator (use_count > 0 INTERNAL ASSERT)
                # thread_local: the disk tier's threads (writes, a split reload's tail copies) may call CUDA meanwhile
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.logits = _forward(self.model, self.tok, self.pos, self.cascade)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
            self.graph = graph  # only a capture that succeeded is replayed
            self.graph.replay()
        else:
            self.graph.replay()
        if self.cascade.own is not None:
            self.cascade.own.advance(1)
        return self.logits
