"""RoPE on q and k in one Triton launch, with Qwen3's per-head RMSNorm fused in front.

    q_rot, k_rot = rope_qk(q, k, cos, sin)                      # Llama, Mistral, Qwen2, Phi-3
    q_rot, k_rot = rope_qk(q, k, cos, sin, q_w, k_w, eps)       # Qwen3: rms_norm per head, then RoPE

q [B, Hq, L, D] and k [B, Hkv, L, D] may have any strides (the attention layer passes transposed views of
its fused qkv projection); the outputs are new contiguous tensors of the same shapes, as torch.cat gave
before. cos / sin: [L, R/2] or [B, L, R/2]; rotate-half (HF layout) over the first R = 2 * cos.shape[-1]
dims of each head, the other D - R pass through (partial rotary).

Why: the torch path (apply_rope below: chunk, four multiplies, cat) is ~8 strided elementwise
kernels per layer for q and k, 0.49 ms of a 5.1 ms Llama-8B FP8 decode step on an H200 and 0.64 of 6.3 ms
of a Qwen3-MoE step (which also runs two norm launches per layer). Here one program holds one token's
block of heads in registers: decode (one token, ~40 heads) is a handful of programs, prefill one pass
over q and k in memory.

Numerics: float32 math throughout (norm as kernels/norm.py, weight multiplied in float32, then the
rotation with cos / sin as given), one rounding to the input dtype at the end; `rope_qk_reference` is
the same in torch.
"""
from __future__ import annotations

import torch

from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch path
    triton = None

