"""StrategySpec.rank_rows (the per-rank KV rows the runner allocates and the service admits by)
equals what each strategy's prefill actually keeps: the real cache rows of its segments on every CP
rank, plus the question on the query rank for the query-phase strategies (Star, APB)."""
from __future__ import annotations

import pytest
import torch

from starshard.parallel.context.apb import APBAttention
from starshard.parallel.context.dense import DenseContext
from starshard.parallel.context.ring import RingAttention
from starshard.parallel.context.star import StarAttention
from starshard.parallel.context.ulysses import UlyssesAttention
from starshard.parallel.context.usp import UspAttention
from starshard.strategies import get_spec

LENGTHS = (5, 37, 61)


def _as_rank(strategy, cp: int, rank: int, query_rank: int | None = None):
    """The strategy as CP rank `rank` of `cp` sees it (segments() reads only its rank and sizes)."""
    strategy.cp, strategy.rank = cp, rank
    strategy.query_rank = cp - 1 if query_rank is None else query_rank
    if isinstance(strategy, UspAttention):
        strategy.rd = cp // strategy.u
    return strategy


def _kept(strategy, prompt_len: int, context_len: int) -> list[int]:
    """Positions this rank's prefill stores: its segments' cache rows, then the query phase's question."""
    C = min(context_len, prompt_len - 1) if strategy.query_phase else prompt_len  # as the runner calls it
    kept = []
    for seg in strategy.segments(prompt_len, C):
        rows = seg.cache_rows if seg.cache_rows is not None else torch.arange(len(seg.index))
        kept += [int(p) for p in seg.positions[rows] if p < prompt_len]
    if strategy.query_phase and strategy.is_query_rank:
        kept += list(range(C, prompt_len))
    return kept


def _cases():
    for cp in range(1, 5):
        yield "ring", cp, {}, lambda: RingAttention(None)
        yield "ulysses", cp, {}, lambda: UlyssesAttention(None)
        for u in (d for d in range(1, cp + 1) if cp % d == 0):
            yield "usp", cp, {"ulysses_degree": u}, lambda u=u: UspAttention(None, u, None, None)
        for opts in ({}, {"block_size": 7}, {"block_size": 7, "anchor_size": 3}, {"num_blocks": 3}):
            yield "star", cp, opts, lambda o=opts: StarAttention(None, **o)
        for opts in ({}, {"query_rank": 0}):
            yield "star", cp, opts, lambda: StarAttention(None)
            yield "apb", cp, opts, lambda: APBAttention(None, compressor="random")
        if cp == 1:
            yield "dense", 1, {}, lambda: DenseContext()
            yield "apb", 1, {"apb_hosts": 3}, lambda: APBAttention(None, compressor="random", num_blocks=3)


@pytest.mark.parametrize("name,cp,options,build", list(_cases()))
def test_rank_rows_match_the_shards(name, cp, options, build):
    spec = get_spec(name)
    for L in LENGTHS:
        for C in (L, L - 3, L // 2):
            try:
                kept = [_kept(_as_rank(build(), cp, r, options.get("query_rank")), L, C) for r in range(cp)]
            except ValueError:  # APB with fewer context tokens than hosts: the runner refuses it too
                continue
            rows = spec.rank_rows(cp, L, C, options)
            assert rows == [len(k) for k in kept], (L, C)
            assert sorted(p for k in kept for p in k) == list(range(L)), (L, C)  # every token once


def test_rank_rows_known_values():
    assert get_spec("ring").rank_rows(2, 5, 5, {}) == [2, 3]  # chunks of 2: rank 0 holds 0,1 and (6,7 padding)
    assert get_spec("ulysses").rank_rows(4, 5, 5, {}) == [2, 2, 1, 0]
    # USP 2 x 2 over 10 tokens padded to 16: ring rank 0 holds 0-3 | 12-15 (padding), ring rank 1 4-7 | 8-11
    assert get_spec("usp").rank_rows(4, 10, 10, {"ulysses_degree": 2}) == [4, 0, 4, 2]
    # Star: uneven blocks (the issue's --block-size 300000 on 1M at cp=4) and the question on the query rank
    M = 1 << 20
    assert get_spec("star").rank_rows(4, M + 64, M, {"block_size": 300_000}) == [300_000, 300_000, 300_000,
                                                                                   M - 900_000 + 64]
    assert get_spec("apb").rank_rows(3, 10, 8, {"query_rank": 0}) == [2 + 2, 3, 3]
    assert get_spec("dense").rank_rows(1, 9, 4, {}) == [9]
