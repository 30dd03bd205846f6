"""Attention dispatcher. Every entry point returns (out, lse) per the DESIGN.md contract.

    out, lse = attention(q, k, v, q_pos=..., k_pos=..., causal=True, scale=None, sparse=None)
    q: [B, Hq, Lq, D]   k, v: [B, Hkv, Lk, D]   q_pos: [Lq] or [B, Lq]   k_pos: [Lk] or [B, Lk]
    out: [B, Hq, Lq, D] in q.dtype     lse: [B, Hq, Lq] float32

Causality is by global position (key visible iff k_pos <= q_pos), so a query block may sit anywhere
relative to its keys. Rows that see no key get out = 0 and lse = -inf.
"""
from __future__ import annotations

import torch

# Query rows per chunk on the math path: bounds the [Hq, rows, Lk] float32 score buffer.
_MATH_SCORE_BUDGET = 1 << 26  # elements (256 MiB in float32)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D [B, H, L, D] tensors, got q{tuple(q.shape)} k{tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"batch/head_dim mismatch: q{tuple(q.shape)} k{tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"GQA needs Hq % Hkv == 0, got Hq={q.shape[1]} Hkv={k.shape[1]}")


def attention_math(q, k, v, *, q_pos, k_pos, causal=True, scale=None):
    """Reference path in float32 (float64 if given float64): plain torch, any device."""
    _check(q, k, v)
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
        if causal:
            visible = k_pos[:, None, :] <= q_pos[:, s:e, None]  # [1|B, rows, Lk]
            scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        m = torch.logsumexp(scores, dim=-1, keepdim=True)
        p = torch.exp(scores - m.nan_to_num(neginf=0.0))  # exp(-inf) = 0 keeps empty rows at 0
        p = torch.where(torch.isneginf(m), torch.zeros_like(p), p)
        out[:, :, s:e] = torch.einsum("bhgqk,bhkd->bhgqd", p, vf).reshape(B, Hq, e - s, D)
        lse[:, :, s:e] = m.squeeze(-1).reshape(B, Hq, e - s).float()
    return out.to(q.dtype), lse


def attention(q, k, v, *, q_pos, k_pos, causal=True, scale=None, sparse=None):
    """Exact (or `sparse`-approximate) attention with log-sum-exp. See the module docstring."""
    if sparse is not None:
        raise NotImplementedError("sparse attention kernels are not available in this build")
    if q.device.type == "cuda" and q_pos.dim() == 1 and q.dtype != torch.float64:
        from starshard.kernels.cuda import attention_cuda

        _check(q, k, v)
        return attention_cuda(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and q_pos.dim() == 1:
        from starshard.kernels.cpu import attention_cpu

        _check(q, k, v)
        return attention_cpu(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
    return attention_math(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
