"""Split-KV attention for short query blocks over long caches (decode), with log-sum-exp.

    out, lse = decode_attention(q, k, v, q_pos=..., k_pos=..., causal=True, scale=None)

Same contract as `attention` (docs/design.md). A few query rows cannot fill a GPU one program per head,
so the keys are cut into `num_splits` chunks that run in parallel; each writes a partial (out, lse)
and a second kernel merges them by lse. The g query heads of a KV head (and all their rows) share
one program, so every K/V byte is read once. On CPU the same split-and-merge runs in torch.

`window`, `softcap`, `sinks` (attention.py contract): with a window the splits share out only the keys
between the first that some row's window reaches and the last that some row sees (`window_key_range`,
on the device), so keys wholly outside every window are never read; the sink joins once, in the
merge. All three are compile-time switches: without them the kernels are the ones they were.
"""
from __future__ import annotations

import torch

from starshard.kernels.common import as_positions, check_extras, check_kernel_inputs, check_shapes, sm_count
from starshard.kernels.merge import apply_sink, merge_many
from starshard.kernels.online_softmax import (LOG2E, qk_dot, row_lse, softcap_scores, softmax_finish, softmax_init,
                                              softmax_update, softmax_update_scaled_v)
from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait
from starshard.kernels.reference import attention_math

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton (non-Linux CPU) keep the torch path
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: plain loads
    TensorDescriptor = None

# Keys per split at least, and the programs aimed at per multiprocessor, never more: one for 16-bit caches,
# two for e4m3 (half the bytes per key). Measured on an H100 (bench/decode_splits.py,
# docs/results.md, Decode): two 16-bit programs per multiprocessor read slower than one,
# and a few programs past a whole wave cost as much as a wave (Llama-8B heads at 128K keys: 33 splits
# 208 us, 17 splits 204 us, 16 splits 181 us).
_MIN_CHUNK = 128
_PROGRAMS_PER_SM = {False: 1, True: 2}


