"""RMSNorm as one Triton kernel for few rows (decode).

    y = rms_norm(x, weight, eps)      # x [..., D] -> x * rsqrt(mean(x^2) + eps) * weight, float32 math

torch's fused CUDA RMSNorm (F.rms_norm) takes ~6 us for a single 4096-wide row on an H200 (one block
reducing in two passes; docs/results.md, Decode): ~65 calls per Llama-8B decode
step and ~190 per Qwen3-MoE step (its per-head q / k norms). This kernel puts several short rows in one
program and a whole row in registers. The runtime uses it for up to NORM_MAX_ROWS rows on the GPU and
keeps F.rms_norm above (prefill rows are bandwidth-bound, where torch's kernel is fine).
Numerics match F.rms_norm: float32 sum of squares, weight multiplied in float32, one rounding.
"""
from __future__ import annotations

import torch

from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch path
    triton = None

NORM_MAX_ROWS = 64  # rows of up to this many (B x L x heads) go through the kernel on CUDA
_MAX_WIDTH = 16384  # one row in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The float32 math of the kernel in torch."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, Y, rows, D, s_xm, s_ym, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        ok = (r < rows)[:, None] & (d < D)[None, :]
        w = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)  # a weight: no kernel's output
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        x = tl.load(X + r[:, None].to(tl.int64) * s_xm + d[None, :], mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
        y = x * inv[:, None] * w[None, :]
        tl.store(Y + r[:, None].to(tl.int64) * s_ym + d[None, :], y.to(Y.dtype.element_ty), mask=ok)


def use_norm_kernel(x: torch.Tensor) -> bool:
    """Whether `rms_norm` is the faster choice for x: a CUDA tensor of few, not too wide rows."""
    return (x.is_cuda and triton is not None and x.shape[-1] <= _MAX_WIDTH
            and x.numel() <= NORM_MAX_ROWS * x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one Triton launch (CUDA, or the interpreter on CPU)."""
    if triton is None:
        raise RuntimeError("rms_norm: the Triton kernel needs the triton package")
    D = x.shape[-1]
    if D > _MAX_WIDTH:
        raise ValueError(f"rms_norm: rows of {D} do not fit one program (at most {_MAX_WIDTH}); use F.rms_norm")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(16, 2048 // block_d))  # short rows (per-head norms): several per program
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, block_r),)](x2, weight, y, rows, D, x2.stride(0), y.stride(0), eps,
                                                        BLOCK_R=block_r, BLOCK_D=block_d,
                                                        num_warps=4 if block_d * block_r >= 2048 else 2,
                                                        **pdl_launch(x))
    return y.view(x.shape)
