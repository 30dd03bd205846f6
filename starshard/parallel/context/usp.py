"""USP (unified sequence parallelism, exact): a 2-D CP group, Ulysses inside, ring across.

A CP group of cp = ring_degree x ulysses_degree ranks. CP rank c sits at ring rank c // u and Ulysses
rank c % u (Ulysses fastest-varying: its all-to-alls are the bandwidth-hungry part, so its ranks
should be neighbours, e.g. one node). The Ulysses all-to-all gives every rank H/u heads of its ring
rank's whole shard; ring attention then runs across the ring group; one all-to-all brings the
result back. Sequence layout: sharding.usp_positions (zigzag over the ring).
With an FP8 KV cache both parts move K/V as e4m3 + scales (wire.py): the ring passes on the bytes the
Ulysses all-to-all delivered, so every received key is attended as the FP8 cache holds it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from starshard.kernels.sparse import refuse_sparse
from starshard.parallel.context.base import ContextStrategy, Segment, cache_append, group_size
from starshard.parallel.context.ring import RingPlan, build_ring_plan, ring_attention
from starshard.parallel.context.sharding import usp_shard, zigzag_chunks, zigzag_positions
from starshard.parallel.context.ulysses import ulysses_core
from starshard.parallel.context.wire import WireStats, fp8_wire
from starshard.strategies.ulysses import check_ulysses_heads
from starshard.strategies.usp import check_degree

__all__ = ["usp_attention", "usp_group_ranks", "new_usp_groups", "usp_coords", "usp_ring_plan", "UspAttention"]


def usp_group_ranks(cp_ranks: Sequence[int], ulysses_degree: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) of one CP group, as lists of global ranks.

    CP rank c is the c-th smallest global rank of the group (torch's group-rank order), so group-local
    ranks agree with usp_coords: Ulysses groups are runs of u consecutive CP ranks, ring groups every
    u-th one."""
    ranks = sorted(cp_ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"CP group ranks repeat: {list(cp_ranks)}")
    if ulysses_degree < 1 or len(ranks) % ulysses_degree:
        raise ValueError(f"ulysses_degree must divide the CP group size {len(ranks)}, got {ulysses_degree}; "
                         f"valid: {[d for d in range(1, len(ranks) + 1) if len(ranks) % d == 0]}")
    u = ulysses_degree
    return [ranks[i : i + u] for i in range(0, len(ranks), u)], [ranks[j::u] for j in range(u)]


def usp_coords(cp_rank: int, ulysses_degree: int) -> tuple[int, int]:
    """(ring rank, Ulysses rank) of CP rank `cp_rank`."""
    return divmod(cp_rank, ulysses_degree)


def new_usp_groups(cp_groups: Sequence[Sequence[int]], ulysses_degree: int, *, backend: str | None = None):
    """Create the Ulysses and ring subgroups of every CP group; returns this rank's
    (ulysses_group, ring_group), None for a subgroup of one rank (or when this rank is in no CP group).

    Collective over the default group: every rank must call it with the same arguments, in the same
    order relative to its other new_group calls (groups are created in one fixed order here)."""
    seen: set[int] = set()
    for g in cp_groups:
        if seen & set(g):
            raise ValueError(f"CP groups overlap: {[list(x) for x in cp_groups]}")
        seen |= set(g)
    me = dist.get_rank()
    mine: list = [None, None]
    for g in cp_groups:
        for slot, subgroups in enumerate(usp_group_ranks(g, ulysses_degree)):
            for ranks in subgroups:
                if len(ranks) == 1:
                    continue  # a group of one needs no communicator; None means a single rank
                pg = dist.new_group(ranks, backend=backend)
                if me in ranks:
                    mine[slot] = pg
    return mine[0], mine[1]


