"""The Triton kernel: one program per (query block, batch x head), heaviest blocks first; A-shape /
dense heads stream two key spans, Vertical-Slash heads their diagonal ranges then their gathered
columns, Block-Sparse heads their selected key blocks. Runs on CUDA or under TRITON_INTERPRET=1."""
from __future__ import annotations

import torch

from starshard.kernels.common import cdiv, to_device, triton_interpreted
from starshard.kernels.online_softmax import LOG2E, key_chunk, key_span, softmax_finish, softmax_init

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux CPU installs: torch path only
    triton = None


if triton is not None:

    @triton.jit
    def _minference_fwd(
        Q, K, V, O, LSE, HEADS, P0, P1, SEG, SEGN, IDX, CNT, CFULL,
        qk_scale,
        s_qb, s_qh, s_qm, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_om, s_od,
        n_heads, Hq, G, Lq, Lk, off, n_qblocks, KS, KI,
        MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        # MODE 0: A-shape / dense (P0 sink, P1 local per head); 1: Vertical-Slash (SEG/SEGN runs,
        # IDX/CNT columns per row block); 2: Block-Sparse (IDX/CNT key blocks per row block).
        pid_m = n_qblocks - 1 - tl.program_id(0)  # heaviest query blocks first
        pid = tl.program_id(1)
        b = pid // n_heads
        j = pid % n_heads
        h = tl.load(HEADS + j)
        kvh = h // G
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < Lq
        d_ok = offs_d < HEAD_DIM
        q_idx = offs_m + off
        base = pid_m * BLOCK_M + off  # key index of the block's first row
        last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, Lq) - 1 + off

        q_ptrs = Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        kt_base = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[:, None] * s_kd
        v_base = V + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh + offs_d[None, :] * s_vd

        m_i, l_i, acc = softmax_init(BLOCK_M, BLOCK_D)
        row_id = (b * n_heads + j).to(tl.int64)

        if MODE == 0:
            sink = tl.load(P0 + j)
            local = tl.load(P1 + j)
            win_lo = base - local + 1  # first key of any row's window
            hi = tl.minimum(last + 1, Lk)
            sep = win_lo > sink  # sink and windows apart: the sink is a plain prefix every row sees
            zero = base - base
            s_hi = tl.where(sep, tl.minimum(sink, Lk), zero)
            m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                     zero, s_hi, zero, s_hi, zero, local, qk_scale, BLOCK_N, False, EVEN_D, IEEE)
            w_lo = tl.where(sep, win_lo, zero)
            w_sink = tl.where(sep, zero, sink)
            unm_lo = tl.maximum(w_lo, last - local + 1)
            unm_hi = tl.minimum(hi, base + 1)
            m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                     w_lo, hi, unm_lo, unm_hi, w_sink, local, qk_scale, BLOCK_N, True, EVEN_D, IEEE)
        elif MODE == 1:
            n_seg = tl.load(SEGN + row_id)
            seg_ptr = SEG + row_id * KS * 2
            for s in range(0, n_seg):
                d_first = tl.load(seg_ptr + 2 * s)
                d_last = tl.load(seg_ptr + 2 * s + 1)
                lo = tl.maximum(base - d_last, 0)
                hi = tl.minimum(base + BLOCK_M - d_first, Lk)
                m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                         lo, hi, lo, tl.minimum(hi, base + 1), 0, 0, qk_scale, BLOCK_N, False, EVEN_D, IEEE)
            blk_id = row_id * n_qblocks + pid_m
            n_col = tl.load(CNT + blk_id)
            n_full = (tl.load(CFULL + blk_id) // BLOCK_N) * BLOCK_N  # sorted: a prefix every row sees
            idx_ptr = IDX + blk_id * KI
            for c in range(0, n_full, BLOCK_N):
                cols = tl.load(idx_ptr + c + offs_n)
                m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols >= 0, s_kn, s_vn, d_ok, q_idx,
                                          0, 0, qk_scale, False, False, EVEN_D, IEEE)
            for c in range(n_full, n_col, BLOCK_N):
                ok = (c + offs_n) < n_col
                cols = tl.load(idx_ptr + c + offs_n, mask=ok, other=0)
                m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, ok, s_kn, s_vn, d_ok, q_idx,
                                          0, 0, qk_scale, True, False, EVEN_D, IEEE)
        else:
            blk_id = row_id * n_qblocks + pid_m
            n_blk = tl.load(CNT + blk_id)
            n_full = tl.load(CFULL + blk_id)  # sorted: leading blocks every row sees in full
            idx_ptr = IDX + blk_id * KI
            for t in range(0, n_full):
                cols = tl.load(idx_ptr + t) * BLOCK_N + offs_n
                m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols >= 0, s_kn, s_vn, d_ok, q_idx,
                                          0, 0, qk_scale, False, False, EVEN_D, IEEE)
            for t in range(n_full, n_blk):
                cols = tl.load(idx_ptr + t) * BLOCK_N + offs_n
                m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols < Lk, s_kn, s_vn, d_ok, q_idx,
                                          0, 0, qk_scale, True, False, EVEN_D, IEEE)

        out, lse = softmax_finish(m_i, l_i, acc, False)
        o_ptrs = O + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + (b * Hq + h).to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


def triton_available(q: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA tensors, or on CPU tensors when Triton is interpreted."""
    if triton is None or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if q.is_cuda:
        return True
    return q.device.type == "cpu" and triton_interpreted(_minference_fwd)


def default_launch(head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) for a 64-row block. Chosen so that ptxas (sm_90a) reports no register
    spills; not yet timed on a GPU (launch/bench.py sparse --launch W,S compares)."""
    if head_dim <= 64:
        return 4, 2
    return (8, 2) if head_dim <= 128 else (8, 1)


def attention_triton(q, k, v, groups, *, offset, scale, block_size, launch=None):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    BM = block_size
    n_qblocks = cdiv(Lq, BM)
    warps, stages = launch or default_launch(block_d)
    dev = q.device
    for grp in groups:
        nH = len(grp.heads)
        heads_t = to_device(grp.heads, dev, torch.int32)
        dummy = heads_t
        p0 = p1 = seg = segn = idx = cnt = cfull = dummy
        ks = ki = 0
        if grp.kind == "a_shape":
            mode = 0
            p0 = to_device(grp.sink, dev, torch.int32)
            p1 = to_device(grp.local, dev, torch.int32)
        elif grp.kind == "vertical_slash":
            mode = 1
            ix = grp.index
            seg, segn, idx, cnt, cfull = ix.seg, ix.seg_count, ix.col, ix.col_count, ix.col_full
            ks, ki = seg.shape[2], idx.shape[3]
            if ks == 0:
                seg = dummy
        else:
            mode = 2
            ix = grp.index
            idx, cnt, cfull = ix.blocks, ix.count, ix.full
            ki = idx.shape[3]
        if mode == 1 and ki == 0:
            idx = dummy
        grid = (n_qblocks, B * nH)
        _minference_fwd[grid](
            q, k, v, out, lse, heads_t, p0, p1, seg, segn, idx, cnt, cfull,
            scale * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            nH, Hq, Hq // Hkv, Lq, Lk, offset, n_qblocks, ks, ki,
            MODE=mode, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=BM, BLOCK_N=BM,
            IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
        )
    return out, lse
