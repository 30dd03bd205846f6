"""8-bit causal flash-attention forward for a square prefill call (issue 19 item 4), Triton.

    out, lse = flash_fp8_attention(q, k, v, variant="s")        # `--fp8 attention`: int8 q . k, smoothed K
    out, lse = flash_fp8_attention(q, k, v, variant="t")        # s's scores with b's e4m3 P . V (measured)
    out, lse = flash_fp8_attention(q, k, v, variant="a")        # quantize K (and V) once, then attend
    kv = quantize_kv(k, v, variant="b"); out, lse = flash_fp8_attention(q, k, v, variant="b", kv=kv)
    out, lse = flash_fp8_reference(q, k, v, variant="a")        # the same blockwise algorithm in torch

q [B, Hq, L, D]; k, v [B, Hkv, L, D] (GQA: Hq % Hkv == 0); row i sees keys 0..i (q and k at positions
0..L-1, or any one strictly increasing run shared by both: index-causal). Returns out [B, Hq, L, D]
in q's dtype and lse [B, Hq, L] float32, natural log, the `attention` contract (docs/design.md).

Numerics (FlashAttention-2's online softmax, FlashAttention-3's FP8 idea, SageAttention's smoothing of K,
our own scales):
- K: e4m3 with one scale per (batch, KV head, KV_BLOCK keys), written once by a pre-pass kernel
  (`quantize_kv`): many query blocks read each key block, so quantizing it in the attention kernel
  would repeat the work per query block and head of the group. Rows past L are zero.
- Q: e4m3 with one scale per (batch, head, BLOCK_M rows), quantized in the kernel right after its
  one load. Scale = max(amax, 1e-12) / 448, division, clamp, cast: kernels/fp8.py's numerics.
- S = (Q8 @ K8^T) * (scale_q * scale_k) on e4m3 tensor cores, float32 accumulation; the two scales
  are scalars per (query block, key block), so they fold into the softmax's exponent factor.
- Variant "s" (what `--fp8 attention` runs): int8 instead of e4m3 (scale amax / 127, rounded half away
  from zero), and K minus its mean over the keys (per batch, KV head and channel) before the pre-pass
  quantizes it: q . (k - m) = q . k - q . m shifts every score of a row by one constant, so the softmax
  is unchanged while the common part of the keys (large in real models) no longer eats the int8 range;
  the lse gets q . m back (from q as given, float32). S on int8 tensor cores, exact int32 sums.
- Online softmax in float32 (exp2, log2 units), the running max / sum / accumulator of online_softmax.py.
- P @ V, variants "a" and "s": P and V in V's dtype (bf16 in a model), V as given (no V pre-pass;
  a strided V is copied contiguous first for the TMA loads).
  Variant "b": P scaled by 2^P_LOG2_SCALE (P is in [0, 1] after the max subtraction; 256 puts its
  largest value in e4m3's top binades, exactly, as a power of two) and cast to e4m3; V in e4m3 with
  one scale per (batch, KV head, channel) over the whole sequence, stored transposed [B, Hkv, D, L']
  by the pre-pass, because Hopper's FP8 wgmma reads its second operand only along the reduction
  dimension (the keys). The channel scale and the 2^8 leave in the epilogue (the row sum l carries
  the same 2^8).
  Variant "t": "s"'s int8 scores with "b"'s e4m3 P and V (both flags of the kernel).
- The output accumulates in float32 and is written in q's dtype, never in e4m3.
Causal work: key blocks wholly below the diagonal run without mask arithmetic; only the blocks on it
are masked; blocks above it are never visited.

Measured (Llama-8B heads, 128K, pre-pass included): on one H100 variant b 1.36x cuDNN's bf16 kernel
(761 TFLOP/s), variant a 1.12x, but e4m3's 3 mantissa bits on Q and K (~2.6% rms rounding per element,
whatever the scale granularity) put the output ~10% off with a peaked softmax (q x 4), lse up to 0.55 /
0.74 (docs/results.md, FP8); kept for measurements, not used. On one H200
variant s 1.09x cuDNN (1.04x in the model's strided layout) at 3.3% output error on the same inputs
(variant a there: 10.2%), and 2.2% vs 7.8% on SmolLM2's real q / k / v; a Llama-8B-shaped 128K prefill
with `--fp8 linear,kv,attention` 9.54 s vs 10.07 s without `attention` (bf16 11.33 s)
(docs/results.md, FP8). Variant t, measured in the model's layout at 128K on
one H200: 1.31x cuDNN (s: 1.10x, b: 1.39x), 4.3% output error on the q x 4 inputs, 3.0% vs s's 2.3% on
SmolLM2's real q / k / v; a Llama-8B 128K `linear,kv,attention` prefill 8.55 s vs 9.58 s with s, but
the harness on the GPU kernels 0.96 vs s's 0.98 of bf16 (400 prompts): kept for measurements, not used
(docs/results.md, FP8).

On CPU the kernels run under TRITON_INTERPRET=1 (tests); the interpreter's float32 -> e4m3 cast drops
the carry when a value rounds up across a power of two (kernels/kv_write.py), so interpreted kernels
round to e4m3's grid in float32 first (`_round_e4m3`), which the compiled kernels skip.
"""
from __future__ import annotations

