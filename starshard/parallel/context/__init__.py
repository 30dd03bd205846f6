"""Context strategies: how a CP group shares one sequence. All implement ContextStrategy (base.py)."""
from __future__ import annotations

import torch.distributed as dist

from starshard.parallel.context.apb import APBAttention
from starshard.parallel.context.base import ContextStrategy, group_size
from starshard.parallel.context.dense import DenseContext
from starshard.parallel.context.ring import RingAttention
from starshard.parallel.context.star import StarAttention
from starshard.parallel.context.ulysses import UlyssesAttention
from starshard.parallel.context.usp import UspAttention, new_usp_groups

STRATEGIES = ("dense", "ring", "ulysses", "usp", "star", "apb")

# APB-only options: ParallelConfig field (= make_strategy keyword) -> the CLI flag that sets it.
APB_OPTIONS = {"passing_size": "--passing-size", "compressor": "--compressor", "compressor_path": "--compressor-path",
               "embed_query": "--no-embed-query", "prefix_len": "--prefix-len", "apb_hosts": "--apb-hosts"}


def apb_options(parallel) -> dict:
    """The APB keywords a ParallelConfig sets (None = the strategy's default)."""
    return {k: getattr(parallel, k) for k in APB_OPTIONS if getattr(parallel, k, None) is not None}


def strategy_options(parallel) -> dict:
    """make_strategy's keywords from a ParallelConfig: the sizes every strategy reads, plus the APB
    options it sets."""
    return dict(block_size=parallel.block_size, anchor_size=parallel.anchor_size, query_rank=parallel.query_rank,
                ulysses_degree=parallel.ulysses_degree, num_blocks=parallel.num_blocks, **apb_options(parallel))


def make_strategy(name: str, group=None, *, block_size=None, anchor_size=None, query_rank=None,
                  ulysses_degree=None, cp_groups=None, num_blocks=None, tp_group=None, **apb) -> ContextStrategy:
    """The strategy `name` over `group` (None = a single rank).

    apb: the APB_OPTIONS keywords (refused for other strategies) and `tp_group` (retaining heads);
    `num_blocks` (--num-blocks) is the same as apb_hosts (--apb-hosts) for APB.

    usp: `ulysses_degree` (default: the whole CP group, i.e. plain Ulysses) and `cp_groups`, every CP
    group of the world as global ranks (its subgroups are created collectively on every rank)."""
    unknown = [k for k in apb if k not in APB_OPTIONS]
    if unknown:
        raise TypeError(f"make_strategy() got unexpected keyword(s) {', '.join(unknown)}")
    apb = {k: v for k, v in apb.items() if v is not None}
    if apb and name != "apb":
        flags = ", ".join(APB_OPTIONS[k] for k in apb)
        raise ValueError(f"{flags} only apply to --cp-strategy apb (got {name}); drop them or use --cp-strategy apb")
    if name == "dense":
        return DenseContext(group, query_rank)
    if name == "ring":
        return RingAttention(group, query_rank)
    if name == "ulysses":
        return UlyssesAttention(group, query_rank)
    if name == "usp":
        cp = group_size(group)
        u = cp if ulysses_degree is None else ulysses_degree
        if u < 1 or cp % u:
            raise ValueError(f"--ulysses-degree {u} must divide --cp {cp}; valid: {[d for d in range(1, cp + 1) if cp % d == 0]}")
        if group is None:
            return UspAttention(None, 1, None, None, query_rank)
        ulysses_group, ring_group = new_usp_groups(cp_groups or [dist.get_process_group_ranks(group)], u)
        return UspAttention(group, u, ulysses_group, ring_group, query_rank)
    if name == "star":
        return StarAttention(group, block_size=block_size, anchor_size=anchor_size, query_rank=query_rank,
                             num_blocks=num_blocks)
    if name == "apb":
        if block_size is not None:
            raise ValueError("--block-size is Star's; APB splits the context evenly over the hosts (--cp, or "
                             "--apb-hosts with --cp 1): drop --block-size")
        hosts = apb.get("apb_hosts")
        if num_blocks is not None and hosts is not None and num_blocks != hosts:
            raise ValueError(f"--num-blocks {num_blocks} and --apb-hosts {hosts} disagree; for APB they are the "
                             "same setting: give one")
        return APBAttention(group, anchor_size=anchor_size, passing_size=apb.get("passing_size"),
                            compressor=apb.get("compressor", "query"), embed_query=apb.get("embed_query", True),
                            query_rank=query_rank, prefix_len=apb.get("prefix_len"),
                            compressor_path=apb.get("compressor_path"), tp_group=tp_group,
                            num_blocks=hosts if hosts is not None else num_blocks)
    raise ValueError(f"unknown --cp-strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
