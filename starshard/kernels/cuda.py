"""CUDA attention through torch's fused kernels that return logsumexp (cuDNN, flash, efficient).

The position mask is classified first: no mask ("full"), plain causal (q and k hold the same
increasing positions: index-causal), or a general mask (efficient kernel with an additive bias).
`STARSHARD_ATTN_BACKEND=cudnn|flash` picks the kernel for the first two (default cudnn: the fastest
measured on H100/H200); short query blocks (decode) always use flash.
"""
from __future__ import annotations

import os

import torch

_BIAS_BUDGET = 1 << 28  # elements of the additive bias per chunk of query rows


def classify(q_pos, k_pos, causal: bool) -> str:
    if not causal:
        return "full"
    if q_pos.shape == k_pos.shape and (q_pos is k_pos or bool(torch.equal(q_pos, k_pos))):
        if q_pos.numel() < 2 or bool((q_pos[1:] > q_pos[:-1]).all()):
            return "causal"
    if bool(k_pos.max() <= q_pos.min()):
        return "full"  # every key precedes every query (decode, query phases)
    return "masked"


# cuDNN builds an execution plan per shape; decode changes the key length every step, so short
# query blocks go to the flash kernel, which needs no plan.
_SHORT_QUERY_ROWS = 256


def _fused(q, k, v, is_causal: bool, scale):
    backend = os.environ.get("STARSHARD_ATTN_BACKEND", "cudnn")
    if q.shape[2] <= _SHORT_QUERY_ROWS:
        backend = "flash"
    B, H, L, _ = q.shape
    if backend == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)
    elif backend == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    else:
        raise ValueError(f"STARSHARD_ATTN_BACKEND must be cudnn or flash, got {backend!r}")
    return r[0], r[1].reshape(B, H, -1)[:, :, :L].float()


def attention_cuda(q, k, v, *, q_pos, k_pos, causal=True, scale=None):
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    mode = classify(q_pos, k_pos, causal)
    fused_ok = q.dtype in (torch.float16, torch.bfloat16) and D <= 128
    if mode == "full" and fused_ok and g > 1:
        # No mask: a KV head's g query heads are just more rows over the same keys, so fold them
        # into the row dimension instead of copying K/V g times (decode reads the cache once).
        qf = q.reshape(B, Hkv, g * Lq, D)
        out, lse = _fused(qf, k, v, False, scale)
        return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)
    if g > 1:  # the fused kernels want equal head counts
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    if mode != "masked" and fused_ok:
        return _fused(q, k, v, mode == "causal", scale)
    outs, lses = [], []
    rows = max(1, _BIAS_BUDGET // max(1, k.shape[2]))
    for s in range(0, Lq, rows):
        qp = q_pos[s : s + rows]
        visible = k_pos[None, :] <= qp[:, None] if causal else torch.ones(len(qp), k.shape[2], dtype=torch.bool, device=q.device)
        Lk = k.shape[2]
        # The efficient kernel wants the bias rows 16-element aligned: pad, then view the real part.
        bias = torch.zeros(len(qp), -(-Lk // 16) * 16, dtype=q.dtype, device=q.device)[:, :Lk]
        bias.masked_fill_(~visible, float("-inf"))
        o, l, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q[:, :, s : s + rows], k, v, bias.expand(B, Hq, *bias.shape), True, 0.0, False, scale=scale)
        l = l[:, :, : o.shape[2]].float()
        empty = ~visible.any(-1)  # rows that see no key: out 0, lse -inf
        o = o.masked_fill(empty[None, None, :, None], 0.0)
        l = l.masked_fill(empty[None, None, :], float("-inf"))
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