import math

import torch

from starshard.kernels.common import check_shapes, triton_interpreted
from starshard.kernels.fp8 import E4M3_MAX, FP8_DTYPE, e4m3_scale, e4m3_values
from starshard.kernels.online_softmax import LOG2E, row_lse, softmax_init, softmax_update

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # installs without triton: the torch reference still imports
    triton = None

KV_BLOCK = 128  # keys per K scale; the kernel's BLOCK_N divides it
HEAD_DIMS = (32, 64, 128, 256)  # the 8-bit tensor-core tiles the kernel builds
P_LOG2_SCALE = 8  # variant "b": probabilities times 2^8 before the e4m3 cast
INT8_MAX = 127.0  # variant "s": symmetric int8, scale = amax / 127
VARIANTS = ("a", "b", "s", "t")
INT8_QK_VARIANTS = ("s", "t")  # int8 q . (k - mean k)
FP8_PV_VARIANTS = ("b", "t")  # P and V in e4m3
_TINY = 1e-12
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per variant at head_dim <= 128, K / V through tensor
# descriptors (tma): the fastest of bench/fp8_prefill_attention.py's sweep on one H100 at 32K, still the
# fastest of the sweep's top three at 128K (docs/results.md, FP8): a 13.7 ms,
# b 11.2 ms at 32K (8 warps for b: 12.9 ms).
DEFAULT_CONFIG = {"a": (128, 128, 8, 3), "b": (64, 128, 4, 3), "s": (128, 128, 8, 3), "t": (64, 128, 4, 3)}


