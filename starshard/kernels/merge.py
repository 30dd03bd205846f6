"""Combine two partial attention results over disjoint key sets by log-sum-exp (exact).

Every split of one query block's keys merges here: ring steps and APB's passing blocks
(parallel/context, which re-exports it), the service's cascade (runtime/cascade.py), and a chunked
prefill's stored FP8 prefix with the chunk's own keys (engine/model.py dense_attend). The split-KV
decode kernel's S-way merge of float32 partials is decode.py's own.
"""
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
    # w1 * out1 + w2 * out2 in float32, in place on fresh copies: two float32 [.., D] buffers alive, not four
    out = out1.to(torch.float32, copy=True).mul_(w1)
    out.add_(out2.to(torch.float32, copy=True).mul_(w2))
    return out.to(out1.dtype), lse