_MAX_HEAD_DIM = 1024  # one head per row of registers


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, L, D]; cos/sin: [L, R/2] (or [B, L, R/2]) in x's dtype (angles are computed in
    float32 first). Rotate-half convention (HF layout) over the first R dimensions of each head
    (R = D, or less with a partial rotary factor); the rest pass unchanged. The model's torch path
    (CPU) and this module's reference."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    if 2 * r == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2, rest = x[..., :r], x[..., r : 2 * r], x[..., 2 * r :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rope_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's math in torch: float32 (float64 stays float64), one rounding at the end."""
    def one(x, w):
        xf = x.float() if x.dtype != torch.float64 else x
        if w is not None:  # as kernels/norm.py rms_norm_reference, without its rounding
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(xf.dtype)
        return apply_rope(xf, cos.to(xf.dtype), sin.to(xf.dtype)).to(x.dtype).contiguous()

    return one(q, q_norm_weight), one(k, k_norm_weight)


if triton is not None:

    @triton.jit
    def _rope_heads(X, Y, W, COS, SIN, b, l, cos_off, s_cd, h0, H, HALF, D, eps,
                    s_xb, s_xh, s_xl, s_xd, s_yb, s_yh, s_yl,
                    NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
        """Heads h0 .. h0 + BLOCK_H of one token (b, l): [x1 | x2 | rest] per head, x1 / x2 of HALF dims."""
        h = h0 + tl.arange(0, BLOCK_H)
        j = tl.arange(0, BLOCK_HALF)
        ok_h = h < H
        ok = ok_h[:, None] & (j < HALF)[None, :]
        x_row = X + b * s_xb + l * s_xl + h[:, None].to(tl.int64) * s_xh
        y_row = Y + b * s_yb + l * s_yl + h[:, None].to(tl.int64) * s_yh
        x1 = tl.load(x_row + j[None, :] * s_xd, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + (HALF + j[None, :]) * s_xd, mask=ok, other=0.0).to(tl.float32)
        if BLOCK_REST > 0:  # partial rotary: dims 2 * HALF .. D pass through (and count in the norm)
            r = tl.arange(0, BLOCK_REST)
            ok_r = ok_h[:, None] & (r < D - 2 * HALF)[None, :]
            xr = tl.load(x_row + (2 * HALF + r[None, :]) * s_xd, mask=ok_r, other=0.0).to(tl.float32)
        if NORM:
            ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
            if BLOCK_REST > 0:
                ss += tl.sum(xr * xr, 1)
            inv = (1.0 / tl.sqrt(ss / D + eps))[:, None]
            x1 = x1 * inv * tl.load(W + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
            x2 = x2 * inv * tl.load(W + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
            if BLOCK_REST > 0:
                xr = xr * inv * tl.load(W + 2 * HALF + r, mask=r < D - 2 * HALF, other=0.0).to(tl.float32)[None, :]
        c = tl.load(COS + cos_off + j * s_cd, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        s = tl.load(SIN + cos_off + j * s_cd, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        ty = Y.dtype.element_ty
        tl.store(y_row + j[None, :], (x1 * c - x2 * s).to(ty), mask=ok)
        tl.store(y_row + HALF + j[None, :], (x2 * c + x1 * s).to(ty), mask=ok)
        if BLOCK_REST > 0:
            tl.store(y_row + 2 * HALF + r[None, :], xr.to(ty), mask=ok_r)

    @triton.jit
    def _rope_qk_kernel(Q, K, QO, KO, QW, KW, COS, SIN, L, HQ, HKV, HALF, D, eps,
                        s_qb, s_qh, s_ql, s_qd, s_kb, s_kh, s_kl, s_kd,
                        s_qob, s_qoh, s_qol, s_kob, s_koh, s_kol, s_cb, s_cl, s_cd,
                        NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (B * L, q head blocks + k head blocks): one token's block of q or k heads per program."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        b, l = t // L, t % L
        cos_off = b * s_cb + l * s_cl
        q_blocks = tl.cdiv(HQ, BLOCK_HQ)
        if hb < q_blocks:
            _rope_heads(Q, QO, QW, COS, SIN, b, l, cos_off, s_cd, hb * BLOCK_HQ, HQ, HALF, D, eps,
                        s_qb, s_qh, s_ql, s_qd, s_qob, s_qoh, s_qol,
                        NORM, BLOCK_HQ, BLOCK_HALF, BLOCK_REST)
        else:
            _rope_heads(K, KO, KW, COS, SIN, b, l, cos_off, s_cd, (hb - q_blocks) * BLOCK_HK, HKV, HALF, D, eps,
                        s_kb, s_kh, s_kl, s_kd, s_kob, s_koh, s_kol,
                        NORM, BLOCK_HK, BLOCK_HALF, BLOCK_REST)


def use_rope_kernel(x: torch.Tensor) -> bool:
    """Whether `rope_qk` runs for x (q or k): a CUDA tensor with Triton installed and heads that fit a program."""
    return x.is_cuda and triton is not None and x.shape[-1] <= _MAX_HEAD_DIM


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
            eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(Per-head RMSNorm, then) RoPE on q [B, Hq, L, D] and k [B, Hkv, L, D] in one Triton launch
    (CUDA, or the interpreter on CPU). No host sync: safe under CUDA-graph capture."""
    if triton is None:
        raise RuntimeError("rope_qk: the Triton kernel needs the triton package")
    B, HQ, L, D = q.shape
    HKV = k.shape[1]
    half = cos.shape[-1]
    if k.shape != (B, HKV, L, D) or not 0 < 2 * half <= D or D > _MAX_HEAD_DIM:
        raise ValueError(f"rope_qk: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope_qk: give both q and k norm weights or neither")
    # [L, R/2] broadcasts over the batch: a stride-0 batch dim. sin is read with cos's strides.
    cos, sin = cos.expand(B, L, half), sin.expand(B, L, half)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if qo.numel() == 0:
        return qo, ko
    norm = q_norm_weight is not None
    block_half = triton.next_power_of_2(half)
    block_rest = 0 if 2 * half == D else triton.next_power_of_2(D - 2 * half)
    block_d = 2 * block_half + block_rest
    # Decode (few tokens): small head blocks, more programs in flight; prefill: ~2K elements a program.
    per_program = 512 if B * L <= 64 else 2048
    heads = triton.next_power_of_2(max(1, per_program // block_d) + 1) // 2  # a power of 2 that fits
    block_hq, block_hk = min(triton.next_power_of_2(HQ), heads), min(triton.next_power_of_2(HKV), heads)
    grid = (B * L, triton.cdiv(HQ, block_hq) + triton.cdiv(HKV, block_hk))
    _rope_qk_kernel[grid](
        q, k, qo, ko, q_norm_weight if norm else q, k_norm_weight if norm else k, cos, sin,
        L, HQ, HKV, half, D, eps,
        *q.stride(), *k.stride(), *qo.stride()[:3], *ko.stride()[:3], *cos.stride(),
        NORM=norm, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        num_warps=4 if block_hq * block_d >= 2048 else 2, **pdl_launch(q))
    return qo, ko
