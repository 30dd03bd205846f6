"""FP8 (e4m3) numerics: row quantization, dequantization and the FP8 linear.

    x8, scale = quantize_rows(x)                  # x ~= x8 * scale[..., None]; scale = amax(|row|) / 448
    y = fp8_linear(x, w8, w_scale, bias)          # x [.., K] @ (w8 [N, K] * w_scale [N, None]).T + bias
    y = scaled_mm(x8, x_scale, w8, w_scale, bias, dtype)   # the FP8 GEMM on pre-quantized rows (CUDA)

Scales are float32, one per row of the last dimension (a weight's output channel, an activation's
token, a cached key's (head, token)), chosen so the row's largest magnitude maps to e4m3's largest
finite value (448): nothing clips, and a row's bytes depend on that row alone.

fp8_linear on CUDA (FP8 tensor cores: compute capability >= 8.9):
- more than WEIGHT_ONLY_MAX_ROWS rows (prefill): each activation row is quantized by one Triton pass
  (amax, scale, cast), then `torch._scaled_mm` multiplies e4m3 x e4m3 with the row / channel scales;
- up to WEIGHT_ONLY_MAX_ROWS rows (decode): a weight-only Triton kernel reads the e4m3 weight once,
  converts each tile to bf16 in registers and multiplies the bf16 activations; the channel scale goes
  on the float32 accumulator. The whole matrix is never upcast in memory.
On CPU (and GPUs without FP8) the reference path dequantizes the weight, then multiplies; above
WEIGHT_ONLY_MAX_ROWS rows it first rounds the activations per row through e4m3, as the FP8 GEMM does.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from starshard.kernels.gemv import GEMV_MAX_ROWS, gemv

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch paths
    triton = None
    e4m3_scale = e4m3_values = None  # the Triton helpers below; importable names either way

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3 value
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later
# The prefill GEMM accumulates in the tensor cores' own accumulator (no periodic promotion to float32):
# the Llama-8B projections at 128K rows 54.4 -> 44.1 ms per layer on an H100, the 128K prefill with
# `linear,kv` 2.7% faster, for a product error of 0.21-0.33% instead of 0.17% of the exact e4m3 product (the
# operands' own e4m3 rounding is a few %); harness accuracy unchanged (bench/fp8_fast_accum.py,
# docs/results.md, FP8). STARSHARD_FP8_FAST_ACCUM=0 (read once per process) keeps the
# promoted accumulation.
FAST_ACCUM = os.environ.get("STARSHARD_FP8_FAST_ACCUM", "1") != "0"
WEIGHT_ONLY_MAX_ROWS = 64  # rows up to which fp8_linear reads weights only (decode); more: FP8 GEMM
# Up to this many rows the weight-only path is a GEMV per row (weights re-read per row, from L2 when the
# rows run together). Tiles by weight shape, one H200, one row, Llama-8B projections, each call reading
# its weight from HBM (bench/fp8_gemv_variants.py; docs/results.md, FP8; the
# 2026-11-23 sweep re-read the small weights from L2): long rows (w2, K 14336)
# 4 x 2048 with 4 warps 20.4 us; many rows (w13 N 28672, wqkv N 6144) 4 x 512 with 2 warps 33.5 / 10.1 us;
# the rest (wo) 4 x 1024 with 4 warps 7.7 us. Per layer 71.7 us against 73.7 us for the 2026-11-23 choice
# (4 x 1024 with 4 warps for every weight).
GEMV_LONG_ROWS = dict(block_n=4, block_k=2048, warps=4)  # K >= 8192
GEMV_MANY_ROWS = dict(block_n=4, block_k=512, warps=2)  # N >= 6144
GEMV_OTHER = dict(block_n=4, block_k=1024, warps=4)


def gemv_tile_for(N: int, K: int) -> dict:
    """The GEMV tile for an e4m3 weight [N, K] (the sweep above)."""
    if K >= 8192:
        return GEMV_LONG_ROWS
    if N >= 6144:
        return GEMV_MANY_ROWS
    return GEMV_OTHER


_TINY = 1e-12  # an all-zero row gets this amax, so its scale is not 0 (0 / 0 would be NaN)

log = logging.getLogger("starshard")


def fp8_support_error(device) -> str | None:
    """Why FP8 cannot run fast on `device` (None: it can, or it is the CPU, where the reference runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"--fp8 needs FP8 tensor cores (compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
                f"Ada L4/L40, Hopper H100/H200 or newer); {device} is {name} with compute capability "
                f"{cap[0]}.{cap[1]}, which has no e4m3 matmul or conversion; run without --fp8")
    return None


