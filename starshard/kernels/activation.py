"""FP8 activation quantization fused into the op that produces the activation (prefill, issue 19).

    x8, scale = rms_norm_quant(x, weight, eps)   # = quantize_rows(rms_norm(x, weight, eps)), one kernel
    a8, scale = silu_mul_quant(gate_up)          # = quantize_rows(silu(gate) * up), gate_up = [gate | up]
    a = silu_mul(gate_up)                        # SwiGLU's activation (CUDA decode rows, long prefills: one launch)
    a = gelu_tanh_mul(gate_up)                   # GeGLU's (Gemma), torch ops
    o8, scale = quantize_heads(o)                # = quantize_rows(o [B, H, L, D] as rows [B * L, H * D])

Why: a prefill FP8 GEMM (torch._scaled_mm, kernels/fp8.py) takes its activations in e4m3 with one
scale per row. Unfused, the norm reads the hidden state and writes it in bf16, then quantize_rows reads
that and writes e4m3; before w2, silu and the multiply are two more passes over [tokens, 2F]. Each
kernel here reads its input once and writes e4m3 once (plus a float32 scale per row). Attention's output
reaches wo as [B, H, L, D]: unfused, the transposing copy into rows [B * L, H * D] reads and writes it in
bf16 before quantize_rows reads it again (1.7 + 0.6 ms per layer at 128K tokens on an H100);
quantize_heads reads the heads' layout itself.

Numerics: float32 math, then the row is rounded once to the input's dtype -- what the unfused norm
(F.rms_norm, kernels/norm.py) or a one-rounding silu-mul would have written -- and quantized exactly as
quantize_rows does (amax / 448, division, clamp, cast). So the e4m3 bytes are those of quantizing the
unfused op's output: fusing changes the time, not the numbers (up to the last bit of the float32
sum of squares, whose order differs from torch's). The rounding is free and keeps fused and unfused
runs comparable; skipping it would make the fused path slightly more accurate and not reproducible
against the unfused one. (Eager torch's silu-mul rounds twice, after silu and after the multiply; the
fused kernel rounds once, which the *_reference functions state.)

Row widths: a row of up to ONE_TILE_MAX columns (padded to a power of two) is held in registers, one
read from memory. Wider rows (Llama-8B's SwiGLU: 14336 columns on one GPU) loop over tiles: a pass for
the amax (and, for the norm, one before it for the sum of squares), then the scale-and-cast pass,
which re-reads the row mostly from L2, as kernels/fp8.py's _quantize_rows_kernel does.
bench/fp8_prefill_fused.py times both layouts (`tile=`).

Tests run the kernels under TRITON_INTERPRET=1 with `out_dtype=torch.float32`: the interpreter's
e4m3 conversion drops the carry when a value rounds up across a power of two (31.06 -> 16, not 32),
so they check the scaled, clamped values and cast with torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from starshard.kernels.fp8 import FP8_DTYPE, WEIGHT_ONLY_MAX_ROWS, e4m3_scale, e4m3_values, quantize_rows
from starshard.kernels.norm import rms_norm_reference
from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch paths
    triton = None

# Padded row widths up to this stay in registers (one read); wider rows loop over tiles. 16384 (16 warps)
# covers Llama-8B's 14336-wide SwiGLU on one GPU: 0.20 vs 0.30 ms looping at 8K rows, 0.68 vs 1.01 at 32K
# (one H200; docs/results.md, FP8).
ONE_TILE_MAX = 16384
LOOP_TILE = dict(block=4096, warps=8)  # tile of the looping kernels


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [.., 2F] (gate: the first F columns) -> [.., F] in the input's dtype: the
    model's SwiGLU activation (engine FeedForward, MoE experts, and an FP8 w2 outside the fused path). CUDA
    inputs of decode or long-prefill size take one Triton launch (`silu_mul_rows`), the rest torch ops."""
    if use_silu_mul_kernel(gate_up):
        return silu_mul_rows(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of gate_up [.., 2F] (gate: the first F columns): GeGLU, Gemma's MLP activation
    (transformers' gelu_pytorch_tanh), torch ops on every device."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# silu_mul on CUDA: one kernel for decode rows and for long prefills, torch's two launches between. At decode
# sizes the launches are most of the time (~1.8 + 1.2 us for a 14336-wide row on an H200,
# docs/results.md, FP8; decode steps run in CUDA graphs, where the host does not count). At
# prefill sizes torch's two passes move 18.75 bytes per output value where one moves 6: 12.4 ms of a 128K
# Llama-8B layer's ~357 ms on an H100, against ~4 in one pass. But a Triton launch costs the host ~44 us
# against ~22 for torch's two (bench/launch_overhead.py), and a prefill of a few hundred tokens is bound by
# the host: one H100, Llama-8B bf16 prefill with the kernel 3-5% slower at 128-512 tokens, 5-7% faster from
# 1K (bench/bf16_swiglu_fused.py; docs/results.md, FP8).
# Tiles (columns per program, warps): decode rows many short programs; prefill rows longer ones (swept).
SILU_MUL_DECODE_ROWS = 64
SILU_MUL_PREFILL_MIN_ROWS = 1024
SILU_MUL_BLOCK = 1024  # columns per program, decode rows
SILU_MUL_PREFILL_TILE = dict(block=2048, warps=8)


def use_silu_mul_kernel(gate_up: torch.Tensor) -> bool:
    """Whether silu_mul sends gate_up [.., 2F] to the one-launch kernel: CUDA (with triton), even width, up
    to SILU_MUL_DECODE_ROWS rows or from SILU_MUL_PREFILL_MIN_ROWS (the comment above)."""
    width = gate_up.shape[-1]
    if not (gate_up.is_cuda and triton is not None and width % 2 == 0 and width > 0):
        return False
    rows = gate_up.numel() // width
    return rows <= SILU_MUL_DECODE_ROWS or rows >= SILU_MUL_PREFILL_MIN_ROWS


def silu_mul_tile(rows: int, width: int) -> dict:
    """silu_mul_rows' tile for `rows` rows of `width` outputs (the comment above)."""
    if rows > SILU_MUL_DECODE_ROWS:
        return dict(block=min(SILU_MUL_PREFILL_TILE["block"], triton.next_power_of_2(width)),
                    warps=SILU_MUL_PREFILL_TILE["warps"])
    block = min(SILU_MUL_BLOCK, triton.next_power_of_2(width))
    return dict(block=block, warps=4 if block >= 1024 else 2)


def rms_norm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's numerics in torch: RMSNorm in float32, one rounding to x's dtype, quantize_rows."""
    return quantize_rows(rms_norm_reference(x, weight, eps))


def silu_mul_quant_reference(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's numerics in torch: silu(gate) * up in float32, one rounding to the input dtype, quantize_rows."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantize_rows((F.silu(gate) * up).to(gate_up.dtype))


def use_fused_quant(x: torch.Tensor, width: int | None = None) -> bool:
    """Whether x, rows of `width` values (default: x [.., K], K = x.shape[-1]), is a CUDA activation that
    fp8_linear would send to the FP8 GEMM (more than WEIGHT_ONLY_MAX_ROWS rows): then its producer can
    quantize it itself."""
    width = x.shape[-1] if width is None else width
    return x.is_cuda and triton is not None and x.numel() > WEIGHT_ONLY_MAX_ROWS * width


if triton is not None:

    @triton.jit
    def _store_quantized(Y_row, y, offs, ok, scale):
        tl.store(Y_row + offs, e4m3_values(y, scale).to(Y_row.dtype.element_ty), mask=ok)

    @triton.jit
    def _normed(X_row, W, offs, ok, inv):
        """The tile's normalized values, rounded to X's dtype (what F.rms_norm writes), in float32."""
        x = tl.load(X_row + offs, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        return (x * inv * w).to(X_row.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _rms_norm_quant_kernel(X, W, Y, S, K, s_xm, s_ym, eps, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
                               USE_PDL: tl.constexpr = False):
        """One row per program: Y[row] = e4m3(rms_norm(X[row]) / scale), S[row] = amax / 448."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        row = tl.program_id(0).to(tl.int64)
        X_row = X + row * s_xm
        Y_row = Y + row * s_ym
        offs = tl.arange(0, BLOCK)
        if ONE_TILE:  # the row in registers: one read
            ok = offs < K
            x = tl.load(X_row + offs, mask=ok, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / K + eps)
            w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
            y = (x * inv * w).to(X.dtype.element_ty).to(tl.float32)
            scale = e4m3_scale(tl.max(tl.abs(y), 0))
            _store_quantized(Y_row, y, offs, ok, scale)
        else:  # sum of squares, amax, cast: three passes, the last two mostly from L2
            ssq = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                x = tl.load(X_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                ssq += x * x
            inv = 1.0 / tl.sqrt(tl.sum(ssq, 0) / K + eps)
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                amax = tl.maximum(amax, tl.abs(_normed(X_row + k0, W + k0, offs, k0 + offs < K, inv)))
            scale = e4m3_scale(tl.max(amax, 0))
            for k0 in range(0, K, BLOCK):
                y = _normed(X_row + k0, W + k0, offs, k0 + offs < K, inv)
                _store_quantized(Y_row + k0, y, offs, k0 + offs < K, scale)
        tl.store(S + row, scale)

    @triton.jit
    def _silu_mul(G_row, Fw, offs, ok):
        """The tile's silu(gate) * up (gate at G_row, up Fw columns later), rounded to G's dtype, in float32."""
        g = tl.load(G_row + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(G_row + Fw + offs, mask=ok, other=0.0).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * u).to(G_row.dtype.element_ty).to(tl.float32)  # silu as torch computes it

    @triton.jit
    def _silu_mul_rows_kernel(G, Y, Fw, s_gm, s_ym, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Y[row, cols] = silu(G[row, cols]) * G[row, Fw + cols], rounded as eager torch rounds: silu's
        result to G's dtype first, then the product (two roundings, as F.silu(gate) * up)."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        row = tl.program_id(0).to(tl.int64)  # rows on the grid's first axis: up to 2^31 of them
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < Fw
        g = tl.load(G + row * s_gm + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(G + row * s_gm + Fw + offs, mask=ok, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * s_ym + offs, (a * u).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_quant_kernel(G, Y, S, Fw, s_gm, s_ym, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
                               USE_PDL: tl.constexpr = False):
        """One row per program: Y[row] = e4m3(silu(G[row, :Fw]) * G[row, Fw:] / scale), S[row] = amax / 448."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        row = tl.program_id(0).to(tl.int64)
        G_row = G + row * s_gm
        Y_row = Y + row * s_ym
        offs = tl.arange(0, BLOCK)
        if ONE_TILE:
            ok = offs < Fw
            a = _silu_mul(G_row, Fw, offs, ok)
            scale = e4m3_scale(tl.max(tl.abs(a), 0))
            _store_quantized(Y_row, a, offs, ok, scale)
        else:  # amax pass, then the cast pass re-reading gate and up (mostly from L2)
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for f0 in range(0, Fw, BLOCK):
                amax = tl.maximum(amax, tl.abs(_silu_mul(G_row + f0, Fw, offs, f0 + offs < Fw)))
            scale = e4m3_scale(tl.max(amax, 0))
            for f0 in range(0, Fw, BLOCK):
                a = _silu_mul(G_row + f0, Fw, offs, f0 + offs < Fw)
                _store_quantized(Y_row + f0, a, offs, f0 + offs < Fw, scale)
        tl.store(S + row, scale)


    @triton.jit
    def _quantize_heads_kernel(X, Y, S, H, L, D, s_xb, s_xh, s_xl, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_H: tl.constexpr):
        """Programs (block of BLOCK_L positions, batch): rows b * L + l of Y [B * L, H * D], each X[b, :, l, :]
        (H heads of D) quantized as one row. BLOCK_H > 0: all heads in registers, one read; 0: a loop over
        the heads for the amax, then one to scale and cast (re-reading from L2). A head's BLOCK_L rows of
        D are one contiguous span when X is [B, H, L, D]."""
        b = tl.program_id(1).to(tl.int64)
        ls = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        ds = tl.arange(0, BLOCK_D)
        l_ok = ls < L
        X_blk = X + b * s_xb
        Y_blk = Y + (b * L + ls.to(tl.int64)) * (H * D)  # [BLOCK_L] row starts
        if BLOCK_H > 0:
            hs = tl.arange(0, BLOCK_H)
            ok = l_ok[:, None, None] & (hs < H)[None, :, None] & (ds < D)[None, None, :]
            x = tl.load(X_blk + ls[:, None, None].to(tl.int64) * s_xl + hs[None, :, None].to(tl.int64) * s_xh
                        + ds[None, None, :], mask=ok, other=0.0).to(tl.float32)
            scale = e4m3_scale(tl.max(tl.max(tl.abs(x), 2), 1))
            tl.store(Y_blk[:, None, None] + hs[None, :, None] * D + ds[None, None, :],
                     e4m3_values(x, scale[:, None, None]).to(Y.dtype.element_ty), mask=ok)
        else:
            ok = l_ok[:, None] & (ds < D)[None, :]
            X_head = X_blk + ls[:, None].to(tl.int64) * s_xl + ds[None, :]
            amax = tl.zeros([BLOCK_L], dtype=tl.float32)
            for _ in range(H):
                x = tl.load(X_head, mask=ok, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
                X_head += s_xh  # pointer arithmetic: 64-bit, whatever H * s_xh is
            scale = e4m3_scale(amax)
            X_head = X_blk + ls[:, None].to(tl.int64) * s_xl + ds[None, :]
            Y_head = Y_blk[:, None] + ds[None, :]
            for _ in range(H):
                x = tl.load(X_head, mask=ok, other=0.0).to(tl.float32)
                tl.store(Y_head, e4m3_values(x, scale[:, None]).to(Y.dtype.element_ty), mask=ok)
                X_head += s_xh
                Y_head += D
        tl.store(S + b * L + ls, scale, mask=l_ok)


def _tile(width: int, tile: dict | None) -> tuple[int, bool, int]:
    """(block, one_tile, warps) for rows of `width` columns; `tile` overrides (bench: dict(block=, warps=))."""
    if tile is None:
        block = triton.next_power_of_2(width)
        if block <= ONE_TILE_MAX:
            return block, True, max(4, min(16, block // 512))
        tile = LOOP_TILE
    return tile["block"], tile["block"] >= width, tile["warps"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out_dtype: torch.dtype = FP8_DTYPE,
                   tile: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., K] -> (e4m3 [M, K], float32 scales [M]), M = rows of x: RMSNorm then per-row quantization
    in one Triton launch (CUDA, or the interpreter). out_dtype=float32: the values before the e4m3 cast (tests)."""
    if triton is None:
        raise RuntimeError("rms_norm_quant needs the triton package")
    x2 = _rows(x)
    M, K = x2.shape
    y = torch.empty(M, K, dtype=out_dtype, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    block, one_tile, warps = _tile(K, tile)
    if M:
        _rms_norm_quant_kernel[(M,)](x2, weight, y, s, K, x2.stride(0), y.stride(0), eps, BLOCK=block,
                                     ONE_TILE=one_tile, num_warps=warps, **pdl_launch(x2))
    return y, s


def _gate_up_rows(gate_up: torch.Tensor, name: str) -> tuple[torch.Tensor, int, int]:
    """[.., 2F] -> (2-D rows [M, 2F], M, F); an odd width is refused naming `name`."""
    g2 = _rows(gate_up)
    M, two_f = g2.shape
    if two_f % 2:
        raise ValueError(f"{name}: gate_up has an odd width {two_f}; expected [gate | up]")
    return g2, M, two_f // 2


def silu_mul_rows(gate_up: torch.Tensor, *, tile: dict | None = None) -> torch.Tensor:
    """silu_mul in one Triton launch (CUDA, or the interpreter): gate_up [.., 2F] -> [.., F]. tile:
    dict(block=, warps=) instead of silu_mul_tile's (bench, tests)."""
    if triton is None:
        raise RuntimeError("silu_mul_rows needs the triton package")
    g2, M, Fw = _gate_up_rows(gate_up, "silu_mul_rows")
    y = torch.empty(M, Fw, dtype=gate_up.dtype, device=gate_up.device)
    if M and Fw:
        t = tile or silu_mul_tile(M, Fw)
        _silu_mul_rows_kernel[(M, triton.cdiv(Fw, t["block"]))](g2, y, Fw, g2.stride(0), y.stride(0), BLOCK=t["block"],
                                                               num_warps=t["warps"], **pdl_launch(g2))
    return y.view(*gate_up.shape[:-1], Fw)


def silu_mul_quant(gate_up: torch.Tensor, *, out_dtype: torch.dtype = FP8_DTYPE,
                   tile: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [.., 2F] -> (e4m3 [M, F], float32 scales [M]): silu(gate) * up then per-row quantization in
    one Triton launch (CUDA, or the interpreter). out_dtype=float32: the values before the e4m3 cast (tests)."""
    if triton is None:
        raise RuntimeError("silu_mul_quant needs the triton package")
    g2, M, Fw = _gate_up_rows(gate_up, "silu_mul_quant")
    y = torch.empty(M, Fw, dtype=out_dtype, device=gate_up.device)
    s = torch.empty(M, dtype=torch.float32, device=gate_up.device)
    block, one_tile, warps = _tile(Fw, tile)
    if M:
        _silu_mul_quant_kernel[(M,)](g2, y, s, Fw, g2.stride(0), y.stride(0), BLOCK=block, ONE_TILE=one_tile,
                                     num_warps=warps, **pdl_launch(g2))
    return y, s


def heads_tile(H: int, D: int) -> dict:
    """quantize_heads' default tile for H heads of D: all heads of a few positions in registers while the
    padded row fits ONE_TILE_MAX values, else the loop over heads."""
    row = triton.next_power_of_2(H) * triton.next_power_of_2(D)
    if row <= ONE_TILE_MAX:
        return dict(block_l=max(1, min(4, ONE_TILE_MAX // row)), warps=8, one_tile=True)
    return dict(block_l=16, warps=4, one_tile=False)


def quantize_heads(o: torch.Tensor, *, out_dtype: torch.dtype = FP8_DTYPE,
                   tile: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's output o [B, H, L, D] (any strides) -> (e4m3 [B * L, H * D], float32 scales [B * L]):
    quantize_rows of o.transpose(1, 2).reshape(B * L, H * D), in one Triton launch (CUDA, or the
    interpreter) that reads o where it lies. out_dtype=float32: the values before the e4m3 cast (tests);
    tile: dict(block_l=, warps=, one_tile=) instead of heads_tile's (bench, tests)."""
    if triton is None:
        raise RuntimeError("quantize_heads needs the triton package")
    if o.dim() != 4:
        raise ValueError(f"quantize_heads: expected attention's output [B, H, L, D], got shape {tuple(o.shape)}")
    if o.stride(-1) != 1:
        o = o.contiguous()
    B, H, L, D = o.shape
    t = tile or heads_tile(H, D)
    y = torch.empty(B * L, H * D, dtype=out_dtype, device=o.device)
    s = torch.empty(B * L, dtype=torch.float32, device=o.device)
    if y.numel():
        _quantize_heads_kernel[(triton.cdiv(L, t["block_l"]), B)](
            o, y, s, H, L, D, o.stride(0), o.stride(1), o.stride(2), BLOCK_L=t["block_l"],
            BLOCK_D=triton.next_power_of_2(D), BLOCK_H=triton.next_power_of_2(H) if t["one_tile"] else 0,
            num_warps=t["warps"])
    return y, s
