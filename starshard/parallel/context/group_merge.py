"""Merge partial attention results held by every rank of a group (disjoint key sets) by lse."""
from __future__ import annotations

import torch
import torch.distributed as dist

from starshard.kernels.merge import merge_stacked
from starshard.parallel.context.collectives import all_gather_into


def merge_over_group(out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, L, D], lse [B, H, L] float32 on each rank -> the merged (out, lse) on every rank.

    One all-gather of every rank's (out, lse) packed in float32, then the merge on each rank
    (`merge_stacked`: one launch on CUDA). Before: an all-reduce of the max lse, then one of the weighted
    sums, and about a dozen small kernels around them, per layer of every decode step. Rows empty on
    every rank stay out = 0, lse = -inf. group=None: a single rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return out, lse
    packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)
    cp = dist.get_world_size(group)
    gathered = packed.new_empty((cp * packed.shape[0],) + packed.shape[1:])  # gloo wants ranks along dim 0
    all_gather_into(gathered, packed, group)
    return merge_stacked(gathered.view((cp,) + packed.shape), out.dtype)
