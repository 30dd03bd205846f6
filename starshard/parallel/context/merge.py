"""Combine partial attention results over disjoint key sets by log-sum-exp (exact)."""
from __future__ import annotations

import torch


def merge_partials(out1, lse1, out2, lse2):
    """(out, lse) of attention over the union of two disjoint key sets.

    out*: [B, H, L, D], lse*: [B, H, L] float32. Rows empty in both stay out = 0, lse = -inf.
    """
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.nan_to_num(neginf=0.0)
    w1 = torch.exp(lse1 - safe).nan_to_num(nan=0.0).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).nan_to_num(nan=0.0).unsqueeze(-1)
    out = w1 * out1.float() + w2 * out2.float()
    return out.to(out1.dtype), lse