@functools.cache
def warn_cpu_reference() -> None:
    """Say once per process that FP8 on the CPU is the slow reference path."""
    log.warning("--fp8 on the CPU runs the slow reference path (dequantize, then matmul / attend in the compute "
                "dtype): right for tests, not for speed")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], float32 scales [...]) with x ~= x8 * scale[..., None]. On CUDA one
    Triton kernel (a decode step's KV write is then one launch, not ten); elsewhere torch ops."""
    if x.is_cuda and triton is not None and x.numel():
        y, s = quantize_rows_cuda(x.reshape(-1, x.shape[-1]))
        return y.view(x.shape), s.view(x.shape[:-1])
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(_TINY)
    scale = amax / E4M3_MAX
    x8 = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return x8, scale


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_rows, in `dtype` (float32 arithmetic, then one rounding). A contiguous e4m3 tensor
    on CUDA goes through one Triton pass (the same float32 product and rounding: the same bits, without the
    float32 temporary: an MoE layer's experts under --fp8 experts are ~10^9 values); elsewhere the scale is
    multiplied in place: one float32 temporary, not two (a prefill block's keys are ~10^8 values)."""
    if (x8.is_cuda and triton is not None and x8.dtype == FP8_DTYPE and x8.is_contiguous() and x8.numel()
            and scale.dtype == torch.float32):
        return dequantize_rows_cuda(x8, scale.contiguous(), dtype)
    x = x8.float() if x8.dtype != torch.float32 else x8.clone()
    return x.mul_(scale[..., None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias=None,
                         quantize_input: bool = False) -> torch.Tensor:
    """Dequantize the weight, then multiply in x's dtype (the CPU path; what the kernels approximate).
    quantize_input: first round x per row through e4m3 as the FP8 GEMM does (prefill-sized calls), so
    that CPU accuracy runs see the same activation rounding as the GPU."""
    if quantize_input:
        x = dequantize(*quantize_rows(x), x.dtype)
    return F.linear(x, dequantize(w8, w_scale, x.dtype), bias)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               *, weight_only: bool | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16) times an e4m3 weight w8 [N, K] with channel scales w_scale [N] (float32).
    `weight_only` forces the decode kernel (True) or the FP8 GEMM (False); default by row count.
    `residual` [..., N]: returns the product + residual (the decode GEMV adds it in its epilogue)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M = x2.shape[0]
    if weight_only is None:
        weight_only = M <= WEIGHT_ONLY_MAX_ROWS
    if x.device.type != "cuda":
        y = fp8_linear_reference(x, w8, w_scale, bias, quantize_input=not weight_only)
        return y if residual is None else y + residual
    if weight_only:
        y = weight_only_linear(x2, w8, w_scale, bias, residual=None if residual is None else residual.reshape(M, -1))
        return y.reshape(*shape[:-1], w8.shape[0])
    y = scaled_mm(*quantize_rows_cuda(x2), w8, w_scale, bias, x.dtype).reshape(*shape[:-1], w8.shape[0])
    return y if residual is None else y + residual


def scaled_mm(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 GEMM on activations already in e4m3: x8 [M, K] with row scales x_scale [M] times w8 [N, K]
    with channel scales w_scale [N] (+ bias) -> [M, N] in out_dtype (CUDA, FP8 tensor cores)."""
    # _scaled_mm takes the second operand column-major: w8 [N, K] row-major, transposed, is.
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=out_dtype,
                         use_fast_accum=FAST_ACCUM)
    return y if bias is None else y + bias


if triton is not None:

    # quantize_rows' numerics for the Triton kernels that quantize rows (here, kernels/activation.py,
    # kernels/kv_write.py): one definition, so every kernel stores the bytes the torch path stores.
    @triton.jit
    def e4m3_scale(amax):
        """The scale of a row whose largest magnitude is amax (an all-zero row gets _TINY / 448, not 0)."""
        return tl.maximum(amax, 1e-12) / 448.0

    @triton.jit
    def e4m3_values(x, scale):
        """x / scale clamped to e4m3's finite range, in float32, before the cast. A division, as the
        torch path (Triton's float32 division is not correctly rounded: 99.9% of bytes agree)."""
        return tl.minimum(tl.maximum(x / scale, -448.0), 448.0)

    @triton.jit
    def _quantize_rows_kernel(X, Y, S, K, s_xm, s_ym, BLOCK_K: tl.constexpr):
        """One row per program: amax over the row (first pass), then scale and cast (second pass, from L2)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(X + row * s_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = e4m3_scale(tl.max(amax, 0))
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            x = tl.load(X + row * s_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(Y + row * s_ym + k0 + offs, e4m3_values(x, scale).to(Y.dtype.element_ty), mask=ok)
        tl.store(S + row, scale)

    @triton.jit
    def _dequantize_rows_kernel(X, S, Y, D, BLOCK: tl.constexpr):
        """Y[row, block] = X[row, block] (e4m3 -> float32) * S[row], rounded once to Y's dtype."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < D
        x = tl.load(X + row * D + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + row * D + offs, (x * tl.load(S + row)).to(Y.dtype.element_ty), mask=ok)

    # Decode reads each weight byte once: many programs with long K tiles keep enough loads in flight.
    _WO_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in [(16, 256, 4, 4), (16, 512, 4, 4), (16, 1024, 4, 3), (16, 512, 8, 5), (32, 256, 4, 4),
                             (32, 512, 4, 3), (32, 512, 8, 4), (64, 256, 4, 3), (64, 128, 4, 4)]
    ]

    @triton.autotune(configs=_WO_CONFIGS, key=["N", "K", "BLOCK_M"])
    @triton.jit
    def _weight_only_kernel(X, W, S, BIAS, Y, M, N, K, s_xm, s_wn, s_ym,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """Y[M, N] = X[M, K] @ (W[N, K] as e4m3 -> X's dtype in registers).T * S[N] (+ BIAS)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = X + offs_m[:, None].to(tl.int64) * s_xm + offs_k[None, :]
        w_ptrs = W + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] tile of W.T
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(x, w.to(x.dtype), acc)
        acc = acc * tl.load(S + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + offs_m[:, None].to(tl.int64) * s_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def dequantize_rows_cuda(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize of a contiguous e4m3 tensor [..., D] with float32 scales [...] in one Triton pass."""
    D = x8.shape[-1]
    M = x8.numel() // D
    y = torch.empty(x8.shape, dtype=dtype, device=x8.device)
    block = min(2048, triton.next_power_of_2(D))
    _dequantize_rows_kernel[(M, triton.cdiv(D, block))](x8, scale, y, D, BLOCK=block, num_warps=4)
    return y


def quantize_rows_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of a 2-D tensor in one Triton kernel (one read of x, one e4m3 write)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](x, y, s, K, x.stride(0), y.stride(0), BLOCK_K=min(2048, triton.next_power_of_2(K)),
                                    num_warps=4)
    return y, s


def weight_only_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias=None,
                       gemv_tile: dict | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M small) times e4m3 w8 [N, K] with channel scales: the decode kernels (up to
    GEMV_MAX_ROWS rows the GEMV kernel, one program per (column slice, row); more rows the tensor-core
    tile kernel). gemv_tile: override the tile `gemv_tile_for` picks (tuning). residual [M, N]: returns
    the product + residual (the GEMV adds it in its epilogue, with torch's two roundings)."""
    if triton is None:
        raise RuntimeError("the FP8 weight-only kernel needs the triton package")
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = w8.shape[0]
    if M <= GEMV_MAX_ROWS:
        return gemv(x, w8, w_scale, bias, residual=residual, tile=gemv_tile or gemv_tile_for(N, K))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(min(M, WEIGHT_ONLY_MAX_ROWS)))

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, block_m))

    _weight_only_kernel[grid](x, w8, w_scale, bias if bias is not None else w_scale, y, M, N, K,
                              x.stride(0), w8.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m)
    return y if residual is None else y + residual
