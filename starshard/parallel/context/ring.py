"""Ring attention with zigzag load balancing (exact).

The padded sequence is cut into 2*cp chunks; rank r holds chunks r and 2cp-1-r, so every rank does
the same causal work. KV blocks travel the ring (batch_isend_irecv, double-buffered: the next block is
in flight while the current one is computed) and partials merge by log-sum-exp in float32. Causality
is by position, so the zigzag structure also tells which half of each block pair is visible: from a
rank j < r only j's first chunk is visible (to all local rows); from j > r both of j's chunks are
visible, to the local second chunk only. Each step is therefore half a block pair, with no mask.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from starshard.kernels.attention import attention
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append
from starshard.parallel.context.merge import merge_partials


def zigzag_chunks(prompt_len: int, cp: int) -> tuple[int, int]:
    """(chunk size, padded length): the prompt padded up to a multiple of 2*cp."""
    chunk = math.ceil(prompt_len / (2 * cp))
    return chunk, chunk * 2 * cp


def zigzag_positions(prompt_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions rank holds: chunks rank and 2cp-1-rank (positions >= prompt_len are padding)."""
    c, _ = zigzag_chunks(prompt_len, cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


class RingAttention(ContextStrategy):
    name = "ring"

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        pos = zigzag_positions(prompt_len, self.cp, self.rank)
        real = pos < prompt_len
        index = torch.where(real, pos, torch.zeros_like(pos))  # padding rows repeat token 0
        last = int((pos == prompt_len - 1).nonzero()[0]) if bool((pos == prompt_len - 1).any()) else -1
        self._prompt_len = prompt_len  # prefill_attend's blocks follow from it on every rank
        self._src_pos: dict[int, torch.Tensor] = {}  # peers' positions on this device, per prompt
        return [Segment(index, pos, real.nonzero().squeeze(1), last)]

    def last_token_rank(self, prompt_len: int, context_len: int) -> int:
        c, _ = zigzag_chunks(prompt_len, self.cp)
        chunk = (prompt_len - 1) // c
        return chunk if chunk < self.cp else 2 * self.cp - 1 - chunk

    def _has_padding(self, rank: int) -> bool:
        """Whether `rank`'s shard holds padding rows (known on every rank without communication)."""
        c, _ = zigzag_chunks(self._prompt_len, self.cp)
        return (2 * self.cp - rank) * c > self._prompt_len  # its second chunk runs past the prompt

    def prefill_attend(self, segment: Segment):
        rows = segment.cache_rows

        def attend(q, k, v, pos, cache):
            cache_append(cache, k, v, pos, rows)
            return self.ring_attention(q, k, v, pos)

        return attend

    def ring_attention(self, q, k, v, pos):
        """This rank's zigzag shard of q/k/v [B, H, 2c, D] -> attention output of its rows."""
        cp, r = self.cp, self.rank
        if cp == 1:
            return attention(q, k, v, q_pos=pos, k_pos=pos, causal=True)[0]
        c = q.shape[2] // 2
        send_to = dist.get_global_rank(self.group, (r + 1) % cp)
        recv_from = dist.get_global_rank(self.group, (r - 1) % cp)

        def start(block):  # pass `block` on, receive the previous rank's
            incoming = torch.empty_like(block)
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, block, send_to, self.group),
                dist.P2POp(dist.irecv, incoming, recv_from, self.group),
            ])
            return reqs, incoming

        pending = start(torch.stack([k, v]).contiguous())  # first block travels during the local step
        out, lse = self._local(q, k, v, pos, c)
        for step in range(1, cp):
            reqs, block = pending
            for req in reqs:
                req.wait()
            if step < cp - 1:
                pending = start(block)
            src = (r - step) % cp
            if src not in self._src_pos:
                self._src_pos[src] = zigzag_positions(self._prompt_len, cp, src).to(pos.device)
            src_pos = self._src_pos[src]
            out, lse = self._accumulate(q, block, src_pos, src, pos, out, lse, c)
        return out.to(q.dtype)

    def _local(self, q, k, v, pos, c: int):
        """Own block pair as three unmasked-shape calls: two causal diagonals and one full block
        (second chunk over first), so the fast dense kernels apply; padding keeps a position mask."""
        if self._has_padding(self.rank):
            out, lse = attention(q, k, v, q_pos=pos, k_pos=pos, causal=True)
            return out.float(), lse
        p1, p2 = pos[:c], pos[c:]
        o1, l1 = attention(q[:, :, :c], k[:, :, :c], v[:, :, :c], q_pos=p1, k_pos=p1, causal=True)
        o2, l2 = attention(q[:, :, c:], k[:, :, c:], v[:, :, c:], q_pos=p2, k_pos=p2, causal=True)
        o3, l3 = attention(q[:, :, c:], k[:, :, :c], v[:, :, :c], q_pos=p2, k_pos=p1, causal=False)
        o2, l2 = merge_partials(o2.float(), l2, o3, l3)
        return torch.cat([o1.float(), o2], dim=2), torch.cat([l1, l2], dim=2)

    def _accumulate(self, q, kv, kv_pos, src: int, pos, out, lse, c: int):
        """Merge the visible half of src's block pair into (out, lse)."""
        k, v = kv[0], kv[1]
        r = self.rank
        # Padding keys sit past every real query, so a position mask keeps them out exactly; blocks
        # without padding need no mask.
        masked = self._has_padding(src) or self._has_padding(r)
        if src < r:  # src's first chunk precedes both local chunks
            o, l = attention(q, k[:, :, :c], v[:, :, :c], q_pos=pos, k_pos=kv_pos[:c], causal=masked)
            return merge_partials(out, lse, o, l)
        # src > r: both of src's chunks precede the local second chunk, none precedes the first
        o, l = attention(q[:, :, c:], k, v, q_pos=pos[c:], k_pos=kv_pos, causal=masked)
        o2, l2 = merge_partials(out[:, :, c:], lse[:, :, c:], o, l)
        out = torch.cat([out[:, :, :c], o2], dim=2)
        lse = torch.cat([lse[:, :, :c], l2], dim=2)
        return out, lse