def usp_ring_plan(seq_len: int, ulysses_degree: int, ring_group, device: torch.device | str | None = None) -> RingPlan | None:
    """The ring plan for self-attention over sharding.usp_positions shards (no communication);
    None when the ring has one rank."""
    if ring_group is None or dist.get_world_size(ring_group) == 1:
        return None
    rd = dist.get_world_size(ring_group)
    _, padded = zigzag_chunks(seq_len, rd * ulysses_degree)  # the usp padding: a multiple of 2*rd*u
    pos = [zigzag_positions(padded, rd, i) for i in range(rd)]  # a ring rank's whole shard, in order
    return build_ring_plan(pos[dist.get_rank(ring_group)], pos, ring_group, device, self_attention=True)


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  ulysses_group, ring_group, *, scale: float | None = None, ring_plan: RingPlan | None = None,
                  need_lse: bool = True, fp8: bool = False, stats: WireStats | None = None,
                  window: int | None = None, softcap: float | None = None):
    """Causal attention of this rank's shard over the sequence held by the whole 2-D CP group.

    Shapes as ulysses_attention; Hq must be divisible by the Ulysses degree. `ring_plan` (from
    usp_ring_plan) is for the ring over the Ulysses-gathered shards; without it one is gathered.
    Returns (out in q.dtype, lse float32 or None if not need_lse). fp8: K/V travel as e4m3 + scales in
    both parts (an FP8 KV cache); `stats` counts the K/V bytes sent. window, softcap: the layer's, in
    every call (ring_attention: a local layer's ring sends only its window's edges where it can)."""

    def ring(qh, kh, vh, qp, kp, packed):
        return ring_attention(qh, kh, vh, qp, kp, ring_group, scale=scale, plan=ring_plan, fp8=fp8, packed=packed,
                              stats=stats, window=window, softcap=softcap)

    return ulysses_core(q, k, v, q_pos, k_pos, ulysses_group, ring, need_lse=need_lse, fp8=fp8, stats=stats)


class UspAttention(ContextStrategy):
    """USP strategy for the model: Ulysses over `ulysses_group` inside, zigzag ring over `ring_group`.

    The CP group's rank c sits at ring rank c // u, Ulysses rank c % u (usp_coords); create the
    subgroups with new_usp_groups (collective over the world)."""

    name = "usp"

    def __init__(self, group, ulysses_degree: int, ulysses_group, ring_group, query_rank=None):
        super().__init__(group, query_rank)
        check_degree(ulysses_degree, self.cp)
        self.u, self.rd = ulysses_degree, self.cp // ulysses_degree
        self.ulysses_group, self.ring_group = ulysses_group, ring_group

    @classmethod
    def from_options(cls, group, options, *, cp_groups=None, tp_group=None):
        """Ulysses degree default: the whole CP group (plain Ulysses); the subgroups are created on every rank."""
        if group is None:
            return cls(None, 1, None, None, options.get("query_rank"))
        u = options.get("ulysses_degree", group_size(group))
        ulysses_group, ring_group = new_usp_groups(cp_groups or [dist.get_process_group_ranks(group)], u)
        return cls(group, u, ulysses_group, ring_group, options.get("query_rank"))

    def spec_options(self) -> dict:
        return super().spec_options() | dict(ulysses_degree=self.u)

    @classmethod
    def shard_positions(cls, prompt_len: int, cp: int, rank: int, options: dict) -> torch.Tensor:
        u = options.get("ulysses_degree", cp)  # from_options' default: the whole CP group
        ring_rank, uly_rank = usp_coords(rank, u)
        return usp_shard(prompt_len, cp // u, u, ring_rank, uly_rank).positions

    def _shard(self, prompt_len: int, cp_rank: int):
        ring_rank, uly_rank = usp_coords(cp_rank, self.u)
        return usp_shard(prompt_len, self.rd, self.u, ring_rank, uly_rank)

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        shard = self._shard(prompt_len, self.rank)
        hit = (shard.positions == prompt_len - 1).nonzero()
        self._prompt_len = prompt_len
        return [Segment(shard.token_index, shard.positions, shard.rows, int(hit[0]) if len(hit) else -1)]

    def last_token_rank(self, prompt_len: int, context_len: int) -> int:
        return next(c for c in range(self.cp) if bool((self._shard(prompt_len, c).positions == prompt_len - 1).any()))

    def check_heads(self, hq: int, hkv: int) -> None:
        check_ulysses_heads(hq, hkv, self.u)

    def prefill_attend(self, segment: Segment):
        rows = segment.cache_rows
        plan = usp_ring_plan(self._prompt_len, self.u, self.ring_group, segment.positions.device)

        def attend(q, k, v, pos, cache, sparse=None, window=None, softcap=None, scale=None):
            refuse_sparse(sparse, "usp")
            cache_append(cache, k, v, pos, rows)
            return usp_attention(q, k, v, pos, pos, self.ulysses_group, self.ring_group, ring_plan=plan, need_lse=False,
                                 fp8=fp8_wire(cache), stats=self.wire, window=window, softcap=softcap, scale=scale)[0]

        return attend
