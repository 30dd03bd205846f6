"""Context strategies: how a CP group shares one sequence. All implement ContextStrategy (base.py)."""
from __future__ import annotations

STRATEGIES = ("dense", "ring", "ulysses", "star")


def make_strategy(name: str, group=None, *, block_size=None, anchor_size=None, query_rank=None):
    """The strategy `name` over `group` (None = a single rank)."""
    if name == "dense":
        from starshard.parallel.context.dense import DenseContext

        return DenseContext(group, query_rank)
    if name == "ring":
        from starshard.parallel.context.ring import RingAttention

        return RingAttention(group, query_rank)
    if name == "ulysses":
        from starshard.parallel.context.ulysses import UlyssesAttention

        return UlyssesAttention(group, query_rank)
    if name == "star":
        from starshard.parallel.context.star import StarAttention

        return StarAttention(group, block_size=block_size, anchor_size=anchor_size, query_rank=query_rank)
    raise ValueError(f"unknown --cp-strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
