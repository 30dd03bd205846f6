"""Which KV heads and positions one rank of an exact layout holds, and a rank's shard rebuilt from the files
of another exact layout (serving/disk_tier.py reads them; the disk key says which layouts share files:
cache_key.CacheKey.share_digest).

An exact layout's KV is dense attention's, split two ways:
- tp: a rank holds a slice of the KV heads (partition.TPShard: consecutive slices, each KV head replicated
  on tp / Hkv neighbouring ranks when tp > Hkv);
- cp: a rank holds a set of positions. Attention, decode and extends mask by stored position, so any set
  serves, but a reader rebuilds exactly the rows its own prefill of the entry would have kept, in the same
  order (`prefill_positions`): its memory accounting (StrategySpec.rank_rows) and what a later chunked step
  assumes (a rank's stored positions increase, parallel/context/chunked.py) then hold as after a prefill.
"""
from __future__ import annotations


import numpy as np
import torch

from starshard.parallel.context import CLASSES
from starshard.parallel.context.sharding import zigzag_positions
from starshard.serving.cache_key import CacheKey
from starshard.serving.host_tier import HostKV, host_buffer, layout, own
from starshard.strategies import get_spec


def head_range(kv_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """[start, stop) of the model's `kv_heads` KV heads that tp rank `tp_rank` holds (partition.TPShard)."""
    if kv_heads >= tp:
        n = kv_heads // tp
        return tp_rank * n, (tp_rank + 1) * n
    start = tp_rank // (tp // kv_heads)
    return start, start + 1


def runs(pos) -> list[list[int]]:
    """Positions as [start, stop) runs of consecutive positions, in order (a header's compact spelling)."""
    pos = np.asarray(pos, dtype=np.int64)
    if not len(pos):
        return []
    cut = np.flatnonzero(np.diff(pos) != 1) + 1
    starts, ends = np.r_[0, cut], np.r_[cut, len(pos)]
    return [[int(pos[a]), int(pos[b - 1]) + 1] for a, b in zip(starts, ends)]


def from_runs(rs) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in rs]) if rs else np.zeros(0, dtype=np.int64)


def prefill_positions(key: CacheKey, cp_rank: int, n: int) -> np.ndarray:
    """The positions, in stored order, that CP rank `cp_rank` of `key`'s layout keeps after prefilling an
    n-token entry in its steps (runtime/context_parallel.py: the first step the strategy's own prefill of
    prompt[0:end], every later one its zigzag shard of the step; padding never stored)."""
    if key.cp == 1:
        return np.arange(n, dtype=np.int64)
    options = dict(key.options)
    bounds = get_spec(key.strategy).prefill_bounds(key.cp, n, n, options, key.prefill_chunk, key.prefill_knee)
    out = []
    for s, e in bounds:
        pos = CLASSES[key.strategy].shard_positions(e, key.cp, cp_rank, options) if s == 0 else \
            zigzag_positions(e - s, key.cp, cp_rank) + s
        if pos is None:
            raise ValueError(f"--cp-strategy {key.strategy} has no fixed sequence layout to rebuild a shard in")
        out.append(pos[pos < e].numpy())
    return np.concatenate(out).astype(np.int64)


def _raw(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # index ops take no e4m3


def reassemble(parts: list[tuple[HostKV, tuple[int, int]]], positions: np.ndarray, heads: tuple[int, int],
               arena=None) -> HostKV:
    """One shard from other layouts' shards `parts` ((HostKV, the KV heads [start, stop) it holds)): heads
    [heads) of the rows at `positions`, in that order, for every layer keeping every key. A window-trimmed
    layer keeps the positions the parts hold of those (one CP rank wrote them: its rows as they were).
    ValueError when a position or a head is missing (the caller checked coverage from the headers)."""
    first = parts[0][0]
    b, _, d = first.shape()
    h0, h1 = heads
    want = {}
    for i in first.layer_ids:
        if i in first.windows:
            held = np.concatenate([host.layer(i).pos.numpy() for host, _ in parts])
            want[i] = positions[np.isin(positions, held)]
        else:
            want[i] = positions
    sections, nbytes = layout(first.layer_ids, b, h1 - h0, d, {i: len(p) for i, p in want.items()}, first.dtype,
                              first.fp8)
    out = own(HostKV(host_buffer(nbytes, arena), sections, first.dtype, first.fp8, len(positions),
                     max(host.next_position for host, _ in parts), dict(first.windows), first.serves_from,
                     context_len=first.context_len), arena)
    out.buffer.zero_()  # the gaps between sections: never stale memory in a file written from it
    for i, pos in want.items():
        dst = {s.part: _raw(out.tensor(s)) for s in sections if s.layer == i}
        dst["pos"].copy_(torch.from_numpy(pos))
        filled = np.zeros((h1 - h0, len(pos)), dtype=bool)
        for host, (s0, s1) in parts:
            lo, hi = max(h0, s0), min(h1, s1)
            if lo >= hi:
                continue
            src = host.layer(i)
            src_pos = src.pos.numpy()
            order = np.argsort(src_pos, kind="stable")
            idx = np.minimum(np.searchsorted(src_pos[order], pos), max(len(src_pos) - 1, 0))
            hit = (src_pos[order][idx] == pos) if len(src_pos) else np.zeros(len(pos), dtype=bool)
            rows_dst, rows_src = torch.from_numpy(np.flatnonzero(hit)), torch.from_numpy(order[idx[hit]])
            for part in ("k", "v", "k_scale", "v_scale"):
                t = _raw(getattr(src, part))
                if t is not None:
                    dst[part][:, lo - h0:hi - h0].index_copy_(2, rows_dst, t[:, lo - s0:hi - s0].index_select(2, rows_src))
            filled[lo - h0:hi - h0, hit] = True
        if not filled.all():
            heads_missing, rows_missing = np.nonzero(~filled)
            raise ValueError(f"layer {i}: KV head {h0 + int(heads_missing[0])} at position "
                             f"{int(pos[rows_missing[0]])} is in none of the files")
    return out
