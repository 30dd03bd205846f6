"""Collectives the context strategies share (one name across torch releases)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """Every rank's `inp` (contiguous, same shape everywhere) into `out`, rank-major: out is [world *
    inp.shape[0], *inp.shape[1:]] (gloo checks that shape; or 1-D [world * inp.numel()] for 1-D inp)."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns; 2.11 has only
    # it); looked up per call, so a wrapper installed on torch.distributed (tests count bytes) sees it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=async_op)


def all_gather_1d(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-D `x` (the same length everywhere) stacked in rank order: [world, x.numel()]."""
    world = dist.get_world_size(group)
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_into(out, x.contiguous(), group)
    return out.view(world, x.numel())
