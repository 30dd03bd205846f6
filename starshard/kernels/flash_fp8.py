"""8-bit causal flash-attention forward for a square prefill call (issue 19 item 4), Triton: `--fp8 attention`.

    out, lse = flash_fp8_attention(q, k, v)                 # int8 q . k with smoothed K, P . V in v's dtype
    keys = quantize_keys(k); out, lse = flash_fp8_attention(q, k, v, keys=keys)
    out, lse = flash_fp8_reference(q, k, v)                 # the same blockwise algorithm in torch

q [B, Hq, L, D]; k, v [B, Hkv, L, D] (GQA: Hq % Hkv == 0); row i sees keys 0..i (q and k at positions
0..L-1, or any one strictly increasing run shared by both: index-causal). Returns out [B, Hq, L, D]
in q's dtype and lse [B, Hq, L] float32, natural log, the `attention` contract (docs/design.md).

Numerics (FlashAttention-2's online softmax, FlashAttention-3's 8-bit idea, SageAttention's smoothing of K,
our own scales):
- K minus its mean over the keys (per batch, KV head and channel), then int8 with one scale per
  (batch, KV head, KV_BLOCK keys), written once by a pre-pass kernel (`quantize_keys`): many query
  blocks read each key block, so quantizing it in the attention kernel would repeat the work per query
  block and head of the group. Rows past L are zero. q . (k - m) = q . k - q . m shifts every score of
  a row by one constant, so the softmax is unchanged while the common part of the keys (large in real
  models) no longer eats the int8 range; the lse gets q . m back (from q as given, float32).
- Q: int8 with one scale per (batch, head, BLOCK_M rows), quantized in the kernel right after its one
  load. Scale = max(amax, 1e-12) / 127, rounded half away from zero.
- S = (Q8 @ K8^T) * (scale_q * scale_k) on int8 tensor cores, exact int32 sums; the two scales are
  scalars per (query block, key block), so they fold into the softmax's exponent factor.
- Online softmax in float32 (exp2, log2 units), the running max / sum / accumulator of online_softmax.py.
- P @ V: P and V in V's dtype (bf16 in a model), V as given (no V pre-pass; a strided V is copied
  contiguous first for the TMA loads).
- The output accumulates in float32 and is written in q's dtype.
Causal work: key blocks wholly below the diagonal run without mask arithmetic; only the blocks on it
are masked; blocks above it are never visited.

Measured on one H200: 1.09x cuDNN's bf16 kernel (1.04x in the model's strided layout) at 3.3% output
error with a peaked softmax (q x 4), 2.2% on SmolLM2's real q / k / v; a Llama-8B-shaped 128K prefill
with `--fp8 linear,kv,attention` 9.54 s vs 10.07 s without `attention` (bf16 11.33 s)
(docs/results.md, FP8). e4m3 scores, and e4m3 P . V, were faster still but further off (~10% output
error with e4m3 Q and K) and are not offered (starshard/config.py, `--fp8`).
"""
from __future__ import annotations

import math

import torch

from starshard.kernels.common import check_shapes, triton_interpreted
from starshard.kernels.online_softmax import LOG2E, row_lse, softmax_init, softmax_update

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # installs without triton: the torch reference still imports
    triton = None

KV_BLOCK = 128  # keys per K scale; the kernel's BLOCK_N divides it
HEAD_DIMS = (32, 64, 128, 256)  # the 8-bit tensor-core tiles the kernel builds
INT8_MAX = 127.0  # symmetric int8, scale = amax / 127
_TINY = 1e-12
# (BLOCK_M, BLOCK_N, num_warps, num_stages) at head_dim <= 128, K / V through tensor descriptors (tma):
# the fastest of a sweep on one H100 at 32K, still the fastest of the sweep's top three at 128K
# (docs/results.md, FP8).
DEFAULT_CONFIG = (128, 128, 8, 3)


