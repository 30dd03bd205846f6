"""Decode GEMV: a few rows times a weight (Triton, CUDA or the interpreter).

    y = gemv(x, w)                                   # x [M, K] @ w [N, K].T, M <= GEMV_MAX_ROWS
    y = gemv(x, w8, scale, bias, residual=r)         # e4m3 w8 with channel scales (kernels/fp8.py), + bias, + r

One program per (BLOCK_N output columns, row) walks K in BLOCK_K tiles, converts the weight tile to
float32 in registers and sums the products per column: no tensor cores, for a handful of rows the
weight bytes are all the work. Rows run as separate programs (a weight tile is re-read per row, from L2
when they run together). The weight is e4m3 (an FP8 projection, `scale` its channel scales) or
16-bit (bf16 / fp16, the model's own projections).

16-bit weights (`use_gemv`: one row, engine/linear.py Linear): cuBLAS's one-row GEMV read a 16 MB projection at
1.55-2.0 TB/s on an H100 where this kernel reads it at 1.8-2.4; the lm_head 370 -> 337 us (Llama-8B),
the Qwen3-MoE router 4.8 -> 2.6 us (bench/bf16_gemv_probe.py; docs/results.md, Decode). On an
H200 the router and small projections gain as much, the wide ones lose up to 9% (see GEMV_16BIT_TILE).
`residual`: + residual after the product is rounded to y's dtype, as `linear(x) + residual` rounds in
torch: the block's residual add without a kernel of its own (engine/linear.py project_add).
"""
from __future__ import annotations

import torch

from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep F.linear
    triton = None

GEMV_MAX_ROWS = 4  # rows up to which a GEMV per row beats a tensor-core tile (weights re-read per row from L2)
# Within 3% of the best 1024-wide tile on every probed shape on an H100; on an H200 up to 9% behind cuBLAS on wide
# projections (Llama-8B wqkv, w13) while ahead on small ones (docs/results.md, Decode).
GEMV_16BIT_TILE = dict(block_n=4, block_k=1024, warps=4)
# Where K is 4096 or more, or the weight has few rows (a router), a program requests up to 4096 columns at once:
# on an H100 Qwen3-30B-A3B's wo 7.87 -> 6.55 us, router 1.78 -> 1.50, Llama-8B's wqkv 20.2 -> 17.6, w2 41.4 ->
# 39.5; at K = 2048 with many rows (Qwen3-30B-A3B's wqkv) the 1024-wide tile stays ahead (7.78 vs 8.26 us)
# (docs/results.md, Decode; not measured on an H200).
GEMV_16BIT_MAX_BLOCK_K = 4096
GEMV_FEW_ROWS = 1024
# 16-bit weights take the GEMV for one row only: that is what was measured against cuBLAS; with more rows
# (batched decode) cuBLAS reads the weight once for all of them, the GEMV once per row.
GEMV_16BIT_MAX_ROWS = 1


def gemv_16bit_tile(N: int, K: int) -> dict:
    """The tile `gemv` takes for a 16-bit weight [N, K] when none is given: GEMV_16BIT_TILE, its K width raised
    to K's power of two (at most GEMV_16BIT_MAX_BLOCK_K) where K >= 4096 or N < GEMV_FEW_ROWS."""
    if K >= 4096 or N < GEMV_FEW_ROWS:
        wide = min(GEMV_16BIT_MAX_BLOCK_K, 1 << max(0, K - 1).bit_length())
        return dict(GEMV_16BIT_TILE, block_k=max(GEMV_16BIT_TILE["block_k"], wide))
    return GEMV_16BIT_TILE


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a 16-bit linear of x [.., K] by weight [N, K] goes to `gemv`: CUDA, at most GEMV_16BIT_MAX_ROWS
    rows, x and the weight in the same 16-bit dtype, the weight's rows contiguous."""
    return (x.is_cuda and triton is not None and weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == weight.dtype and weight.stride(-1) == 1 and x.shape[-1] == weight.shape[1]
            and x.numel() <= GEMV_16BIT_MAX_ROWS * x.shape[-1])


if triton is not None:

    @triton.jit
    def _gemv_kernel(X, W, S, BIAS, RES, Y, N, K, s_xm, s_wn, s_rm, s_ym, HAS_SCALE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
        """Y[m, n-slice] = sum_k W[n, k] (-> float32) * X[m, k] (* S[n]) (+ BIAS) (+ RES[m, n-slice], after
        rounding the product to Y's dtype). USE_PDL: the first weight tile is loaded while the kernel ahead
        still runs (weights are no kernel's output), the rest after pdl_wait."""
        pdl_trigger(USE_PDL)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1).to(tl.int64)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = W + offs_n[:, None].to(tl.int64) * s_wn
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        x = tl.load(X + m * s_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            x = tl.load(X + m * s_xm + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_SCALE:
            acc = acc * tl.load(S + offs_n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_RES:
            acc = acc.to(Y.dtype.element_ty).to(tl.float32) + tl.load(RES + m * s_rm + offs_n, mask=n_ok,
                                                                      other=0.0).to(tl.float32)
        tl.store(Y + m * s_ym + offs_n, acc.to(Y.dtype.element_ty), mask=n_ok)


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
         residual: torch.Tensor | None = None, tile: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) @ w [N, K].T (* scale [N], float32) (+ bias [N]) (+ residual [M, N])
    -> [M, N] in x's dtype. tile: dict(block_n=, block_k=, warps=) (`gemv_16bit_tile` if not given)."""
    if triton is None:
        raise RuntimeError("gemv needs the triton package")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: expected x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    if M > GEMV_MAX_ROWS:
        raise ValueError(f"gemv: {M} rows; it is for at most {GEMV_MAX_ROWS} (use a GEMM)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous")
    if residual is not None and (residual.shape != (M, N) or residual.stride(-1) != 1):
        residual = residual.reshape(M, N).contiguous()
    t = tile or gemv_16bit_tile(N, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        _gemv_kernel[(triton.cdiv(N, t["block_n"]), M)](
            x, w, scale if scale is not None else y, bias if bias is not None else y,
            residual if residual is not None else y, y, N, K,
            x.stride(0), w.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
            HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], num_warps=t["warps"], **pdl_launch(x))
    return y
