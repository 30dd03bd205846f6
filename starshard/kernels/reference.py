"""Attention in plain torch, float32 (float64 for float64 inputs), any device: the dispatcher's
fallback and the per-split step of decode.py's torch path. Same (out, lse) contract as `attention`."""
from __future__ import annotations

import torch

from starshard.kernels.common import check_extras, check_shapes

# Query rows per chunk: bounds the [Hq, rows, Lk] float32 score buffer.
_MATH_SCORE_BUDGET = 1 << 26  # elements (256 MiB in float32)


def attention_math(q, k, v, *, q_pos, k_pos, causal=True, scale=None, window=None, softcap=None, sinks=None):
    """Reference path in float32 (float64 if given float64): plain torch, any device. `window`,
    `softcap`, `sinks` as in the attention.py contract."""
    check_shapes(q, k, v)
    check_extras(q, causal, window, softcap, sinks, "attention_math")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf, vf = k.to(acc), v.to(acc)
    out = torch.empty(B, Hq, Lq, D, dtype=acc, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    rows = max(1, _MATH_SCORE_BUDGET // max(1, Hq * Lk))
    q_pos = q_pos if q_pos.dim() == 2 else q_pos.unsqueeze(0)  # [1|B, Lq]
    k_pos = k_pos if k_pos.dim() == 2 else k_pos.unsqueeze(0)  # [1|B, Lk]
    for s in range(0, Lq, rows):
        e = min(Lq, s + rows)
        qc = q[:, :, s:e].to(acc).view(B, Hkv, g, e - s, D)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qc, kf) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if causal:
            visible = k_pos[:, None, :] <= q_pos[:, s:e, None]  # [1|B, rows, Lk]
            if window is not None:
                visible = visible & (k_pos[:, None, :] > q_pos[:, s:e, None] - window)
            scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        m = torch.logsumexp(scores, dim=-1, keepdim=True)
        p = torch.exp(scores - m.nan_to_num(neginf=0.0))  # exp(-inf) = 0 keeps empty rows at 0
        p = torch.where(torch.isneginf(m), torch.zeros_like(p), p)
        out[:, :, s:e] = torch.einsum("bhgqk,bhkd->bhgqd", p, vf).reshape(B, Hq, e - s, D)
        lse[:, :, s:e] = m.squeeze(-1).reshape(B, Hq, e - s).float()
    if sinks is not None:
        out *= torch.sigmoid(lse.to(acc) - sinks.to(device=q.device, dtype=acc)[None, :, None]).unsqueeze(-1)
    return out.to(q.dtype), lse