def _torch_decode(q, k, v, q_pos, k_pos, causal, scale, num_splits, window=None, softcap=None, sinks=None):
    """The split-and-merge in torch (CPU, and the reference of the kernel); k, v dequantized already."""
    Lk = k.shape[2]
    chunk = -(-Lk // num_splits)
    parts = [
        attention_math(q.float(), k[:, :, s : s + chunk].float(), v[:, :, s : s + chunk].float(),
                       q_pos=q_pos, k_pos=k_pos[..., s : s + chunk], causal=causal, scale=scale, window=window,
                       softcap=softcap)
        for s in range(0, Lk, chunk)
    ]
    out, lse = merge_many(torch.stack([p[0] for p in parts], -2), torch.stack([p[1] for p in parts], -1))
    out, lse = apply_sink(out, lse, sinks)  # once, after the merge
    return out.to(q.dtype), lse


def window_key_range(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """int32 [P, 2]: per row of positions, key indices [lo, hi) outside which no key is visible to any
    query row under `window`: the keys before lo have running max <= min(q_pos) - window, those from hi
    on have suffix min > max(q_pos). Exact for any positions (unsorted ones just narrow less); on the
    device, no host sync (CUDA graphs)."""
    qp, kp = q_pos.to(torch.int64), k_pos.to(torch.int64)
    prefix_max = kp.cummax(-1).values
    suffix_min = kp.flip(-1).cummin(-1).values.flip(-1).contiguous()
    lo = torch.searchsorted(prefix_max, qp.amin(-1, keepdim=True) - window, right=True)
    hi = torch.searchsorted(suffix_min, qp.amax(-1, keepdim=True), right=True)
    return torch.cat([lo, torch.maximum(hi, lo)], -1).to(torch.int32).contiguous()


if triton is not None:

    # Cache lengths change every step: no variant per divisibility of the sizes. Nor of the position rows'
    # strides (Lq, Lk): a service's own-KV pool is regathered with a new capacity whenever a row joins or
    # leaves, and a new variant would compile (seconds) inside a stream's inter-token gap.
    @triton.jit(do_not_specialize=["Lq", "Lk", "chunk", "n_splits", "s_qpb", "s_kpb"])
    def _decode_split_kernel(
        Q, K, V, OP, LP, QPOS, KPOS, LK_PTR, KS, VS,
        qk_scale,
        s_qb, s_qh, s_qm, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_qpb, s_kpb, s_sb, s_sh,
        Hkv, G, Lq, Lk, chunk, n_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, IEEE: tl.constexpr, HAS_LK: tl.constexpr, FP8: tl.constexpr,
        USE_PDL: tl.constexpr = False,
        # window / softcap (last: callers that pass arguments by position keep working)
        KRANGE=None, window=0, cap_in=1.0, cap_out=1.0, s_krb=0,
        WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
        KVT=None, TABLE: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        if TABLE:  # K, V, KPOS are anchors: the cache's element offsets from them are read on the device
            # multiples of TABLE_ALIGN (table_row checks): the loads stay vectorized and pipelined as the plain path's
            K = K + tl.multiple_of(tl.load(KVT), 16)
            V = V + tl.multiple_of(tl.load(KVT + 1), 16)
            KPOS = KPOS + tl.load(KVT + 2)
        split = tl.program_id(0)
        if HAS_LK:  # valid keys read on the device (CUDA-graph decode: the cache length changes per replay)
            # int32 whatever the pointer's type (a table's is int64): 64-bit key indices would cost registers and
            # instructions in every mask (254 registers against 238 at BLOCK_M 64)
            Lk = tl.load(LK_PTR).to(tl.int32)
            chunk = tl.cdiv(tl.cdiv(Lk, n_splits), BLOCK_N) * BLOCK_N  # every split gets work, not just the first
        row_block = tl.program_id(1)
        pid_bk = tl.program_id(2)
        b = pid_bk // Hkv
        kvh = pid_bk % Hkv
        Hq = Hkv * G

        # Rows of this KV head's group: row r is query head kvh*G + r // Lq, query row r % Lq.
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * Lq
        hq = kvh * G + rows // Lq
        qi = rows % Lq
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM

        q_ptrs = Q + b.to(tl.int64) * s_qb + hq[:, None].to(tl.int64) * s_qh + qi[:, None] * s_qm + offs_d[None, :] * s_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if FP8 and not IEEE:
            # e4m3 -> fp16 is one hardware conversion per two values on Hopper, e4m3 -> bf16 three (via
            # fp16): the products run in fp16, exact for e4m3 keys / values. |q| beyond fp16's range
            # (65504) is clamped rather than turned into inf.
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        if CAUSAL:
            q_pos = tl.load(QPOS + b * s_qpb + qi, mask=row_ok, other=0)
        kt_ptrs = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd
        v_ptrs = V + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd
        s_off = b.to(tl.int64) * s_sb + kvh.to(tl.int64) * s_sh  # FP8: scales [B, Hkv, cap] of k and v

        m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)
        if WINDOW:  # the splits share out only keys k_lo .. k_hi - 1 (window_key_range)
            k_lo = tl.load(KRANGE + b * s_krb)
            k_hi = tl.minimum(tl.load(KRANGE + b * s_krb + 1), Lk)
            chunk = tl.cdiv(tl.cdiv(tl.maximum(k_hi - k_lo, 0), n_splits), BLOCK_N) * BLOCK_N
            lo = k_lo + split * chunk
            hi = tl.minimum(lo + chunk, k_hi)
        else:
            lo = split * chunk
            hi = tl.minimum(lo + chunk, Lk)
        for start in range(lo, hi, BLOCK_N):
            col_ok = (start + offs_n) < hi
            kt = tl.load(kt_ptrs + start * s_kn, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + start * s_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if FP8:  # e4m3 -> q's dtype (fp16 / fp32) is exact; the per-key scales go on the float32 scores and probabilities
                ks = tl.load(KS + s_off + start + offs_n, mask=col_ok, other=0.0)
                vs = tl.load(VS + s_off + start + offs_n, mask=col_ok, other=0.0)
                qk = qk_dot(q, kt.to(q.dtype), IEEE) * ks[None, :]
            else:
                qk = qk_dot(q, kt, IEEE)
            visible = col_ok[None, :]
            if CAUSAL:
                k_pos = tl.load(KPOS + b * s_kpb + start + offs_n, mask=col_ok, other=0)
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
                if WINDOW:
                    visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            step_scale = qk_scale
            if SOFTCAP:  # scores already in log2 units
                qk = softcap_scores(qk, cap_in, cap_out)
                step_scale = 1.0
            if FP8:
                m_i, l_i, acc = softmax_update_scaled_v(qk, v.to(q.dtype), vs, m_i, l_i, acc, visible, step_scale, IEEE)
            else:
                m_i, l_i, acc = softmax_update(qk, v, m_i, l_i, acc, visible, step_scale, True, IEEE)

        out, lse2 = softmax_finish(m_i, l_i, acc, True)  # partial lse in log2 units; the merge converts once
        part = ((b * Hq + hq).to(tl.int64) * Lq + qi) * n_splits + split
        tl.store(OP + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LP + part, lse2, mask=row_ok)

    @triton.jit
    def _fp8_block(q, K, V, KS, VS, k_off, v_off, s_off, s_kn, s_kd, s_vn, s_vd, kv_row, start, n, offs_d, hi, m_i,
                   l_i, acc, qk_scale, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
        """Keys start .. start + BLOCK_N - 1 of an e4m3 cache folded into the softmax of the fp16 rows q.
        MASKED: keys n >= hi are hidden (scores -inf, values 0: with TMA they are whatever follows in
        the cache, NaN included); off, every key counts and nothing is masked. TMA: K, V, KS, VS are
        descriptors over the contiguous cache rows (kv_row: this head's first row); else pointers, this
        head's K, V at offsets k_off, v_off and its scales at s_off."""
        d_ok = offs_d < HEAD_DIM
        if not TMA:
            kt_ptrs = K + k_off + n[None, :] * s_kn + offs_d[:, None] * s_kd
            v_ptrs = V + v_off + n[:, None] * s_vn + offs_d[None, :] * s_vd
            ks_ptrs = KS + s_off + n
            vs_ptrs = VS + s_off + n
        if TMA:
            kt = K.load([kv_row + start, 0]).T
            v = V.load([kv_row + start, 0])
            ks = KS.load([kv_row + start])
            vs = VS.load([kv_row + start])
        elif MASKED:
            col_ok = n < hi
            kt = tl.load(kt_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            ks = tl.load(ks_ptrs, mask=col_ok, other=0.0)
            vs = tl.load(vs_ptrs, mask=col_ok, other=0.0)
        elif HEAD_DIM == offs_d.shape[0]:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
            ks = tl.load(ks_ptrs)
            vs = tl.load(vs_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            ks = tl.load(ks_ptrs)
            vs = tl.load(vs_ptrs)
        v = v.to(tl.float16)  # e4m3 -> fp16: exact, one conversion per two values
        qk = tl.dot(q, kt.to(tl.float16)) * (ks * qk_scale)[None, :]  # log2 units
        if MASKED:
            col_ok = n < hi
            if TMA:
                vs = tl.where(col_ok, vs, 0.0)
                v = tl.where(col_ok[:, None], v, 0.0)
            qk = tl.where(col_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp2 -> 0, not NaN
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = m_new
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        # Per-key value scales on the probabilities, the block's largest factored out so that the fp16
        # probabilities stay in [0, 1] (p * v_scale alone can fall below fp16's normal range).
        s_max = tl.max(vs, 0)
        s_max = tl.where(s_max > 0.0, s_max, 1.0)
        pv = (p * (vs * (1.0 / s_max))[None, :]).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(pv, v) * s_max
        return m_new, l_i, acc

    # e4m3 cache, 16-bit queries, no causal mask (the CUDA-graph decode step): whole key blocks run
    # unmasked, at most one masked block per split. Its prologue repeats _decode_split_kernel's on
    # purpose: shared as Triton helpers it took 255 registers instead of 184 and ran 94.0 instead of
    # 92.7 us per layer on an H200 (docs/results.md, Decode).
    @triton.jit(do_not_specialize=["Lq", "Lk", "chunk", "n_splits"])
    def _decode_split_fp8_kernel(
        Q, K, V, OP, LP, LK_PTR, KS, VS,
        qk_scale,
        s_qb, s_qh, s_qm, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_sb, s_sh,
        Hkv, G, Lq, Lk, cap, chunk, n_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LK: tl.constexpr, TMA: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        split = tl.program_id(0)
        if HAS_LK:
            Lk = tl.load(LK_PTR)
            chunk = tl.cdiv(tl.cdiv(Lk, n_splits), BLOCK_N) * BLOCK_N
        row_block = tl.program_id(1)
        pid_bk = tl.program_id(2)
        b = pid_bk // Hkv
        kvh = pid_bk % Hkv
        Hq = Hkv * G
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * Lq
        hq = kvh * G + rows // Lq
        qi = rows % Lq
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(Q + b.to(tl.int64) * s_qb + hq[:, None].to(tl.int64) * s_qh + qi[:, None] * s_qm + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # fp16 products, exact for e4m3 keys / values; |q| beyond fp16's range is clamped, not inf.
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        k_off = b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh
        v_off = b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh
        s_off = b.to(tl.int64) * s_sb + kvh.to(tl.int64) * s_sh
        kv_row = (b * Hkv + kvh) * cap  # TMA: this head's first row of the [B * Hkv * cap, D] view

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, Lk)
        mid = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, mid, BLOCK_N):
            m_i, l_i, acc = _fp8_block(q, K, V, KS, VS, k_off, v_off, s_off, s_kn, s_kd, s_vn, s_vd, kv_row, start,
                                       start + offs_n, offs_d, hi, m_i, l_i, acc, qk_scale, HEAD_DIM, False, TMA)
        for start in tl.range(mid, hi, BLOCK_N, num_stages=1):
            m_i, l_i, acc = _fp8_block(q, K, V, KS, VS, k_off, v_off, s_off, s_kn, s_kd, s_vn, s_vd, kv_row, start,
                                       start + offs_n, offs_d, hi, m_i, l_i, acc, qk_scale, HEAD_DIM, True, TMA)

        out, lse2 = softmax_finish(m_i, l_i, acc, True)  # partial lse in log2 units; the merge converts once
        part = ((b * Hq + hq).to(tl.int64) * Lq + qi) * n_splits + split
        tl.store(OP + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LP + part, lse2, mask=row_ok)

    @triton.jit(do_not_specialize=["Lq", "n_splits"])
    def _decode_merge_kernel(
        OP, LP, O, LSE,
        s_ob, s_oh, s_om, s_od,
        Hq, Lq, n_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
        SINKS=None, SINK: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        row = tl.program_id(0)  # flat (b, hq, qi)
        qi = row % Lq
        bh = row // Lq
        b = bh // Hq
        hq = bh % Hq
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        base = row.to(tl.int64) * n_splits
        # One pass, BLOCK_S splits at a time, rescaled as the running max grows: with BLOCK_S >= n_splits
        # (the usual case) every load is issued at once instead of two dependent rounds.
        m = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0)
        den = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s0 in range(0, n_splits, BLOCK_S):
            s_ok = s0 + offs_s < n_splits
            lp = tl.load(LP + base + s0 + offs_s, mask=s_ok, other=float("-inf"))
            o = tl.load(OP + (base + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            m_new = tl.maximum(m, tl.max(lp, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            c = tl.math.exp2(m - m_use)
            w = tl.math.exp2(lp - m_use)
            den = den * c + tl.sum(w, 0)
            acc = acc * c + tl.sum(w[:, None] * o, 0)
            m = m_new
        m_use = tl.where(m == float("-inf"), 0.0, m)
        if SINK:  # exp(sink) joins the denominator once, here; the lse excludes it
            out = acc / (den + tl.math.exp2(tl.load(SINKS + hq).to(tl.float32) * 1.4426950408889634 - m_use))
        else:
            out = acc / tl.where(den == 0.0, 1.0, den)
        lse = row_lse(m_use, den, False)
        o_ptrs = O + b.to(tl.int64) * s_ob + hq.to(tl.int64) * s_oh + qi * s_om + offs_d * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=d_ok)
        tl.store(LSE + row, lse)


# Options of the e4m3-cache path (bench/fp8_decode_split.py; docs/results.md, Decode).
# even: _decode_split_fp8_kernel (whole key blocks unmasked) where it applies,
# instead of the general kernel: 92.7 vs 93.8 us per layer at 128K keys on an H200 (on an H100, HBM-bound,
# 107.5 vs 107.1). tma: its loads through tensor descriptors: 102.4 us on the H200 (slower), 103.8 on the
# H100. config: its (BLOCK_N, num_warps, num_stages).
_FP8_OPTIONS = {"even": True, "tma": False, "config": (128, 4, 3)}


# Splits the merge reads per round: one value for every split count (a variant per count would compile, seconds,
# when a new batch or length first meets it, inside a stream's inter-token gap).
_MERGE_SPLITS = 64


def _num_splits(device: torch.device, programs_per_split: int, Lk: int, fp8: bool = False) -> int:
    """As many splits as fit _PROGRAMS_PER_SM programs per multiprocessor (fp8: an e4m3 cache) in one
    round, no chunk under _MIN_CHUNK keys."""
    target = _PROGRAMS_PER_SM[fp8] * sm_count(device) if device.type == "cuda" else 8
    want = target // max(1, programs_per_split)
    return max(1, min(want, -(-Lk // _MIN_CHUNK)))


def _tiles(rows: int, D: int, fp8: bool = False) -> tuple[int, int, int, tuple[int, int, int]]:
    """The split kernel's tiles for `rows` query rows per KV head (its query heads x query tokens) and head_dim D:
    (BLOCK_M, row blocks, BLOCK_D, the default (BLOCK_N, warps, stages)). e4m3 keys / values: twice the keys per
    tile for the same bytes in flight (first guess; bench/fp8_tune.py)."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_d = max(16, triton.next_power_of_2(D))
    default = ((128 if fp8 else 64), 4, 3) if block_d <= 128 else (32, 4, 2)
    return block_m, -(-rows // block_m), block_d, default


def decode_attention(q, k, v, *, q_pos, k_pos, causal=True, scale=None, num_splits=None, use_triton=None, config=None,
                     length: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, options: dict | None = None, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     table: torch.Tensor | None = None):
    """q [B, Hq, Lq, D] (Lq small), k, v [B, Hkv, Lk, D]; positions [L] or [B, L].
    `use_triton` defaults to CUDA inputs (set it to run the kernel under TRITON_INTERPRET on CPU);
    `config` = (BLOCK_N, num_warps, num_stages) overrides the defaults (tuning).
    `length`: int32 tensor [1] on q's device, the number of valid leading keys (the rest of k / v is
    ignored); read by the kernel, so a captured CUDA graph stays right as the cache grows. The
    torch path reads it on the host.
    `k_scale`, `v_scale`: with e4m3 k, v (an FP8 KV cache), float32 scales [B, Hkv, >= Lk], one per
    (KV head, key) (kernels/fp8.py quantize_rows): the kernel reads the e4m3 bytes and dequantizes in
    registers; the torch path dequantizes first.
    `options`: overrides of _FP8_OPTIONS (the e4m3 path's kernel choice, tuning).
    `window`, `softcap`, `sinks`: the attention.py contract; the e4m3 cache takes them through the
    general kernel (the unmasked "even" one has none of them).
    `table`: int64 [4] on q's device, (k, v, k_pos element offsets, valid keys), all read by the kernel: the
    keys are those of a cache elsewhere, of k, v, k_pos's dtypes and strides (k, v, k_pos: anchors, one
    row suffices), so one captured CUDA graph serves any cache of that layout (the service's decode graphs,
    serving/cascade.py TableCascade). Kernel only, B = 1, causal; no window, e4m3 cache or sinks."""
    check_shapes(q, k, v)
    check_extras(q, causal, window, softcap, sinks, "decode_attention")
    use_triton = q.device.type == "cuda" if use_triton is None else use_triton
    if table is not None:
        return _decode_table(q, k, v, q_pos, k_pos, table, scale, num_splits, use_triton, config, causal, window,
                             softcap, sinks, k_scale)
    if length is not None and not use_triton:
        n = int(length.reshape(-1)[0])
        k, v = k[:, :, :n], v[:, :, :n]
        k_pos = k_pos[..., :n]
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    qp = as_positions(q_pos, B, Lq, "q_pos", q.device)
    kp = as_positions(k_pos, B, Lk, "k_pos", q.device)
    if Lq == 0 or Lk == 0 or B * Hq == 0:  # with sinks too: no key, out 0
        return q.new_zeros(q.shape), torch.full((B, Hq, Lq), float("-inf"), device=q.device)
    fp8 = k_scale is not None
    if fp8 and not use_triton:
        k = (k.float() * k_scale[:, :, :Lk, None]).to(q.dtype)
        v = (v.float() * v_scale[:, :, :Lk, None]).to(q.dtype)
    if not use_triton:
        return _torch_decode(q, k, v, qp, kp, causal, scale, num_splits or _num_splits(q.device, B * Hkv, Lk),
                             window, softcap, sinks)
    if triton is None:
        raise RuntimeError("decode_attention: the Triton kernel needs the triton package")
    check_kernel_inputs(q, q if fp8 else k, q if fp8 else v, "decode_attention")
    if fp8 and (k_scale.stride(2) != 1 or v_scale.stride() != k_scale.stride()):
        raise ValueError("decode_attention: k_scale and v_scale must be [B, Hkv, L] with unit stride along L and equal strides")
    G = Hq // Hkv
    block_m, row_blocks, block_d, default = _tiles(G * Lq, D, fp8)
    if num_splits is None:  # with a window, keys a decode step can see (more with a span of query positions)
        num_splits = _num_splits(q.device, B * Hkv * row_blocks, Lk if window is None else min(Lk, window + Lq), fp8)
    opts = {**_FP8_OPTIONS, **(options or {})}
    # e4m3 cache, 16-bit queries, no causal mask, options "even": the kernel without per-block masks
    fp8_even = fp8 and q.dtype != torch.float32 and not causal and opts["even"] and softcap is None and sinks is None
    if fp8_even:
        default = opts["config"]
    block_n, warps, stages = config or default
    per_split = -(-Lk // num_splits)
    chunk = -(-per_split // block_n) * block_n  # whole key blocks per split
    num_splits = -(-Lk // chunk)
    if qp.shape[0] != kp.shape[0]:
        qp, kp = qp.expand(B, Lq).contiguous(), kp.expand(B, Lk).contiguous()
    s_pb = 0 if qp.shape[0] == 1 else 1
    o_part = torch.empty(B, Hq, Lq, num_splits, D, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, Lq, num_splits, dtype=torch.float32, device=q.device)
    grid = (num_splits, row_blocks, B * Hkv)
    if fp8_even:
        cap = k.shape[2]
        tma = (opts["tma"] and TensorDescriptor is not None and D == block_d and all(
            t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (k, v, k_scale, v_scale))
            and k_scale.shape[2] == cap and cap % 4 == 0 and D * k.element_size() % 16 == 0)  # 16-byte scale rows
        if tma:
            rows_kv = B * Hkv * cap
            k_arg = TensorDescriptor(k, [rows_kv, D], [D, 1], [block_n, D])
            v_arg = TensorDescriptor(v, [rows_kv, D], [D, 1], [block_n, D])
            ks_arg = TensorDescriptor(k_scale, [rows_kv], [1], [block_n])
            vs_arg = TensorDescriptor(v_scale, [rows_kv], [1], [block_n])
        else:
            k_arg, v_arg, ks_arg, vs_arg = k, v, k_scale, v_scale
        _decode_split_fp8_kernel[grid](
            q, k_arg, v_arg, o_part, l_part, length if length is not None else qp, ks_arg, vs_arg,
            scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), k_scale.stride(0), k_scale.stride(1),
            Hkv, G, Lq, Lk, cap, chunk, num_splits,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, HAS_LK=length is not None, TMA=tma,
            num_warps=warps, num_stages=stages, **pdl_launch(q),
        )
    else:
        extras = {}  # only the arguments that are on: the default launch is the kernel as it was
        if window is not None:
            extras.update(KRANGE=window_key_range(qp, kp, window), window=int(window), s_krb=2 * s_pb, WINDOW=True)
        if softcap is not None:
            extras.update(cap_in=scale / float(softcap), cap_out=float(softcap) * LOG2E, SOFTCAP=True)
        _decode_split_kernel[grid](
            q, k, v, o_part, l_part, qp, kp, length if length is not None else qp,
            k_scale if fp8 else o_part, v_scale if fp8 else o_part,
            scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(),
            s_pb * Lq, s_pb * Lk, k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
            Hkv, G, Lq, Lk, chunk, num_splits,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
            CAUSAL=bool(causal), IEEE=q.dtype == torch.float32, HAS_LK=length is not None, FP8=fp8,
            num_warps=warps, num_stages=stages, **pdl_launch(q), **extras,
        )
    return _merge_splits(q, o_part, l_part, block_d, sinks)


def _merge_splits(q, o_part, l_part, block_d: int, sinks=None):
    """The splits' partials o_part [B, Hq, Lq, n, D], l_part [B, Hq, Lq, n] merged by lse (the sink once) -> (out
    in q's dtype and layout, lse)."""
    B, Hq, Lq, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    sink = {}
    if sinks is not None:
        sink.update(SINKS=sinks.to(device=q.device, dtype=torch.float32).contiguous(), SINK=True)
    _decode_merge_kernel[(B * Hq * Lq,)](
        o_part, l_part, out, lse,
        *out.stride(),
        Hq, Lq, o_part.shape[3],
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=_MERGE_SPLITS,
        num_warps=4 if block_d >= 128 else 2, **pdl_launch(o_part), **sink,
    )
    return out, lse


# The table's k / v offsets are multiples of this (table_row refuses others). Without the promise the K / V bases
# carry no alignment and the kernel loads the cache element by element, unpipelined (Triton 3.6, ptxas at
# sm_90a: 255 registers and spills; 189-254 and none with it)
TABLE_ALIGN = 16


def _decode_table(q, k, v, q_pos, k_pos, table, scale, num_splits, use_triton, config, causal, window, softcap, sinks,
                  k_scale):
    """decode_attention's `table` path: the general kernel with its K, V, KPOS offset on the device."""
    for bad, what in ((not use_triton or triton is None, "the Triton kernel"), (not causal, "causal=True"),
                      (window is not None, "no window"), (sinks is not None, "no sinks"),
                      (k_scale is not None, "no e4m3 cache"), (q.shape[0] != 1, "one batch row (B = 1)")):
        if bad:
            raise ValueError(f"decode_attention: a `table` needs {what}")
    if table.dtype != torch.int64 or table.shape != (4,) or table.device != q.device or not table.is_contiguous():
        raise ValueError(f"decode_attention: `table` must be a contiguous int64 [4] on {q.device}")
    if k_pos.dtype != torch.int64 or k_pos.device != q.device or k_pos.reshape(-1).stride(0) != 1:
        raise ValueError("decode_attention: with a `table`, k_pos must be an int64 anchor row on q's device")
    check_kernel_inputs(q, k, v, "decode_attention")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    qp = as_positions(q_pos, B, Lq, "q_pos", q.device)
    G = Hq // Hkv
    block_m, row_blocks, block_d, default = _tiles(G * Lq, D)
    block_n, warps, stages = config or default
    # the cache's length is known on the device only: as many splits as fill the GPU once (chunk: on the device)
    num_splits = num_splits or _num_splits(q.device, B * Hkv * row_blocks, 1 << 40)
    o_part = torch.empty(B, Hq, Lq, num_splits, D, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, Lq, num_splits, dtype=torch.float32, device=q.device)
    extras = {}
    if softcap is not None:
        extras.update(cap_in=scale / float(softcap), cap_out=float(softcap) * LOG2E, SOFTCAP=True)
    _decode_split_kernel[(num_splits, row_blocks, B * Hkv)](
        q, k, v, o_part, l_part, qp, k_pos, table[3:], o_part, o_part,
        scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(),
        0, 0, 0, 0,
        Hkv, G, Lq, Lk, block_n, num_splits,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=True, IEEE=q.dtype == torch.float32, HAS_LK=True, FP8=False,
        num_warps=warps, num_stages=stages, **pdl_launch(q), KVT=table, TABLE=True, **extras,
    )
    return _merge_splits(q, o_part, l_part, block_d)


def table_row(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, length: int, anchors) -> list[int]:
    """decode_attention's `table` for the cache k, v [1, Hkv, cap, D], k_pos [cap] (its first `length` keys)
    against `anchors` (k, v, k_pos as passed with it): ValueError where the layouts differ (the captured
    kernel would read the cache with the anchors' strides)."""
    ak, av, ap = anchors
    for t, a, name in ((k, ak, "k"), (v, av, "v"), (k_pos, ap, "k_pos")):
        if t.dtype != a.dtype or t.device != a.device:
            raise ValueError(f"table_row: {name} is {t.dtype} on {t.device}, its anchor {a.dtype} on {a.device}")
    if k.stride()[1:] != ak.stride()[1:] or v.stride()[1:] != av.stride()[1:] or k.shape[1] != ak.shape[1] \
            or k.shape[3] != ak.shape[3] or k_pos.reshape(-1).stride(0) != 1:
        raise ValueError(f"table_row: the cache's strides {k.stride()} / {v.stride()} differ from the anchors' "
                         f"{ak.stride()} / {av.stride()}")
    size = k.element_size()
    off = [(k.data_ptr() - ak.data_ptr()) // size, (v.data_ptr() - av.data_ptr()) // size]
    if any(o % TABLE_ALIGN for o in off):  # the kernel assumes it: its K / V loads stay vectorized and pipelined
        raise ValueError(f"table_row: the cache's k / v start {off} elements from the anchors', not a multiple of "
                         f"{TABLE_ALIGN}")
    return [*off, (k_pos.data_ptr() - ap.data_ptr()) // 8, int(length)]
