"""Ulysses (DeepSpeed-Ulysses) sequence parallelism (exact), and the strategy built on it.

Each rank holds a sequence shard of every head. One all-to-all turns [B, H, L/cp, D] sequence shards
into [B, H/cp, L, D] head shards (positions are all-gathered), attention runs on the whole sequence
for those heads, and one all-to-all turns the result back. No host synchronisation.
GQA: KV heads are split over the ranks when cp divides them; otherwise each KV head is repeated
(the fewest copies, lcm(Hkv, cp) heads in all) so that every rank receives the KV heads its query
heads read. Query heads must be divisible by cp.
With an FP8 KV cache, K and V travel as e4m3 plus per-(head, token) scales (wire.py: about half the
bytes) in their own all-to-all, and are dequantized on arrival (the rank's own rows stay as computed);
q and the output travel in the compute dtype as before.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from starshard.kernels.attention import attention, causal_attention_int8_scores
from starshard.kernels.sparse import LayerSparse, pattern_for
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append, group_size
from starshard.parallel.context.collectives import all_gather_1d
from starshard.parallel.context.sharding import contiguous_shard
from starshard.parallel.context.wire import WireStats, fp8_wire, nbytes, pack_fp8, unpack_fp8
from starshard.strategies.ulysses import check_ulysses_heads

__all__ = ["ulysses_attention", "ulysses_core", "kv_head_copies", "seq_to_heads", "heads_to_seq", "gather_positions",
           "UlyssesAttention"]

# (q, k, v, q_pos, k_pos, packed) of the head shards -> (out, lse): what runs between the two all-to-alls.
# packed: with FP8 K/V on the wire, the (k, v) head shards as the e4m3 bytes that arrived, else None.
Inner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                  tuple[torch.Tensor, torch.Tensor] | None], tuple[torch.Tensor, torch.Tensor]]


def kv_head_copies(hq: int, hkv: int, cp: int) -> int:
    """Copies of each KV head so that cp ranks split them evenly and each rank's query heads find
    theirs. cp // gcd(Hkv, cp) always divides Hq/Hkv when cp divides Hq, so GQA groups stay intact."""
    return 1 if hkv % cp == 0 else cp // math.gcd(hkv, cp)


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_heads(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Each [B, H, n, D] sequence shard -> [B, H/cp, cp*n, D] head shard (ranks' rows in rank order).

    Tensors of the same row shape and dtype travel in one all-to-all."""
    cp = group_size(group)
    for t in tensors:
        if t.shape[1] % cp:
            raise ValueError(f"cannot split {t.shape[1]} heads over {cp} ranks")
    # [cp, B, H/cp, n, D]: the slice for rank c is its heads
    views = [t.reshape(t.shape[0], cp, t.shape[1] // cp, *t.shape[2:]).transpose(0, 1) for t in tensors]
    packable = len({(t.shape[0], *t.shape[2:], t.dtype) for t in tensors}) == 1
    batches = [views] if packable else [[x] for x in views]
    out: list[torch.Tensor] = []
    for batch in batches:
        recv = _all_to_all(torch.cat(batch, dim=2) if len(batch) > 1 else batch[0].contiguous(), group)
        for part in recv.split([x.shape[2] for x in batch], dim=2):
            _, B, h, n, D = part.shape
            out.append(part.permute(1, 2, 0, 3, 4).reshape(B, h, cp * n, D))
    return out


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of seq_to_heads: [B, H/cp, cp*n, ...] -> [B, H, n, ...] (trailing dims optional)."""
    cp = group_size(group)
    B, h, L, *rest = x.shape
    send = x.reshape(B, h, cp, L // cp, *rest).transpose(0, 2).transpose(1, 2)  # [cp, B, h, n, ...]
    recv = _all_to_all(send.contiguous(), group)
    return recv.transpose(0, 1).reshape(B, cp * h, L // cp, *rest)


def gather_positions(q_pos: torch.Tensor, k_pos: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's positions in rank order (one all-gather; the same tensor twice for self-attention)."""
    if q_pos is k_pos:
        p = all_gather_1d(q_pos, group).reshape(-1)
        return p, p
    g = all_gather_1d(torch.cat([q_pos, k_pos.to(q_pos.dtype)]), group)
    n = q_pos.numel()
    return g[:, :n].reshape(-1), g[:, n:].reshape(-1)


def _kv_to_heads_fp8(q, k, v, copies: int, group, stats: WireStats | None):
    """seq_to_heads with K/V as e4m3 + scales: q in one all-to-all, the packed k, v in another.
    Returns the q, k, v head shards (k, v dequantized, this rank's own rows as computed) and the
    packed (k, v) head shards as they arrived."""
    cp, r = group_size(group), dist.get_rank(group)
    k8, v8 = pack_fp8(k), pack_fp8(v)  # before the copies: each row is quantized once
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        k8, v8 = k8.repeat_interleave(copies, dim=1), v8.repeat_interleave(copies, dim=1)
    (qh,) = seq_to_heads([q], group)
    kh8, vh8 = seq_to_heads([k8, v8], group)
    if stats is not None:
        stats.add(nbytes(k8, v8) * (cp - 1) // cp)  # all but this rank's own slice leaves it
    h, n = kh8.shape[1], k.shape[2]
    kh, vh = unpack_fp8(kh8, k.dtype), unpack_fp8(vh8, v.dtype)
    kh[:, :, r * n : (r + 1) * n] = k[:, r * h : (r + 1) * h]
    vh[:, :, r * n : (r + 1) * n] = v[:, r * h : (r + 1) * h]
    return qh, kh, vh, (kh8, vh8)


def ulysses_core(q, k, v, q_pos, k_pos, group, inner: Inner, *, need_lse: bool = True, fp8: bool = False,
                 stats: WireStats | None = None):
    """seq -> head shards over `group`, `inner` on them, back to sequence shards: (out, lse | None).

    Shards must have equal lengths on every rank (pad with sharding.py; padding positions lie past
    the real tokens, so masking by position keeps real rows exact). fp8: k, v travel as e4m3 + scales
    (wire.py) and `inner` also gets them packed as they arrived; `stats` counts the K/V bytes sent."""
    for name, pos, t in (("q_pos", q_pos, q), ("k_pos", k_pos, k)):
        if pos.dim() != 1 or pos.numel() != t.shape[2]:
            raise ValueError(f"{name} must be 1-D with one position per row ({t.shape[2]}), got {tuple(pos.shape)}")
    cp = group_size(group)
    hq, hkv = q.shape[1], k.shape[1]
    check_ulysses_heads(hq, hkv, cp)  # before any communication: every rank raises alike
    if cp == 1:
        out, lse = inner(q, k, v, q_pos, k_pos, None)
        return out, lse if need_lse else None
    copies = kv_head_copies(hq, hkv, cp)
    packed = None
    if fp8:
        qh, kh, vh, packed = _kv_to_heads_fp8(q, k, v, copies, group, stats)
    else:
        if copies > 1:
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        qh, kh, vh = seq_to_heads([q, k, v], group)
        if stats is not None:
            stats.add(nbytes(k, v) * (cp - 1) // cp)
    qp, kp = gather_positions(q_pos, k_pos, group)
    out, lse = inner(qh, kh, vh, qp, kp, packed)
    return heads_to_seq(out, group), heads_to_seq(lse, group) if need_lse else None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      group, *, scale: float | None = None, need_lse: bool = True, sparse: LayerSparse | None = None,
                      fp8: bool = False, stats: WireStats | None = None, int8_scores: bool = False,
                      window: int | None = None, softcap: float | None = None):
    """Causal attention of this rank's sequence shard over the whole sequence held by `group`.

    q [B, Hq, n, D], k/v [B, Hkv, m, D], q_pos [n], k_pos [m]: this rank's shard; n, m equal on every
    rank. Returns (out [B, Hq, n, D] in q.dtype, lse [B, Hq, n] float32, or None if not need_lse:
    saves one small all-to-all). Raises ValueError when Hq is not divisible by the group size.
    `sparse`: the layer's sparse method; after the all-to-all this rank holds heads
    rank*Hq/cp .. (rank+1)*Hq/cp - 1 of the whole sequence, so their patterns apply as on one device.
    fp8: k, v travel as e4m3 + scales (an FP8 KV cache); `stats` counts the K/V bytes sent.
    int8_scores (`--fp8 attention`): after the all-to-all each rank's call is one square causal prefill over
    the whole sequence, the call the dense path gives 8-bit scores (kernels/attention.py
    causal_attention_int8_scores; it keeps `attention` for any other mask); not with a sparse pattern.
    window, softcap, scale: the layer's (kernels/attention.py); each rank attends its heads over the
    whole sequence, so a window masks by position exactly as on one device (8-bit scores take none).
    """
    if int8_scores and (window is not None or softcap is not None):
        raise ValueError("--fp8 attention (8-bit prefill scores) does not run a sliding window or a logit soft-cap; "
                         "drop `attention` from --fp8 for this model")
    offset = 0 if group is None else dist.get_rank(group) * (q.shape[1] // group_size(group))

    def dense(qh, kh, vh, qp, kp, packed):
        pattern = pattern_for(sparse, qh, offset)
        if int8_scores:
            return causal_attention_int8_scores(qh, kh, vh, q_pos=qp, k_pos=kp, scale=scale, sparse=pattern)
        return attention(qh, kh, vh, q_pos=qp, k_pos=kp, causal=True, scale=scale, sparse=pattern, window=window,
                         softcap=softcap)

    return ulysses_core(q, k, v, q_pos, k_pos, group, dense, need_lse=need_lse, fp8=fp8, stats=stats)


class UlyssesAttention(ContextStrategy):
    """Ulysses strategy for the model: prefill self-attention over contiguous shards."""

    name = "ulysses"

    @classmethod
    def shard_positions(cls, prompt_len: int, cp: int, rank: int, options: dict) -> torch.Tensor:
        return contiguous_shard(prompt_len, cp, rank).positions

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        shard = contiguous_shard(prompt_len, self.cp, self.rank)
        n = shard.positions.numel()
        last = (prompt_len - 1) - self.rank * n if self.rank == self.last_token_rank(prompt_len, context_len) else -1
        return [Segment(shard.token_index, shard.positions, shard.rows, last)]

    def last_token_rank(self, prompt_len: int, context_len: int) -> int:
        return (prompt_len - 1) // math.ceil(prompt_len / self.cp)

    def check_heads(self, hq: int, hkv: int) -> None:
        check_ulysses_heads(hq, hkv, self.cp)

    def prefill_attend(self, segment: Segment):
        rows = segment.cache_rows

        def attend(q, k, v, pos, cache, sparse=None, window=None, softcap=None, scale=None):
            cache_append(cache, k, v, pos, rows)
            return ulysses_attention(q, k, v, pos, pos, self.group if self.cp > 1 else None, need_lse=False,
                                     sparse=sparse, fp8=fp8_wire(cache), stats=self.wire,
                                     int8_scores=self.int8_scores, window=window, softcap=softcap, scale=scale)[0]

        return attend

    def ulysses_attention(self, q, k, v):
        """This rank's contiguous shard (positions rank*n ...) -> its attention output rows."""
        n = q.shape[2]
        pos = torch.arange(self.rank * n, (self.rank + 1) * n, device=q.device)
        return ulysses_attention(q, k, v, pos, pos, self.group if self.cp > 1 else None, need_lse=False)[0]
