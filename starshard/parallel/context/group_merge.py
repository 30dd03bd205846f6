"""Merge partial attention results held by every rank of a group (disjoint key sets) by lse."""
from __future__ import annotations

import torch
import torch.distributed as dist


def merge_over_group(out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, L, D], lse [B, H, L] float32 on each rank -> the merged (out, lse) on every rank.

    One all-reduce of the max lse, then one of the weighted sums (numerator and denominator packed
    into one tensor). Rows empty on every rank stay out = 0, lse = -inf. group=None: a single rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return out, lse
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m_safe = m.nan_to_num(neginf=0.0)
    w = torch.exp(lse - m_safe)  # 0 for ranks whose rows saw nothing
    packed = torch.cat([out.float() * w.unsqueeze(-1), w.unsqueeze(-1)], dim=-1)
    dist.all_reduce(packed, group=group)
    num, den = packed[..., :-1], packed[..., -1]
    merged = torch.where(den.unsqueeze(-1) > 0, num / den.clamp_min(1e-30).unsqueeze(-1), torch.zeros_like(num))
    return merged.to(out.dtype), torch.where(den > 0, m_safe + torch.log(den), torch.full_like(den, float("-inf")))
