"""Ulysses (DeepSpeed-Ulysses) sequence parallelism (exact).

Rank r holds a contiguous slice of the padded sequence. In each attention layer one all-to-all turns
[all heads, L/cp tokens] into [H/cp heads, all L tokens], attention runs on the full sequence for
those heads (plain causal: the fast dense kernel), and one all-to-all turns it back.
GQA: KV heads are split over the ranks when cp divides them; otherwise each rank receives, per query
head it owns, that head's KV head (replication), which costs more traffic but stays exact.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from starshard.kernels.attention import attention
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append


def valid_cp_sizes(num_heads: int, limit: int = 64) -> list[int]:
    return [c for c in range(1, limit + 1) if num_heads % c == 0]


def seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, H, n, D] sequence shard -> [B, H/cp, cp*n, D] head shard (all-to-all over the group)."""
    B, H, n, D = x.shape
    send = x.reshape(B, cp, H // cp, n, D).transpose(0, 1).contiguous()  # [cp, B, H/cp, n, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * n, D)  # ranks' slices in order


def heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of seq_to_heads: [B, H/cp, cp*n, D] -> [B, H, n, D]."""
    B, h, L, D = x.shape
    n = L // cp
    send = x.reshape(B, h, cp, n, D).permute(2, 0, 1, 3, 4).contiguous()  # [cp, B, h, n, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(B, cp * h, n, D)


class UlyssesAttention(ContextStrategy):
    name = "ulysses"

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        n = math.ceil(prompt_len / self.cp)
        pos = torch.arange(self.rank * n, (self.rank + 1) * n)
        real = pos < prompt_len
        index = torch.where(real, pos, torch.zeros_like(pos))
        last = (prompt_len - 1) - self.rank * n if self.rank == self.last_token_rank(prompt_len, context_len) else -1
        return [Segment(index, pos, real.nonzero().squeeze(1), last)]

    def last_token_rank(self, prompt_len: int, context_len: int) -> int:
        return (prompt_len - 1) // math.ceil(prompt_len / self.cp)

    def check_heads(self, hq: int, hkv: int) -> None:
        if hq % self.cp:
            raise ValueError(
                f"Ulysses needs the (per tensor-parallel rank) query heads, {hq}, divisible by cp={self.cp}; "
                f"valid cp sizes: {valid_cp_sizes(hq)} (or use --cp-strategy ring)"
            )

    def prefill_attend(self, segment: Segment):
        rows = segment.cache_rows

        def attend(q, k, v, pos, cache):
            cache_append(cache, k, v, pos, rows)
            return self.ulysses_attention(q, k, v)

        return attend

    def ulysses_attention(self, q, k, v):
        cp, g = self.cp, self.group
        if cp == 1:
            L = q.shape[2]
            p = torch.arange(L, device=q.device)
            return attention(q, k, v, q_pos=p, k_pos=p, causal=True)[0]
        hq, hkv = q.shape[1], k.shape[1]
        self.check_heads(hq, hkv)
        if hkv % cp:  # replicate: give each query head its own copy of its KV head
            kv_of_q = torch.arange(hq, device=k.device) // (hq // hkv)
            k, v = k[:, kv_of_q], v[:, kv_of_q]
        qh, kh, vh = (seq_to_heads(t, g, cp) for t in (q, k, v))
        L = qh.shape[2]
        p = torch.arange(L, device=q.device)  # shards are contiguous and in rank order
        out, _ = attention(qh, kh, vh, q_pos=p, k_pos=p, causal=True)
        return heads_to_seq(out, g, cp)
