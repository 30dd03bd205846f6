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