if triton is not None:

    @triton.jit
    def _to_int8(x, scale):
        """x / scale rounded half away from zero to int8 (|x| <= 127 * scale): the float -> int cast
        truncates, so add +-0.5 first."""
        y = x / scale
        return (y + tl.where(y >= 0.0, 0.5, -0.5)).to(tl.int8)

    @triton.jit
    def _quantize_keys_kernel(K, K8, KS, KM, L, Lp, s_kb, s_kh, s_kn, s_kd, Hkv,
                              HEAD_DIM: tl.constexpr, KV_BLOCK: tl.constexpr):
        """One program per (KV_BLOCK keys, batch x KV head): the keys minus their mean KM [D] in int8,
        K8 rows [Lp, D], and their block scale. Rows at or past L are written as zeros."""
        blk = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // Hkv
        h = bh % Hkv
        offs_n = blk * KV_BLOCK + tl.arange(0, KV_BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        ok = (offs_n < L)[:, None]
        k = tl.load(K + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd,
                    mask=ok, other=0.0).to(tl.float32)
        k = tl.where(ok, k - tl.load(KM + bh * HEAD_DIM + offs_d)[None, :], 0.0)
        ks = tl.maximum(tl.max(tl.max(tl.abs(k), 1), 0), 1e-12) / 127.0
        k8 = _to_int8(k, ks)
        out_row = bh.to(tl.int64) * Lp
        tl.store(K8 + (out_row + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], k8)
        tl.store(KS + bh * (Lp // KV_BLOCK) + blk, ks)

    @triton.jit
    def _load_kv(k_desc, v_desc, kt_ptrs, v_ptrs, k_row, v_row, start, L, s_vn, offs_n,
                 TAIL: tl.constexpr, USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
        """K8^T [D, BLOCK_N] and V [BLOCK_N, D] of the key block at `start`. K8 is padded to a multiple of
        KV_BLOCK (zeros): no mask. V as given is masked past L on TAIL blocks; its descriptor reads the
        next head's rows there (finite, weighted by exactly 0) or zero fill.
        k_row / v_row: this (batch, KV head)'s first row in the descriptors' 2-D views."""
        if USE_TMA:
            kt = k_desc.load([k_row + start, 0]).T
            v = v_desc.load([v_row + start, 0])
        else:
            kt = tl.load(kt_ptrs + start * HEAD_DIM)
            if TAIL:
                v = tl.load(v_ptrs + start * s_vn, mask=(start + offs_n < L)[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs + start * s_vn)
        return kt, v

    @triton.jit(do_not_specialize=["L", "n_qblocks"])
    def _flash_fp8_fwd_kernel(
        Q, K8, KS, V, KM, O, LSE, k_desc, v_desc,
        qk_scale,
        s_qb, s_qh, s_qm, s_qd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_om, s_od,
        H, G, Hkv, L, Lp, n_qblocks,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr,
        USE_TMA: tl.constexpr,
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

        # Q block -> int8 with one scale for the block.
        q = tl.load(Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0), 1e-12) / 127.0
        q8 = _to_int8(q, q_scale)
        # the scores left out by smoothing, q . mean(K) per row: constant along the row, so only the lse needs it
        q_km = tl.sum(q * tl.load(KM + bkv * HEAD_DIM + offs_d)[None, :], 1)
        c_q = qk_scale * q_scale

        k_row = bkv * Lp  # first row of this (batch, KV head) in K8 [B * Hkv * Lp, D]
        kt_ptrs = K8 + k_row.to(tl.int64) * HEAD_DIM + offs_n[None, :] * HEAD_DIM + offs_d[:, None]
        v_row = bkv * L  # in V [B * Hkv * L, D] (TMA: V contiguous)
        v_ptrs = V + b.to(tl.int64) * s_vb + (h // G).to(tl.int64) * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd
        ks_ptr = KS + bkv * (Lp // KV_BLOCK)

        n_full = (pid_m * BLOCK_M) // BLOCK_N  # key blocks every row of this block sees whole
        n_blocks = tl.cdiv(tl.minimum((pid_m + 1) * BLOCK_M, L), BLOCK_N)

        m_i, l_i, acc = softmax_init(BLOCK_M, HEAD_DIM)
        for j in range(0, n_full):
            start = j * BLOCK_N
            kt, v = _load_kv(k_desc, v_desc, kt_ptrs, v_ptrs, k_row, v_row, start, L, s_vn, offs_n,
                             False, USE_TMA, HEAD_DIM)
            c = c_q * tl.load(ks_ptr + start // KV_BLOCK)
            qk = tl.dot(q8, kt).to(tl.float32)  # int8: exact int32 sums
            m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, None, c, False, False)
        # The diagonal: key j visible to row i iff j <= i (keys past L sit only beyond rows past L).
        for j in range(n_full, n_blocks):
            start = j * BLOCK_N
            kt, v = _load_kv(k_desc, v_desc, kt_ptrs, v_ptrs, k_row, v_row, start, L, s_vn, offs_n,
                             True, USE_TMA, HEAD_DIM)
            c = c_q * tl.load(ks_ptr + start // KV_BLOCK)
            qk = tl.dot(q8, kt).to(tl.float32)
            visible = (start + offs_n)[None, :] <= offs_m[:, None]
            m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, visible, c, True, False)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = row_lse(m_i, l_i, False)
        lse = lse + q_km * (qk_scale * 0.6931471805599453)  # qk_scale is in log2 units
        o_ptrs = O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + pid_bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)


class Int8Keys:
    """The pre-pass's output: k8 [B, Hkv, Lp, D] int8 of K minus k_mean (Lp = L rounded up to KV_BLOCK,
    zero rows past L), k_scale [B, Hkv, Lp // KV_BLOCK] float32, k_mean [B, Hkv, D] float32 (the mean
    over the L keys)."""

    def __init__(self, k8, k_scale, k_mean):
        self.k8, self.k_scale, self.k_mean = k8, k_scale, k_mean


def _check_inputs(q, k, v, name: str) -> None:
    check_shapes(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{name} is a square causal prefill: as many keys as query rows, got {q.shape[2]} rows and "
                         f"{k.shape[2]} keys")
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        raise ValueError(f"{name} supports head_dim 32, 64, 128 or 256 (8-bit tensor-core tiles), got {D}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} takes float16 / bfloat16 / float32 q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")


def _k_mean(k: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, D] float32: the keys' mean per channel (smoothing K by it)."""
    return k.float().mean(2)


def int8_round(x: torch.Tensor) -> torch.Tensor:
    """float x (|x| <= 127) rounded half away from zero, as the kernels' float -> int8 cast after +-0.5."""
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5)).to(torch.int8)


def _quantize_keys_torch(k) -> Int8Keys:
    """quantize_keys in torch (CPU, and the reference): the kernel's numerics, float32 division."""
    B, Hkv, L, D = k.shape
    Lp = -(-L // KV_BLOCK) * KV_BLOCK
    km = _k_mean(k)
    kp = torch.nn.functional.pad(k.float() - km[:, :, None], (0, 0, 0, Lp - L))
    kp = kp.view(B, Hkv, Lp // KV_BLOCK, KV_BLOCK, D)
    ks = kp.abs().amax((-1, -2)).clamp_min(_TINY) / INT8_MAX
    k8 = int8_round(kp / ks[..., None, None]).view(B, Hkv, Lp, D)
    return Int8Keys(k8, ks, km)


def quantize_keys(k: torch.Tensor, *, use_triton: bool | None = None) -> Int8Keys:
    """The pre-pass: K minus its mean to int8 per KV_BLOCK keys, one Triton launch after a torch mean of K.
    use_triton: default on CUDA tensors (and on CPU tensors when the kernels are interpreted)."""
    B, Hkv, L, D = k.shape
    if use_triton is None:
        use_triton = triton is not None and (k.is_cuda or triton_interpreted(_quantize_keys_kernel))
    if not use_triton:
        return _quantize_keys_torch(k)
    nblk = -(-L // KV_BLOCK)
    Lp = nblk * KV_BLOCK
    k8 = torch.empty(B, Hkv, Lp, D, dtype=torch.int8, device=k.device)
    ks = torch.empty(B, Hkv, nblk, dtype=torch.float32, device=k.device)
    km = _k_mean(k)
    if B * Hkv and nblk:
        _quantize_keys_kernel[(nblk, B * Hkv)](
            k, k8, ks, km, L, Lp, *k.stride(), Hkv,
            HEAD_DIM=D, KV_BLOCK=KV_BLOCK, num_warps=4 if D <= 64 else 8)
    return Int8Keys(k8, ks, km)


def default_config(head_dim: int) -> tuple[int, int, int, int]:
    if head_dim <= 128:
        return DEFAULT_CONFIG
    return 64, 64, 8, 2


def flash_fp8_attention(q, k, v, *, scale=None, keys: Int8Keys | None = None, config=None, tma: bool | None = None):
    """Square causal attention with int8 scores (module doc). keys: the pre-pass's output for this k
    (quantize_keys), else computed here. config = (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N must
    divide KV_BLOCK. tma: K8 / V through tensor descriptors (a strided V is copied first); default on for
    CUDA tensors (the measured faster choice), off on CPU."""
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
    if keys is None:
        keys = quantize_keys(k)
    block_m, block_n, warps, stages = config or default_config(D)
    if KV_BLOCK % block_n:
        raise ValueError(f"flash_fp8_attention: BLOCK_N {block_n} must divide KV_BLOCK {KV_BLOCK}")
    Lp = keys.k8.shape[2]
    if tma is None:
        tma = q.is_cuda
    if tma and not v.is_contiguous():
        v = v.contiguous()  # the projections' [B, L, H, D] layout: one copy of V for the faster TMA loads
    if tma:
        k_desc = TensorDescriptor(keys.k8, [B * Hkv * Lp, D], [D, 1], [block_n, D])
        v_desc = TensorDescriptor(v, [B * Hkv * L, D], [D, 1], [block_n, D])
    else:
        k_desc = v_desc = keys.k8  # unused
    n_qblocks = triton.cdiv(L, block_m)
    _flash_fp8_fwd_kernel[(n_qblocks, B * Hq)](
        q, keys.k8, keys.k_scale, v, keys.k_mean, out, lse, k_desc, v_desc,
        scale * LOG2E,
        *q.stride(), *v.stride(), *out.stride(),
        Hq, Hq // Hkv, Hkv, L, Lp, n_qblocks,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, KV_BLOCK=KV_BLOCK, USE_TMA=bool(tma),
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def int8_scores_operands(q, k, *, block_m: int = DEFAULT_CONFIG[0]):
    """The kernel's scores as plain operands: (q', k', lse_shift) with q' = q's int8 per block_m rows and
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
    keys = _quantize_keys_torch(k)
    Lp = keys.k8.shape[2]
    kd = (keys.k8.float().view(B, Hkv, Lp // KV_BLOCK, KV_BLOCK, D) * keys.k_scale[..., None, None]).view(B, Hkv, Lp, D)
    shift = (q.float() @ keys.k_mean.repeat_interleave(Hq // Hkv, 1)[..., None])[..., 0]
    return qd.to(q.dtype), kd[:, :, :L].to(q.dtype), shift


def flash_fp8_reference(q, k, v, *, scale=None, block_m: int = 128, block_n: int = 128, p_dtype=None):
    """The kernel's blockwise algorithm in torch, float64 arithmetic (any device; slow, for tests):
    Q quantized per block_m rows, K as `quantize_keys` (torch path), scores from the dequantized
    int8 values, an online softmax over key blocks of block_n in order, P rounded to p_dtype before
    P @ V (default: v's dtype, the kernel's cast; float32 keeps it). Returns (out in q's dtype, lse float32)."""
    _check_inputs(q, k, v, "flash_fp8_reference")
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    f64 = torch.float64
    # Q: one scale per (batch, head, block_m rows); rows past L do not exist (no padding in the amax)
    nqb = -(-L // block_m)
    qp = torch.nn.functional.pad(q.float(), (0, 0, 0, nqb * block_m - L)).view(B, Hq, nqb, block_m, D)
    qs = qp.abs().amax((-1, -2)).clamp_min(_TINY) / INT8_MAX
    q8 = int8_round(qp / qs[..., None, None])
    qd = (q8.to(f64) * qs[..., None, None].to(f64)).view(B, Hq, -1, D)[:, :, :L]
    keys = _quantize_keys_torch(k)
    Lp = keys.k8.shape[2]
    kd = (keys.k8.to(f64).view(B, Hkv, Lp // KV_BLOCK, KV_BLOCK, D) * keys.k_scale[..., None, None].to(f64))
    kd = kd.view(B, Hkv, Lp, D)[:, :, :L].repeat_interleave(g, 1)
    vd = v.to(f64).repeat_interleave(g, 1)
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
        p = torch.exp2(sb - m_use[..., None])
        alpha = torch.exp2(m - m_use)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p.to(p_dtype).to(f64) @ vd[:, :, start : start + block_n]
        m = m_new
    out = acc / l[..., None]
    lse = (m + torch.log2(l)) * math.log(2.0)
    # the smoothed-out q . mean(K), from q as given
    lse = lse + (q.to(f64) @ keys.k_mean.to(f64).repeat_interleave(g, 1)[..., None])[..., 0] * scale
    return out.to(q.dtype), lse.float()
