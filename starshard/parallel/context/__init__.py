"""Context strategies: how a CP group shares one sequence. All implement ContextStrategy (base.py)."""
from __future__ import annotations

STRATEGIES = ("dense", "ring", "ulysses", "usp", "star")


def make_strategy(name: str, group=None, *, block_size=None, anchor_size=None, query_rank=None,
                  ulysses_degree=None, cp_groups=None, num_blocks=None):
    """The strategy `name` over `group` (None = a single rank).

    usp: `ulysses_degree` (default: the whole CP group, i.e. plain Ulysses) and `cp_groups`, every CP
    group of the world as global ranks (its subgroups are created collectively on every rank)."""
    if name == "dense":
        from starshard.parallel.context.dense import DenseContext

        return DenseContext(group, query_rank)
    if name == "ring":
        from starshard.parallel.context.ring import RingAttention

        return RingAttention(group, query_rank)
    if name == "ulysses":
        from starshard.parallel.context.ulysses import UlyssesAttention

        return UlyssesAttention(group, query_rank)
    if name == "usp":
        import torch.distributed as dist

        from starshard.parallel.context.base import group_size
        from starshard.parallel.context.usp import UspAttention, new_usp_groups

        cp = group_size(group)
        u = cp if ulysses_degree is None else ulysses_degree
        if u < 1 or cp % u:
            raise ValueError(f"--ulysses-degree {u} must divide --cp {cp}; valid: {[d for d in range(1, cp + 1) if cp % d == 0]}")
        if group is None:
            return UspAttention(None, 1, None, None, query_rank)
        ulysses_group, ring_group = new_usp_groups(cp_groups or [dist.get_process_group_ranks(group)], u)
        return UspAttention(group, u, ulysses_group, ring_group, query_rank)
    if name == "star":
        from starshard.parallel.context.star import StarAttention

        return StarAttention(group, block_size=block_size, anchor_size=anchor_size, query_rank=query_rank,
                             num_blocks=num_blocks)
    raise ValueError(f"unknown --cp-strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