if triton is not None:

    @triton.jit
    def _round_e4m3(x):
        """float32 x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), still float32:
        3 mantissa bits for normals (|x| >= 2^-6), multiples of 2^-9 below."""
        bits = x.to(tl.int32, bitcast=True)
        neg = bits < 0
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        normal = bits.to(tl.float32, bitcast=True)
        sub = (tl.abs(x) + 24576.0) - 24576.0  # 1.5 * 2^14: float32's spacing there is 2^-9
        sub = tl.where(neg, -sub, sub)  # keeps the sign of a value that rounds to zero, as the cast does
        return tl.where(tl.abs(x) < 0.015625, sub, normal)

    @triton.jit
    def _to_e4m3(x, INTERPRET: tl.constexpr):
        """float32 -> e4m3 (round to nearest even); interpreted: round in float32 first (module doc)."""
        if INTERPRET:
            x = _round_e4m3(x)
        return x.to(tl.float8e4nv)

    @triton.jit
    def _to_int8(x, scale):
        """x / scale rounded half away from zero to int8 (|x| <= 127 * scale): the float -> int cast
        truncates, so add +-0.5 first."""
        y = x / scale
        return (y + tl.where(y >= 0.0, 0.5, -0.5)).to(tl.int8)

    @triton.jit
    def _quantize_kv_kernel(K, V, K8, KS, V8T, VS, KM, L, Lp,
                            s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, Hkv,
                            HEAD_DIM: tl.constexpr, KV_BLOCK: tl.constexpr, QUANT_V: tl.constexpr,
                            INT8_K: tl.constexpr, INTERPRET: tl.constexpr):
        """One program per (KV_BLOCK keys, batch x KV head): K8 rows [Lp, D] and their block scale;
        with QUANT_V also V8T [D, Lp] (transposed) from the channel scales VS [D] (computed before);
        with INT8_K the keys minus their mean KM [D] in int8 instead of e4m3. Rows at or past L are
        written as zeros."""
        blk = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // Hkv
        h = bh % Hkv
        offs_n = blk * KV_BLOCK + tl.arange(0, KV_BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        ok = (offs_n < L)[:, None]
        k = tl.load(K + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd,
                    mask=ok, other=0.0).to(tl.float32)
        if INT8_K:
            k = tl.where(ok, k - tl.load(KM + bh * HEAD_DIM + offs_d)[None, :], 0.0)
            ks = tl.maximum(tl.max(tl.max(tl.abs(k), 1), 0), 1e-12) / 127.0
            k8 = _to_int8(k, ks)
        else:
            ks = e4m3_scale(tl.max(tl.max(tl.abs(k), 1), 0))
            k8 = _to_e4m3(e4m3_values(k, ks), INTERPRET)
        out_row = bh.to(tl.int64) * Lp
        tl.store(K8 + (out_row + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], k8)
        tl.store(KS + bh * (Lp // KV_BLOCK) + blk, ks)
        if QUANT_V:
            v = tl.load(V + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                        mask=ok, other=0.0).to(tl.float32)
            vs = tl.load(VS + bh * HEAD_DIM + offs_d)
            v8 = _to_e4m3(e4m3_values(v, vs[None, :]), INTERPRET)
            # transposed: channel-major, keys contiguous (the FP8 wgmma's B operand along the keys)
            tl.store(V8T + (bh.to(tl.int64) * HEAD_DIM + offs_d[None, :]) * Lp + offs_n[:, None], v8)

    @triton.jit
    def _update_fp8_pv(qk, v8, m_i, l_i, acc, visible, c, MASKED: tl.constexpr, INTERPRET: tl.constexpr):
        """`softmax_update` with P in e4m3: p' = 2^(s - m + P_LOG2_SCALE) in [0, 256], l sums p'
        (so the 2^8 cancels in acc / l), acc += e4m3(p') @ v8."""
        if MASKED:
            s = tl.where(visible, qk * c, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - (m_use - 8.0)[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
            m_use = m_new
            p = tl.math.exp2(qk * c - (m_use - 8.0)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(_to_e4m3(tl.minimum(p, 448.0), INTERPRET), v8, acc)
        return m_new, l_i, acc

    @triton.jit
    def _load_kv(k_desc, v_desc, kt_ptrs, v_ptrs, k_row, v_row, start, L, s_vn, offs_n,
                 FP8_PV: tl.constexpr, TAIL: tl.constexpr, USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
        """K8^T [D, BLOCK_N] and V [BLOCK_N, D] of the key block at `start`. K8 and V8T are padded to a
        multiple of KV_BLOCK (zeros): no masks. V as given (variant a) is masked past L on TAIL blocks;
        its descriptor reads the next head's rows there (finite, weighted by exactly 0) or zero fill.
        k_row / v_row: this (batch, KV head)'s first row in the descriptors' 2-D views."""
        if USE_TMA:
            kt = k_desc.load([k_row + start, 0]).T
            if FP8_PV:
                v = v_desc.load([v_row, start]).T
            else:
                v = v_desc.load([v_row + start, 0])
        else:
            kt = tl.load(kt_ptrs + start * HEAD_DIM)
            if FP8_PV:
                v = tl.load(v_ptrs + start).T
            elif TAIL:
                v = tl.load(v_ptrs + start * s_vn, mask=(start + offs_n < L)[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs + start * s_vn)
        return kt, v

    @triton.jit(do_not_specialize=["L", "n_qblocks"])
    def _flash_fp8_fwd_kernel(
        Q, K8, KS, V, VS, KM, O, LSE, k_desc, v_desc,
        qk_scale,
        s_qb, s_qh, s_qm, s_qd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_om, s_od,
        H, G, Hkv, L, Lp, n_qblocks,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr,
        FP8_PV: tl.constexpr, INT8_QK: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        # Heaviest query blocks (most keys) first: shortens the tail of the causal grid.
        pid_m = n_qblocks - 1 - tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        bkv = b * Hkv + h // G

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < L

        # Q block -> e4m3 (int8) with one scale for the block.
        q = tl.load(Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        if INT8_QK:
            q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0), 1e-12) / 127.0
            q8 = _to_int8(q, q_scale)
            # the scores left out by smoothing, q . mean(K) per row: constant along the row, so only the lse needs it
            q_km = tl.sum(q * tl.load(KM + bkv * HEAD_DIM + offs_d)[None, :], 1)
        else:
            q_scale = e4m3_scale(tl.max(tl.max(tl.abs(q), 1), 0))
            q8 = _to_e4m3(e4m3_values(q, q_scale), INTERPRET)
        c_q = qk_scale * q_scale

        k_row = bkv * Lp  # first row of this (batch, KV head) in K8 [B * Hkv * Lp, D]
        kt_ptrs = K8 + k_row.to(tl.int64) * HEAD_DIM + offs_n[None, :] * HEAD_DIM + offs_d[:, None]
        if FP8_PV:
            v_row = bkv * HEAD_DIM  # in V8T [B * Hkv * D, Lp]
            v_ptrs = V + v_row.to(tl.int64) * Lp + offs_d[:, None] * Lp + offs_n[None, :]  # [D, BLOCK_N]
        else:
            v_row = bkv * L  # in V [B * Hkv * L, D] (TMA: V contiguous)
            v_ptrs = V + b.to(tl.int64) * s_vb + (h // G).to(tl.int64) * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd
        ks_ptr = KS + bkv * (Lp // KV_BLOCK)

        n_full = (pid_m * BLOCK_M) // BLOCK_N  # key blocks every row of this block sees whole
        n_blocks = tl.cdiv(tl.minimum((pid_m + 1) * BLOCK_M, L), BLOCK_N)

        m_i, l_i, acc = softmax_init(BLOCK_M, HEAD_DIM)
        for j in range(0, n_full):
            start = j * BLOCK_N
            kt, v = _load_kv(k_desc, v_desc, kt_ptrs, v_ptrs, k_row, v_row, start, L, s_vn, offs_n,
                             FP8_PV, False, USE_TMA, HEAD_DIM)
            c = c_q * tl.load(ks_ptr + start // KV_BLOCK)
            qk = tl.dot(q8, kt).to(tl.float32)  # int8: exact int32 sums
            if FP8_PV:
                m_i, l_i, acc = _update_fp8_pv(qk, v, m_i, l_i, acc, None, c, False, INTERPRET)
            else:
                m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, None, c, False, False)
        # The diagonal: key j visible to row i iff j <= i (keys past L sit only beyond rows past L).
        for j in range(n_full, n_blocks):
            start = j * BLOCK_N
            kt, v = _load_kv(k_desc, v_desc, kt_ptrs, v_ptrs, k_row, v_row, start, L, s_vn, offs_n,
                             FP8_PV, True, USE_TMA, HEAD_DIM)
            c = c_q * tl.load(ks_ptr + start // KV_BLOCK)
            qk = tl.dot(q8, kt).to(tl.float32)
            visible = (start + offs_n)[None, :] <= offs_m[:, None]
            if FP8_PV:
                m_i, l_i, acc = _update_fp8_pv(qk, v, m_i, l_i, acc, visible, c, True, INTERPRET)
            else:
                m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, visible, c, True, False)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = row_lse(m_i, l_i, False)
        if FP8_PV:
            out = out * tl.load(VS + bkv * HEAD_DIM + offs_d)[None, :]
            lse = lse - 8.0 * 0.6931471805599453  # l carried 2^P_LOG2_SCALE
        if INT8_QK:
            lse = lse + q_km * (qk_scale * 0.6931471805599453)  # qk_scale is in log2 units
        o_ptrs = O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + pid_bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)


class Fp8KV:
    """The pre-pass's output: k8 [B, Hkv, Lp, D] e4m3 (Lp = L rounded up to KV_BLOCK, zero rows past L),
    k_scale [B, Hkv, Lp // KV_BLOCK] float32; variant "b" also v8t [B, Hkv, D, Lp] e4m3 (transposed)
    and v_scale [B, Hkv, D] float32 (one per channel); variant "a" leaves v8t / v_scale None.
    Variant "s": k8 is int8 of K minus k_mean [B, Hkv, D] float32 (the mean over the L keys)."""

    def __init__(self, k8, k_scale, v8t=None, v_scale=None, k_mean=None):
        self.k8, self.k_scale, self.v8t, self.v_scale, self.k_mean = k8, k_scale, v8t, v_scale, k_mean

    @property
    def variant(self) -> str:
        if self.k_mean is not None:
            return "s" if self.v8t is None else "t"
        return "a" if self.v8t is None else "b"


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"flash_fp8: variant must be one of {VARIANTS}, got {variant!r}")


def _check_inputs(q, k, v, name: str) -> None:
    check_shapes(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{name} is a square causal prefill: as many keys as query rows, got {q.shape[2]} rows and "
                         f"{k.shape[2]} keys")
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        raise ValueError(f"{name} supports head_dim 32, 64, 128 or 256 (e4m3 tensor-core tiles), got {D}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} takes float16 / bfloat16 / float32 q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")


def _v_channel_scale(v: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, D] float32: max over the keys of |v| per channel, / 448 (floored like e4m3_scale)."""
    return v.abs().amax(2).float().clamp_min(_TINY) / E4M3_MAX


def _k_mean(k: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, D] float32: the keys' mean per channel (variant "s" smooths K by it)."""
    return k.float().mean(2)


def int8_round(x: torch.Tensor) -> torch.Tensor:
    """float x (|x| <= 127) rounded half away from zero, as the kernels' float -> int8 cast after +-0.5."""
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5)).to(torch.int8)


def _quantize_kv_torch(k, v, variant: str) -> Fp8KV:
    """quantize_kv in torch (CPU, and the reference): the kernel's numerics, float32 division."""
    B, Hkv, L, D = k.shape
    Lp = -(-L // KV_BLOCK) * KV_BLOCK
    km = None
    if variant in INT8_QK_VARIANTS:
        km = _k_mean(k)
        kp = torch.nn.functional.pad(k.float() - km[:, :, None], (0, 0, 0, Lp - L))
        kp = kp.view(B, Hkv, Lp // KV_BLOCK, KV_BLOCK, D)
        ks = kp.abs().amax((-1, -2)).clamp_min(_TINY) / INT8_MAX
        k8 = int8_round(kp / ks[..., None, None]).view(B, Hkv, Lp, D)
    else:
        kp = torch.nn.functional.pad(k.float(), (0, 0, 0, Lp - L)).view(B, Hkv, Lp // KV_BLOCK, KV_BLOCK, D)
        ks = kp.abs().amax((-1, -2)).clamp_min(_TINY) / E4M3_MAX
        k8 = (kp / ks[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).view(B, Hkv, Lp, D)
    if variant not in FP8_PV_VARIANTS:
        return Fp8KV(k8, ks, k_mean=km)
    vs = _v_channel_scale(v)
    vp = torch.nn.functional.pad(v.float(), (0, 0, 0, Lp - L))
    v8t = (vp / vs[:, :, None, :]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).transpose(2, 3).contiguous()
    return Fp8KV(k8, ks, v8t, vs, km)


def quantize_kv(k: torch.Tensor, v: torch.Tensor, variant: str = "a", *, use_triton: bool | None = None) -> Fp8KV:
    """The pre-pass: K to e4m3 per KV_BLOCK keys (and for variant "b" V per channel, transposed; for
    "s" K minus its mean to int8), one Triton launch (plus a torch amax of V for "b", a torch mean of K
    for "s"). use_triton: default on CUDA tensors (and on CPU tensors when the kernels are interpreted)."""
    _check_variant(variant)
    B, Hkv, L, D = k.shape
    if use_triton is None:
        use_triton = triton is not None and (k.is_cuda or triton_interpreted(_quantize_kv_kernel))
    if not use_triton:
        return _quantize_kv_torch(k, v, variant)
    nblk = -(-L // KV_BLOCK)
    Lp = nblk * KV_BLOCK
    int8_k, quant_v = variant in INT8_QK_VARIANTS, variant in FP8_PV_VARIANTS
    k8 = torch.empty(B, Hkv, Lp, D, dtype=torch.int8 if int8_k else FP8_DTYPE, device=k.device)
    ks = torch.empty(B, Hkv, nblk, dtype=torch.float32, device=k.device)
    km = _k_mean(k) if int8_k else None
    if quant_v:
        vs = _v_channel_scale(v)
        v8t = torch.empty(B, Hkv, D, Lp, dtype=FP8_DTYPE, device=k.device)
    else:
        vs = v8t = None
    if B * Hkv and nblk:
        _quantize_kv_kernel[(nblk, B * Hkv)](
            k, v, k8, ks, v8t if v8t is not None else k8, vs if vs is not None else ks, km if km is not None else ks,
            L, Lp, *k.stride(), *v.stride(), Hkv,
            HEAD_DIM=D, KV_BLOCK=KV_BLOCK, QUANT_V=quant_v, INT8_K=int8_k,
            INTERPRET=triton_interpreted(_quantize_kv_kernel), num_warps=4 if D <= 64 else 8)
    return Fp8KV(k8, ks, v8t, vs, km)


def default_config(variant: str, head_dim: int) -> tuple[int, int, int, int]:
    if head_dim <= 128:
        return DEFAULT_CONFIG[variant]
    return 64, 64, 8, 2


def flash_fp8_attention(q, k, v, *, variant: str = "a", scale=None, kv: Fp8KV | None = None, config=None,
                        tma: bool | None = None):
    """Square causal attention with e4m3 scores (module doc). kv: the pre-pass's output for these k, v
    (quantize_kv), else computed here. config = (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N must
    divide KV_BLOCK. tma: K8 / V through tensor descriptors (variants a / s copy a strided V first);
    default on for CUDA tensors (the measured faster choice), off on CPU."""
    _check_variant(variant)
    _check_inputs(q, k, v, "flash_fp8_attention")
    if triton is None:
        raise RuntimeError("flash_fp8_attention: the Triton kernel needs the triton package")
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device=q.device)
    if L == 0 or B * Hq == 0:
        return out, lse
    if kv is None:
        kv = quantize_kv(k, v, variant)
    elif kv.variant != variant:
        raise ValueError(f"flash_fp8_attention: kv was quantized for variant {kv.variant!r}, not {variant!r}")
    block_m, block_n, warps, stages = config or default_config(variant, D)
    if KV_BLOCK % block_n:
        raise ValueError(f"flash_fp8_attention: BLOCK_N {block_n} must divide KV_BLOCK {KV_BLOCK}")
    Lp = kv.k8.shape[2]
    fp8_pv = variant in FP8_PV_VARIANTS
    v_arg = kv.v8t if fp8_pv else v
    interp = triton_interpreted(_flash_fp8_fwd_kernel)
    if tma is None:
        tma = q.is_cuda
    if tma and not fp8_pv and not v.is_contiguous():
        v = v.contiguous()  # the projections' [B, L, H, D] layout: one copy of V for the faster TMA loads
    if tma:
        k_desc = TensorDescriptor(kv.k8, [B * Hkv * Lp, D], [D, 1], [block_n, D])
        if fp8_pv:
            v_desc = TensorDescriptor(kv.v8t, [B * Hkv * D, Lp], [Lp, 1], [D, block_n])
        else:
            v_desc = TensorDescriptor(v, [B * Hkv * L, D], [D, 1], [block_n, D])
    else:
        k_desc = v_desc = kv.k8  # unused
    n_qblocks = triton.cdiv(L, block_m)
    _flash_fp8_fwd_kernel[(n_qblocks, B * Hq)](
        q, kv.k8, kv.k_scale, v_arg, kv.v_scale if fp8_pv else kv.k_scale,
        kv.k_mean if kv.k_mean is not None else kv.k_scale, out, lse, k_desc, v_desc,
        scale * LOG2E,
        *q.stride(), *v.stride(), *out.stride(),
        Hq, Hq // Hkv, Hkv, L, Lp, n_qblocks,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, KV_BLOCK=KV_BLOCK,
        FP8_PV=fp8_pv, INT8_QK=variant in INT8_QK_VARIANTS, USE_TMA=bool(tma), INTERPRET=interp,
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def int8_scores_operands(q, k, *, block_m: int = DEFAULT_CONFIG["s"][0]):
    """Variant s's scores as plain operands: (q', k', lse_shift) with q' = q's int8 per block_m rows and
    k' = (K - mean K)'s int8 per KV_BLOCK keys, dequantized to q's dtype, and lse_shift [B, Hq, L]
    float32 = q . mean(K), unscaled. Any exact attention over (q', k', v) then has the kernel's scores,
    and its lse + softmax scale * lse_shift the kernel's lse: the slow reference path of 8-bit scores
    on the CPU (P @ V stays in q's dtype there)."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    nqb = -(-L // block_m)
    qp = torch.nn.functional.pad(q.float(), (0, 0, 0, nqb * block_m - L)).view(B, Hq, nqb, block_m, D)
    qs = qp.abs().amax((-1, -2), keepdim=True).clamp_min(_TINY) / INT8_MAX
    qd = (int8_round(qp / qs).float() * qs).view(B, Hq, -1, D)[:, :, :L]
    kv = _quantize_kv_torch(k, k, "s")
    Lp = kv.k8.shape[2]
    kd = (kv.k8.float().view(B, Hkv, Lp // KV_BLOCK, KV_BLOCK, D) * kv.k_scale[..., None, None]).view(B, Hkv, Lp, D)
    shift = (q.float() @ kv.k_mean.repeat_interleave(Hq // Hkv, 1)[..., None])[..., 0]
    return qd.to(q.dtype), kd[:, :, :L].to(q.dtype), shift


def _e4m3_round(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).to(x.dtype)


def flash_fp8_reference(q, k, v, *, variant: str = "a", scale=None, block_m: int = 128, block_n: int = 128,
                        p_dtype=None):
    """The kernel's blockwise algorithm in torch, float64 arithmetic (any device; slow, for tests):
    Q quantized per block_m rows, K / V as `quantize_kv` (torch path), scores from the dequantized
    e4m3 values, an online softmax over key blocks of block_n in order (variant "b" rounds each block's
    2^8-scaled probabilities to e4m3 relative to the running max, as the kernel does), P rounded to
    p_dtype before P @ V in variant "a" (default: v's dtype, the kernel's cast; float32 keeps it).
    Returns (out in q's dtype, lse float32)."""
    _check_variant(variant)
    _check_inputs(q, k, v, "flash_fp8_reference")
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    f64 = torch.float64
    # Q: one scale per (batch, head, block_m rows); rows past L do not exist (no padding in the amax)
    nqb = -(-L // block_m)
    qp = torch.nn.functional.pad(q.float(), (0, 0, 0, nqb * block_m - L)).view(B, Hq, nqb, block_m, D)
    if variant in INT8_QK_VARIANTS:
        qs = qp.abs().amax((-1, -2)).clamp_min(_TINY) / INT8_MAX
        q8 = int8_round(qp / qs[..., None, None])
    else:
        qs = qp.abs().amax((-1, -2)).clamp_min(_TINY) / E4M3_MAX
        q8 = (qp / qs[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    qd = (q8.to(f64) * qs[..., None, None].to(f64)).view(B, Hq, -1, D)[:, :, :L]
    kv = _quantize_kv_torch(k, v, variant)
    Lp = kv.k8.shape[2]
    kd = (kv.k8.to(f64).view(B, Hkv, Lp // KV_BLOCK, KV_BLOCK, D) * kv.k_scale[..., None, None].to(f64))
    kd = kd.view(B, Hkv, Lp, D)[:, :, :L].repeat_interleave(g, 1)
    fp8_pv = variant in FP8_PV_VARIANTS
    if fp8_pv:
        vd = kv.v8t.to(f64).transpose(2, 3)[:, :, :L]  # e4m3 values; the channel scale comes last
    else:
        vd = v.to(f64)
    vd = vd.repeat_interleave(g, 1)
    s = (qd @ kd.transpose(-1, -2)) * (scale * LOG2E)  # log2 units
    rows = torch.arange(L, device=q.device)
    s = s.masked_fill(rows[None, :] > rows[:, None], float("-inf"))
    m = torch.full((B, Hq, L), float("-inf"), dtype=f64, device=q.device)
    l = torch.zeros(B, Hq, L, dtype=f64, device=q.device)
    acc = torch.zeros(B, Hq, L, D, dtype=f64, device=q.device)
    p_dtype = p_dtype or v.dtype
    for start in range(0, L, block_n):
        sb = s[..., start : start + block_n]
        m_new = torch.maximum(m, sb.amax(-1))
        m_use = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        if fp8_pv:
            p = torch.exp2(sb - (m_use - P_LOG2_SCALE)[..., None])
            pq = _e4m3_round(p)
        else:
            p = torch.exp2(sb - m_use[..., None])
            pq = p.to(p_dtype).to(f64)
        alpha = torch.exp2(m - m_use)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + pq @ vd[:, :, start : start + block_n]
        m = m_new
    out = acc / l[..., None]
    lse = (m + torch.log2(l)) * math.log(2.0)
    if fp8_pv:
        out = out * kv.v_scale.to(f64).repeat_interleave(g, 1)[:, :, None, :]
        lse = lse - P_LOG2_SCALE * math.log(2.0)
    if variant in INT8_QK_VARIANTS:  # the smoothed-out q . mean(K), from q as given
        lse = lse + (q.to(f64) @ kv.k_mean.to(f64).repeat_interleave(g, 1)[..., None])[..., 0] * scale
    return out.to(q.dtype), lse.float()
