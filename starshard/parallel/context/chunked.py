"""Chunked prefill under a context strategy: one path for every strategy's later steps.

A prefill step runs prompt positions [start, end) on caches that hold the earlier steps' KV, each CP
rank its shard. The first step (start == 0) is the strategy's own prefill of prompt[0:end] (runner).
Every later step, whatever the strategy:
- the step's rows are laid out over the CP ranks by zigzag (`chunk_segment`); padding rows carry
  positions past the step, so no real query sees them and they are never stored;
- per attention layer each rank stores its real rows' KV, all-gathers the step's queries (queries
  move, never the cached keys: O(chunk) bytes per layer whatever the prefix), attends them against
  its own stored keys causally by position (the earlier steps' keys all precede the step: no mask,
  so the fused kernel; its own keys masked by position), and an all-to-all hands each rank the cp
  partials of its own rows, merged by log-sum-exp. Every visible key is stored on exactly one rank,
  so the result is exact for ring, Ulysses and USP, local layers too (their window masks each rank's
  keys by position).
- Star: a step in block j > 0 must not see the stored keys between the anchor and its block
  (`ContextStrategy.chunk_hidden`); a rank's stored positions increase row by row (steps in order,
  zigzag rows in order within a step), so those keys are one row range, skipped (`hidden_rows`) by
  global layers; a local layer sees the previous block's edge through its window, as Star's own prefill.
Decode, extends and the cascade mask by stored position, so this layout is transparent to them.
An FP8 KV cache (--fp8 kv) is attended as stored, the step's own keys included (a whole-prompt ring
attends its own block as computed: the two differ by the e4m3 rounding of those keys).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from starshard.engine.kv_cache import KVCache, StoredKV
from starshard.kernels.attention import attention
from starshard.kernels.merge import merge_partials, merge_stacked
from starshard.parallel.context.base import Segment, cache_append, group_size
from starshard.parallel.context.collectives import all_gather_into
from starshard.parallel.context.sharding import zigzag_chunks, zigzag_positions, zigzag_shard

__all__ = ["chunk_segment", "chunk_owner", "chunk_positions", "hidden_rows", "chunk_attend"]


def chunk_segment(start: int, end: int, cp: int, rank: int) -> Segment:
    """This rank's rows of step [start, end): its zigzag shard of the step, shifted by `start`
    (padding rows repeat the step's first token at positions >= end and are never stored)."""
    shard = zigzag_shard(end - start, cp, rank)
    pos = shard.positions + start
    hit = (pos == end - 1).nonzero()
    return Segment(shard.token_index + start, pos, shard.rows, int(hit[0]) if len(hit) else -1)


def chunk_owner(start: int, end: int, cp: int) -> int:
    """The CP rank whose rows of step [start, end) hold position end - 1."""
    c, _ = zigzag_chunks(end - start, cp)
    k = (end - start - 1) // c
    return k if k < cp else 2 * cp - 1 - k


def chunk_positions(start: int, end: int, cp: int) -> torch.Tensor:
    """Positions of the step's rows gathered over the CP group, in rank order (host arithmetic)."""
    return torch.cat([zigzag_positions(end - start, cp, r) for r in range(cp)]) + start


def hidden_rows(cache: KVCache, hidden: tuple[int, int] | None) -> tuple[int, int] | None:
    """The stored rows [a, b) whose positions lie in `hidden` = [lo, hi): a rank stores increasing
    positions (module doc), so they are one range. One host read per step, not per layer."""
    if hidden is None or hidden[0] >= hidden[1] or cache.length == 0:
        return None
    layer = next(iter(cache.layers.values()))
    pos = layer.pos[: layer.length].cpu()
    a, b = torch.searchsorted(pos, torch.tensor(list(hidden), dtype=pos.dtype)).tolist()
    return (a, b) if b > a else None


def _partial(q: torch.Tensor, q_pos: torch.Tensor, s: StoredKV, held: int, skip: tuple[int, int] | None,
             window: int | None = None, **extras):
    """(out, lse) of q over this rank's stored keys, causal by position, rows [skip) left out; rows
    that see no key (or a rank that stores none, or only keys outside a local layer's window) get
    out = 0, lse = -inf. Rows [0, held) were stored by earlier steps: every such key precedes every
    query of this step, so they are attended without a mask (torch's fused kernel on CUDA, as
    `attention_after_held`), unless a window hides the oldest; rows [held, n) are the step's own,
    causal by position (a masked call, but only step-sized). extras: the layer's softcap / scale."""
    n = s.pos.numel()
    spans = [(0, held)] if skip is None else [(0, skip[0]), (skip[1], held)]
    result = None
    for a, b, causal in [(a, b, window is not None) for a, b in spans] + [(held, n, True)]:
        if b <= a:
            continue
        r = s.rows(a, b)
        o, l = attention(q, r.k, r.v, q_pos=q_pos, k_pos=r.pos, causal=causal, window=window, k_scale=r.k_scale,
                         v_scale=r.v_scale, **extras)
        result = (o, l) if result is None else merge_partials(*result, o, l)
    if result is None:
        B, H, R, _ = q.shape
        return torch.zeros_like(q), torch.full((B, H, R), float("-inf"), device=q.device)
    return result


def _gather_queries(q: torch.Tensor, group) -> torch.Tensor:
    """[B, H, n, D] on each rank -> [B, H, cp * n, D], the ranks' rows in rank order."""
    cp = group_size(group)
    B, H, n, D = q.shape
    out = q.new_empty((cp * B, H, n, D))  # gloo wants ranks along dim 0
    all_gather_into(out, q.contiguous(), group)
    return out.view(cp, B, H, n, D).permute(1, 2, 0, 3, 4).reshape(B, H, cp * n, D)


def _return_rows(out: torch.Tensor, lse: torch.Tensor, group) -> torch.Tensor:
    """Each rank's partials of every rank's rows -> this rank's rows merged over the group's partials."""
    cp = group_size(group)
    B, H, R, D = out.shape
    packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1).view(B, H, cp, R // cp, D + 1)
    send = packed.permute(2, 0, 1, 3, 4).contiguous()  # [cp, B, H, n, D + 1]: slice j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return merge_stacked(recv, out.dtype)[0]


def chunk_attend(segment: Segment, group, q_pos: torch.Tensor, skip: tuple[int, int] | None = None):
    """The AttendFn of one later step (module doc). `q_pos`: chunk_positions on the device; `skip`:
    hidden_rows of this rank's cache before the step (Star), None for the exact strategies."""
    rows, cp = segment.cache_rows, group_size(group)

    def attend(q, k, v, pos, cache, sparse=None, window=None, softcap=None, scale=None):
        if sparse is not None:
            raise ValueError("--sparse does not compose with --prefill-chunk under a context strategy (a later "
                             "chunk's queries attend each rank's stored keys apart); drop one of them")
        if cache is None:
            raise ValueError("a chunked prefill needs a KV cache")
        held = cache.length  # rows stored by the earlier steps, all at positions before this step's
        cache_append(cache, k, v, pos, rows)
        qa = _gather_queries(q, group) if cp > 1 else q
        # Star's hidden keys lie before the block; a local layer's window already hides all but the previous
        # block's edge, which it needs (star.py): it skips nothing.
        out, lse = _partial(qa, q_pos, cache.stored(), held, skip if window is None else None, window=window,
                            softcap=softcap, scale=scale)
        return _return_rows(out, lse, group) if cp > 1 else out

    return attend
