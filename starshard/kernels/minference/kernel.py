"""The Triton kernels: one program per (query block, batch x head), heaviest blocks first; A-shape /
dense heads stream two key spans, Vertical-Slash heads their diagonal ranges then their gathered
columns, Block-Sparse heads their selected key blocks. Runs on CUDA or under TRITON_INTERPRET=1.

`Launch` picks a variant (issue 18, item 3; docs/results.md, Sparse prefill,
one H100 at 128K): by default Vertical-Slash heads run `flat` where the
head dim is above 64 (1.08-1.18x the per-run loops at d128; at d64 it lost on the default pattern),
and `default_launch` sets warps and stages per head dim and kind; `pair` (3x slower) runs two index
row blocks per program (A-shape heads as one 2*block_size-row tile, Vertical-Slash heads in
`_vs_pair_fwd`, which loads each diagonal-run key chunk once for both blocks), `flat` streams all
diagonal runs of a row block in one loop (one software pipeline instead of one per run), `wide` takes
the mask-free chunks of contiguous spans two at a time. Every variant computes exactly the same
visibility as the index says (tests/test_minference_kernel_variants.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.kernels.common import cdiv, to_device, triton_interpreted
from starshard.kernels.minference.plan import column_cost, kernel_cost
from starshard.kernels.online_softmax import (
    LOG2E, key_chunk, key_span, softmax_finish, softmax_init, softmax_step,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # non-Linux CPU installs: torch path only
    triton = None


if triton is not None:
    RUNS_AT_ONCE = tl.constexpr(64)  # diagonal runs one vector step of the counting passes reads

    @triton.jit
    def _kv(kt_base, v_base, cols, s_kn, s_vn, d_ok, Lk, EVEN_D: tl.constexpr):
        """K^T [D, N] and V [N, D] of keys `cols` clamped into [0, Lk): in bounds whatever the chunk,
        so the loads carry no per-key predicate; the caller masks the scores of keys it must not see."""
        c = tl.minimum(tl.maximum(cols, 0), Lk - 1)
        if EVEN_D:
            kt = tl.load(kt_base + c[None, :] * s_kn)
            v = tl.load(v_base + c[:, None] * s_vn)
        else:
            kt = tl.load(kt_base + c[None, :] * s_kn, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + c[:, None] * s_vn, mask=d_ok[None, :], other=0.0)
        return kt, v

    @triton.jit
    def _seen(cols, hi, q_idx):
        """Rows at key indices q_idx see the keys of `cols` in [0, hi) at or before them: [M, N]."""
        return ((cols >= 0) & (cols < hi))[None, :] & (cols[None, :] <= q_idx[:, None])

    @triton.jit
    def _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx, lo, hi, unm_lo, unm_hi,
              sink, window, qk_scale,
              BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
              WIDE: tl.constexpr):
        """`key_span`; WIDE: its mask-free chunks two at a time (2 * BLOCK_N keys per product), the
        chunk grid unchanged, so the same scores are computed."""
        if WIDE:
            n_chunks = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
            n_head = tl.minimum((tl.maximum(unm_lo - lo, 0) + BLOCK_N - 1) // BLOCK_N, n_chunks)
            n_fit = tl.maximum(tl.minimum(tl.maximum(unm_hi - lo, 0) // BLOCK_N, n_chunks), n_head)
            w_lo = lo + n_head * BLOCK_N
            w_hi = w_lo + ((n_fit - n_head) // 2) * 2 * BLOCK_N
            offs_w = tl.arange(0, 2 * BLOCK_N)
            for x in range(w_lo, w_hi, 2 * BLOCK_N):
                m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, x + offs_w, offs_w >= 0, s_kn, s_vn,
                                          d_ok, q_idx, sink, window, qk_scale, False, WINDOW, EVEN_D, IEEE)
            # the masked leading chunks, then what is left after the wide ones (same grid)
            m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx, lo,
                                     tl.minimum(w_lo, hi), unm_lo, unm_hi, sink, window, qk_scale, BLOCK_N, WINDOW,
                                     EVEN_D, IEEE)
            m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx, w_hi, hi,
                                     unm_lo, unm_hi, sink, window, qk_scale, BLOCK_N, WINDOW, EVEN_D, IEEE)
        else:
            m_i, l_i, acc = key_span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx, lo, hi,
                                     unm_lo, unm_hi, sink, window, qk_scale, BLOCK_N, WINDOW, EVEN_D, IEEE)
        return m_i, l_i, acc

    @triton.jit
    def _columns(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx, idx_ptr, n_col, n_full,
                 qk_scale, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr):
        """A row block's gathered columns, BLOCK_N at a time; the first n_full (sorted: a prefix every
        row sees) without masks."""
        n_full = (n_full // BLOCK_N) * BLOCK_N
        for c in range(0, n_full, BLOCK_N):
            cols = tl.load(idx_ptr + c + offs_n)
            m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, cols >= 0, s_kn, s_vn, d_ok, q_idx,
                                      0, 0, qk_scale, False, False, EVEN_D, IEEE)
        for c in range(n_full, n_col, BLOCK_N):
            ok = (c + offs_n) < n_col
            cols = tl.load(idx_ptr + c + offs_n, mask=ok, other=0)
            m_i, l_i, acc = key_chunk(q, m_i, l_i, acc, kt_base, v_base, cols, ok, s_kn, s_vn, d_ok, q_idx,
                                      0, 0, qk_scale, True, False, EVEN_D, IEEE)
        return m_i, l_i, acc

    # ---- diagonal runs, counted per row block (the flat and paired variants) --------------------
    # Runs are sorted by diagonal, so a row block's key ranges descend and those that are non-empty
    # (or hold a step of the kind counted) form one contiguous stretch of runs.

    @triton.jit
    def _middle(d_first, d_last, base, Lk, BM: tl.constexpr):
        """A pair of row blocks (first key index base, base + BM) and one run: the first block's
        chunk grid starts at lo = base - d_last (unclamped) and has n_a chunks; the second block's
        range is the first's shifted by BM, so its chunk c - 1 is the first's chunk c. Chunks
        1 .. n_a - 1 are shared; [c_lo, c_hi) are those that hold keys in [0, Lk)."""
        lo = base - d_last
        n_a = 1 + (d_last - d_first + BM - 1) // BM
        c_lo = tl.maximum(tl.maximum(-lo, 0) // BM, 1)
        c_hi = tl.minimum(n_a, (tl.maximum(Lk - lo, 0) + BM - 1) // BM)
        return lo, n_a, c_lo, c_hi

    @triton.jit
    def _run_steps(d_first, d_last, base, Lk, BM: tl.constexpr, KIND: tl.constexpr):
        """Steps a run takes. KIND 0: one row block's BM-key chunks of its range; 1: a pair of row
        blocks, 1 if either block's range is non-empty (the edge steps); 2: a pair's shared chunks."""
        if KIND == 0:
            lo = tl.maximum(base - d_last, 0)
            hi = tl.minimum(base + BM - d_first, Lk)
            n = (tl.maximum(hi - lo, 0) + BM - 1) // BM
        elif KIND == 1:
            a = tl.maximum(base - d_last, 0) < tl.minimum(base + BM - d_first, Lk)
            b = tl.maximum(base + BM - d_last, 0) < tl.minimum(base + 2 * BM - d_first, Lk)
            n = (a | b).to(tl.int32)
        else:
            lo, n_a, c_lo, c_hi = _middle(d_first, d_last, base, Lk, BM)
            n = tl.maximum(c_hi - c_lo, 0)
        return n

    @triton.jit
    def _runs(seg_ptr, r0, r1, base, Lk, BM: tl.constexpr, KIND: tl.constexpr, RB: tl.constexpr):
        """Runs r0 .. r1-1 counted RB at a time: (the first with a step, or r1; all their steps)."""
        first = r1
        total = r1 - r1
        for s0 in range(r0, r1, RB):
            rs = s0 + tl.arange(0, RB)
            ok = rs < r1
            d_first = tl.load(seg_ptr + 2 * rs, mask=ok, other=0)
            d_last = tl.load(seg_ptr + 2 * rs + 1, mask=ok, other=0)
            n = tl.where(ok, _run_steps(d_first, d_last, base, Lk, BM, KIND), 0)
            first = tl.minimum(first, tl.min(tl.where(n > 0, rs, r1), 0))
            total += tl.sum(n, 0)
        return first, total

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
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FLAT: tl.constexpr = False, WIDE: tl.constexpr = False,
    ):
        # MODE 0: A-shape / dense (P0 sink, P1 local per head; any BLOCK_M: exact per-row masks);
        # 1: Vertical-Slash (SEG/SEGN runs, IDX/CNT columns per row block); 2: Block-Sparse (IDX/CNT key
        # blocks per row block). Modes 1 and 2: BLOCK_M = BLOCK_N = the index's block size.
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
            m_i, l_i, acc = _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                  zero, s_hi, zero, s_hi, zero, local, qk_scale, BLOCK_N, False, EVEN_D, IEEE, WIDE)
            w_lo = tl.where(sep, win_lo, zero)
            w_sink = tl.where(sep, zero, sink)
            unm_lo = tl.maximum(w_lo, last - local + 1)
            unm_hi = tl.minimum(hi, base + 1)
            m_i, l_i, acc = _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                  w_lo, hi, unm_lo, unm_hi, w_sink, local, qk_scale, BLOCK_N, True, EVEN_D, IEEE, WIDE)
        elif MODE == 1:
            n_seg = tl.load(SEGN + row_id)
            seg_ptr = SEG + row_id * KS * 2
            if FLAT:
                # Every chunk of every run in one loop, so that the loads of the next chunk overlap
                # this one's products across run boundaries; masks on throughout (one body).
                s, total = _runs(seg_ptr, 0, n_seg, base, Lk, BLOCK_M, 0, RUNS_AT_ONCE)
                t = total - total  # chunk within run s
                for _ in range(0, total):
                    d_first = tl.load(seg_ptr + 2 * s)
                    d_last = tl.load(seg_ptr + 2 * s + 1)
                    lo = tl.maximum(base - d_last, 0)
                    hi = tl.minimum(base + BLOCK_M - d_first, Lk)
                    cols = lo + t * BLOCK_N + offs_n
                    kt, v = _kv(kt_base, v_base, cols, s_kn, s_vn, d_ok, Lk, EVEN_D)
                    m_i, l_i, acc = softmax_step(q, kt, v, m_i, l_i, acc, _seen(cols, hi, q_idx), qk_scale, True, IEEE)
                    t += 1
                    done = t * BLOCK_N >= hi - lo
                    s += done.to(tl.int32)
                    t = tl.where(done, 0, t)
            else:
                for s in range(0, n_seg):
                    d_first = tl.load(seg_ptr + 2 * s)
                    d_last = tl.load(seg_ptr + 2 * s + 1)
                    lo = tl.maximum(base - d_last, 0)
                    hi = tl.minimum(base + BLOCK_M - d_first, Lk)
                    m_i, l_i, acc = _span(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                          lo, hi, lo, tl.minimum(hi, base + 1), 0, 0, qk_scale, BLOCK_N, False, EVEN_D,
                                          IEEE, WIDE)
            blk_id = row_id * n_qblocks + pid_m
            m_i, l_i, acc = _columns(q, m_i, l_i, acc, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, q_idx,
                                     IDX + blk_id * KI, tl.load(CNT + blk_id), tl.load(CFULL + blk_id), qk_scale,
                                     BLOCK_N, EVEN_D, IEEE)
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

    @triton.jit
    def _vs_pair_fwd(
        Q, K, V, O, LSE, HEADS, SEG, SEGN, THIN, IDX, CNT, CFULL,
        qk_scale,
        s_qb, s_qh, s_qm, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_ob, s_oh, s_om, s_od,
        n_heads, Hq, G, Lq, Lk, off, n_qblocks, n_pairs, KS, KI,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, IEEE: tl.constexpr,
        FLAT: tl.constexpr, WIDE: tl.constexpr,
    ):
        """Vertical-Slash heads, two row blocks (a: 2p, b: 2p + 1) per program, each with its own
        softmax state. For a run, block b's key range is block a's shifted by BM: on a's chunk grid
        (from base - d_last), chunk 0 is a's alone, chunks 1 .. n_a - 1 are loaded once for both
        (two products), chunk n_a is b's alone. Columns: each block its own list. FLAT (needs THIN:
        the runs reordered thin ones first, each kind sorted): the edge steps of all runs in one loop,
        the shared chunks of the wide runs in another."""
        pid_p = n_pairs - 1 - tl.program_id(0)  # heaviest pairs first
        pid = tl.program_id(1)
        bt = pid // n_heads
        j = pid % n_heads
        h = tl.load(HEADS + j)
        kvh = h // G
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

        m_a = 2 * pid_p
        has_b = m_a + 1 < n_qblocks
        offs_a = m_a * BM + tl.arange(0, BM)
        offs_b = offs_a + BM
        offs_n = tl.arange(0, BM)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        qa_idx = offs_a + off
        qb_idx = offs_b + off
        base = m_a * BM + off  # key index of block a's first row

        q_base = Q + bt.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh + offs_d[None, :] * s_qd
        qa = tl.load(q_base + offs_a[:, None] * s_qm, mask=(offs_a < Lq)[:, None] & d_ok[None, :], other=0.0)
        qb = tl.load(q_base + offs_b[:, None] * s_qm, mask=(offs_b < Lq)[:, None] & d_ok[None, :], other=0.0)
        kt_base = K + bt.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[:, None] * s_kd
        v_base = V + bt.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh + offs_d[None, :] * s_vd

        ma, la, acca = softmax_init(BM, BLOCK_D)
        mb, lb, accb = softmax_init(BM, BLOCK_D)
        row_id = (bt * n_heads + j).to(tl.int64)
        n_seg = tl.load(SEGN + row_id)
        seg_ptr = SEG + row_id * KS * 2

        if FLAT:
            n_thin = tl.load(THIN + row_id)
            f1, e1 = _runs(seg_ptr, 0, n_thin, base, Lk, BM, 1, RUNS_AT_ONCE)
            f2, e2 = _runs(seg_ptr, n_thin, n_seg, base, Lk, BM, 1, RUNS_AT_ONCE)
            n_edge = e1 + e2
        else:
            f1, n_edge = _runs(seg_ptr, 0, n_seg, base, Lk, BM, 1, RUNS_AT_ONCE)
            e1 = n_edge
            f2 = f1
        for i in range(0, n_edge):
            s = tl.where(i < e1, f1 + i, f2 + i - e1)
            d_first = tl.load(seg_ptr + 2 * s)
            d_last = tl.load(seg_ptr + 2 * s + 1)
            lo, n_a, c_lo, c_hi = _middle(d_first, d_last, base, Lk, BM)
            hi_a = tl.minimum(base + BM - d_first, Lk)
            hi_b = tl.minimum(base + 2 * BM - d_first, Lk)
            # the edges: a's first chunk, b's last
            cols = lo + offs_n
            kt, v = _kv(kt_base, v_base, cols, s_kn, s_vn, d_ok, Lk, EVEN_D)
            ma, la, acca = softmax_step(qa, kt, v, ma, la, acca, _seen(cols, hi_a, qa_idx), qk_scale, True, IEEE)
            cols = lo + n_a * BM + offs_n
            kt, v = _kv(kt_base, v_base, cols, s_kn, s_vn, d_ok, Lk, EVEN_D)
            mb, lb, accb = softmax_step(qb, kt, v, mb, lb, accb, _seen(cols, hi_b, qb_idx), qk_scale, True, IEEE)
            if not FLAT:
                # the shared chunks: mask-free where inside [0, a's range end) and before a's first row
                c_hi = tl.maximum(c_hi, c_lo)
                u0 = tl.minimum(tl.maximum(c_lo, (tl.maximum(-lo, 0) + BM - 1) // BM), c_hi)
                u1 = tl.maximum(tl.minimum(c_hi, tl.maximum(tl.minimum(hi_a, base + 1) - lo, 0) // BM), u0)
                if WIDE:
                    offs_w = tl.arange(0, 2 * BM)
                    for c in range(u0, u1 - 1, 2):
                        kt_w, v_w = _kv(kt_base, v_base, lo + c * BM + offs_w, s_kn, s_vn, d_ok, Lk, EVEN_D)
                        ma, la, acca = softmax_step(qa, kt_w, v_w, ma, la, acca, None, qk_scale, False, IEEE)
                        mb, lb, accb = softmax_step(qb, kt_w, v_w, mb, lb, accb, None, qk_scale, False, IEEE)
                    u_odd = u1 - (u1 - u0) % 2
                else:
                    u_odd = u0
                for c in range(u_odd, u1):
                    kt, v = _kv(kt_base, v_base, lo + c * BM + offs_n, s_kn, s_vn, d_ok, Lk, EVEN_D)
                    ma, la, acca = softmax_step(qa, kt, v, ma, la, acca, None, qk_scale, False, IEEE)
                    mb, lb, accb = softmax_step(qb, kt, v, mb, lb, accb, None, qk_scale, False, IEEE)
                for r in range(0, (u0 - c_lo) + (c_hi - u1)):
                    c = tl.where(r < u0 - c_lo, c_lo + r, u1 + r - (u0 - c_lo))
                    cols = lo + c * BM + offs_n
                    kt, v = _kv(kt_base, v_base, cols, s_kn, s_vn, d_ok, Lk, EVEN_D)
                    ma, la, acca = softmax_step(qa, kt, v, ma, la, acca, _seen(cols, hi_a, qa_idx), qk_scale, True, IEEE)
                    mb, lb, accb = softmax_step(qb, kt, v, mb, lb, accb, _seen(cols, hi_b, qb_idx), qk_scale, True, IEEE)
        if FLAT:
            # the shared chunks of all wide runs in one loop (thin runs have none), masks on
            s, total = _runs(seg_ptr, n_thin, n_seg, base, Lk, BM, 2, RUNS_AT_ONCE)
            t = total - total  # shared chunk within run s
            for _ in range(0, total):
                d_first = tl.load(seg_ptr + 2 * s)
                d_last = tl.load(seg_ptr + 2 * s + 1)
                lo, n_a, c_lo, c_hi = _middle(d_first, d_last, base, Lk, BM)
                cols = lo + (c_lo + t) * BM + offs_n
                kt, v = _kv(kt_base, v_base, cols, s_kn, s_vn, d_ok, Lk, EVEN_D)
                hi_a = tl.minimum(base + BM - d_first, Lk)
                hi_b = tl.minimum(base + 2 * BM - d_first, Lk)
                ma, la, acca = softmax_step(qa, kt, v, ma, la, acca, _seen(cols, hi_a, qa_idx), qk_scale, True, IEEE)
                mb, lb, accb = softmax_step(qb, kt, v, mb, lb, accb, _seen(cols, hi_b, qb_idx), qk_scale, True, IEEE)
                t += 1
                done = t >= c_hi - c_lo
                s += done.to(tl.int32)
                t = tl.where(done, 0, t)

        blk_a = row_id * n_qblocks + m_a
        ma, la, acca = _columns(qa, ma, la, acca, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, qa_idx, IDX + blk_a * KI,
                                tl.load(CNT + blk_a), tl.load(CFULL + blk_a), qk_scale, BM, EVEN_D, IEEE)
        blk_b = blk_a + 1
        mb, lb, accb = _columns(qb, mb, lb, accb, kt_base, v_base, s_kn, s_vn, offs_n, d_ok, qb_idx, IDX + blk_b * KI,
                                tl.load(CNT + blk_b, mask=has_b, other=0), tl.load(CFULL + blk_b, mask=has_b, other=0),
                                qk_scale, BM, EVEN_D, IEEE)

        o_base = O + bt.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh + offs_d[None, :] * s_od
        lse_base = LSE + (bt * Hq + h).to(tl.int64) * Lq
        out, lse = softmax_finish(ma, la, acca, False)
        tl.store(o_base + offs_a[:, None] * s_om, out.to(O.dtype.element_ty), mask=(offs_a < Lq)[:, None] & d_ok[None, :])
        tl.store(lse_base + offs_a, lse, mask=offs_a < Lq)
        out, lse = softmax_finish(mb, lb, accb, False)
        tl.store(o_base + offs_b[:, None] * s_om, out.to(O.dtype.element_ty), mask=(offs_b < Lq)[:, None] & d_ok[None, :])
        tl.store(lse_base + offs_b, lse, mask=offs_b < Lq)


def triton_available(q: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA tensors, or on CPU tensors when Triton is interpreted."""
    if triton is None or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if q.is_cuda:
        return True
    return q.device.type == "cpu" and triton_interpreted(_minference_fwd)


def default_launch(head_dim: int, pair: bool = False, kind: str = "vertical_slash") -> tuple[int, int]:
    """(num_warps, num_stages) for a 64-row block of `kind` heads, by measurement on an H100 at 128K
    (bench/minference_kernel_variants.py, structured inputs). head_dim 64: 4,2 (1.3x 4,3). head_dim
    128: 4 warps, 2x faster than 8 (Vertical-Slash 0.29 -> 0.63 of cuDNN's rate, A-shape 0.36 -> 0.76,
    Block-Sparse 0.48 -> 0.70; docs/results.md, Sparse prefill), 2 stages for Vertical-Slash, 3 for the
    others. pair: the paired variants, two softmax states per program: 8 warps keep them unspilled at
    head_dim 64 (about 235 registers; 4 warps spill a little); at 128 they spill whatever the launch."""
    if pair:
        return 8, 2
    if head_dim <= 64:
        return 4, 2
    if head_dim <= 128:
        return (4, 2) if kind == "vertical_slash" else (4, 3)
    return 8, 1


def default_flat(head_dim: int) -> bool:
    """Whether Vertical-Slash heads stream their diagonal runs in one loop by default (`Launch.flat`)."""
    return head_dim > 64


def default_settings(head_dim: int) -> dict:
    """The default launch of each kind at `head_dim` (the padded BLOCK_D), as benchmarks record it."""
    kinds = ("a_shape", "vertical_slash", "block_sparse")
    return {**{kind: list(default_launch(head_dim, kind=kind)) for kind in kinds},
            "vertical_slash_flat": default_flat(head_dim)}


@dataclass(frozen=True)
class Launch:
    """A kernel variant and its launch. warps / stages: num_warps / num_stages (None: `default_launch`).
    pair: two index row blocks per program (Vertical-Slash: `_vs_pair_fwd`; A-shape: one tile of
    2 * block_size rows; Block-Sparse heads unchanged). flat: a row block's diagonal runs in one
    loop (Vertical-Slash). wide: mask-free chunks of contiguous key spans two at a time (A-shape
    windows; Vertical-Slash runs unless flat, whose loops take one chunk per step)."""

    warps: int | None = None
    stages: int | None = None
    pair: bool = False
    flat: bool | None = False  # None: `default_flat` (the default launch)
    wide: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Launch":
        """"pair+flat+wide:W,S", "pair", "4,2", "default" (words in any order, numbers optional)."""
        words, _, nums = spec.strip().partition(":")
        if words and words[0].isdigit():
            words, nums = "", spec
        flags = {w for w in words.split("+") if w and w != "default"}
        if flags - {"pair", "flat", "wide"}:
            raise ValueError(f"unknown kernel variant words {sorted(flags - {'pair', 'flat', 'wide'})} in {spec!r}")
        n = [int(x) for x in nums.split(",") if x.strip()]
        if len(n) not in (0, 2):
            raise ValueError(f"launch {spec!r}: expected num_warps,num_stages after ':'")
        return cls(*(n or (None, None)), pair="pair" in flags, flat="flat" in flags, wide="wide" in flags)

    def name(self) -> str:
        words = "+".join(w for w in ("pair", "flat", "wide") if getattr(self, w)) or "default"
        return words + (f":{self.warps},{self.stages}" if self.warps else "")

    def settings(self, block_d: int, paired: bool, kind: str = "vertical_slash") -> dict:
        """num_warps / num_stages of one launch (`paired`: the group runs a paired variant)."""
        w, s = (self.warps, self.stages) if self.warps is not None else default_launch(block_d, paired, kind)
        return {"num_warps": w, "num_stages": s}

    def flat_for(self, block_d: int) -> bool:
        return default_flat(block_d) if self.flat is None else self.flat


def as_launch(launch) -> Launch:
    """None (the default: `default_launch`, `default_flat`), (num_warps, num_stages), a Launch or its
    `Launch.parse` spec -> Launch."""
    if launch is None:
        return Launch(flat=None)
    if isinstance(launch, Launch):
        return launch
    if isinstance(launch, str):
        return Launch.parse(launch)
    w, s = launch
    return Launch(int(w), int(s))


def _thin_first(seg: torch.Tensor, seg_count: torch.Tensor):
    """Each head's runs reordered single-diagonal ones first (both kinds stay sorted), and how many
    there are: the flat pair kernel's loop over shared chunks then meets no run without any."""
    used = torch.arange(seg.shape[2], device=seg.device) < seg_count[..., None]
    wide = seg[..., 1] > seg[..., 0]
    key = torch.where(used, wide.to(torch.int8), 2)
    order = torch.sort(key, dim=-1, stable=True).indices
    thin = (used & ~wide).sum(-1, dtype=torch.int32)
    return seg.gather(2, order[..., None].expand(-1, -1, -1, 2)).contiguous(), thin.contiguous()


def computed_entries(grp, *, B: int, Lq: int, Lk: int, offset: int, block_size: int, launch=None) -> torch.Tensor:
    """Score entries the kernel computes for a plan group under `launch`, masked ones included:
    [B, nH] int64. Unpaired variants compute exactly `plan.kernel_cost`'s entries. Paired ones a bit
    more near key 0 and at the end: a's chunk grid is not clamped at key 0, a run live for one block
    of a pair costs the other's edge step too, an odd last block's pair computes rows past Lq, and
    A-shape tiles of 2 * block_size rows cover more of each window's ragged edge."""
    BM = block_size
    if not as_launch(launch).pair or grp.kind == "block_sparse":
        return kernel_cost(grp, B=B, Lq=Lq, Lk=Lk, offset=offset, block_size=BM)
    if grp.kind == "a_shape":  # plan.kernel_cost's A-shape count with 2 * BM-row tiles
        R = 2 * BM
        m = torch.arange(cdiv(Lq, R))
        base, last = m * R + offset, torch.clamp(m * R + R, max=Lq) - 1 + offset
        sink, local = torch.tensor(grp.sink)[:, None], torch.tensor(grp.local)[:, None]
        win_lo, hi = base - local + 1, torch.clamp(last + 1, max=Lk)
        sep = win_lo > sink

        def chunks(lo, hi):
            return torch.div((hi - lo).clamp(min=0) + BM - 1, BM, rounding_mode="floor")

        n = chunks(0, torch.where(sep, torch.clamp(sink, max=Lk), 0)) + chunks(torch.where(sep, win_lo, 0), hi)
        return (n.sum(-1) * R * BM)[None].expand(B, -1).clone()
    # Vertical-Slash pairs: per run live for the pair two edge steps, plus its shared chunks
    # (two products each), each step a BM x BM tile per block; then each block's own columns.
    ix = grp.index
    seg, used = ix.seg.long(), torch.arange(ix.seg.shape[2], device=ix.seg.device) < ix.seg_count[..., None]
    d_f, d_l = seg[..., 0][:, :, None], seg[..., 1][:, :, None]  # [B, nH, 1, KS]
    n_pairs = cdiv(cdiv(Lq, BM), 2)
    tiles = torch.zeros(ix.seg.shape[:2], dtype=torch.long, device=seg.device)
    step = max(1, (1 << 24) // max(1, seg.numel()))
    for p0 in range(0, n_pairs, step):
        base = (torch.arange(p0, min(n_pairs, p0 + step), device=seg.device) * 2 * BM + offset)[:, None]
        live = (base - d_l).clamp(min=0) < torch.clamp(base + BM - d_f, max=Lk)
        live |= (base + BM - d_l).clamp(min=0) < torch.clamp(base + 2 * BM - d_f, max=Lk)
        lo = base - d_l
        n_a = 1 + torch.div(d_l - d_f + BM - 1, BM, rounding_mode="floor")
        c_lo = torch.div((-lo).clamp(min=0), BM, rounding_mode="floor").clamp(min=1)
        c_hi = torch.minimum(n_a, torch.div((Lk - lo).clamp(min=0) + BM - 1, BM, rounding_mode="floor"))
        mids = (c_hi - c_lo).clamp(min=0)
        tiles += torch.where(used[:, :, None] & live, 2 + 2 * mids, 0).sum((-1, -2))
    return tiles * BM * BM + column_cost(ix.col_count, block_size=BM)


def attention_triton(q, k, v, groups, *, offset, scale, block_size, launch=None):
    """Run `groups` (plan.HeadGroup with indices) through the kernels. launch: None (the default:
    `default_launch`, `default_flat`), (num_warps, num_stages) (per-run loops), or a `Launch` (a
    variant; see the module docstring)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    BM = block_size
    n_qblocks = cdiv(Lq, BM)
    run = as_launch(launch)
    dev = q.device
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride())
    for grp in groups:
        common = dict(HEAD_DIM=D, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
                      **run.settings(block_d, run.pair and grp.kind != "block_sparse", grp.kind))
        flat = run.flat_for(block_d)
        nH = len(grp.heads)
        heads_t = to_device(grp.heads, dev, torch.int32)
        dummy = heads_t
        if grp.kind == "vertical_slash" and run.pair:
            ix = grp.index
            seg, segn, thin = ix.seg, ix.seg_count, dummy
            if flat and seg.shape[2] > 0:
                seg, thin = _thin_first(seg, segn)
            ks, ki = seg.shape[2], ix.col.shape[3]
            n_pairs = cdiv(n_qblocks, 2)
            _vs_pair_fwd[(n_pairs, B * nH)](
                q, k, v, out, lse, heads_t, seg if ks else dummy, segn, thin, ix.col if ki else dummy, ix.col_count,
                ix.col_full, scale * LOG2E, *strides, nH, Hq, Hq // Hkv, Lq, Lk, offset, n_qblocks, n_pairs, ks, ki,
                BM=BM, FLAT=flat and ks > 0, WIDE=run.wide, **common,
            )
            continue
        p0 = p1 = seg = segn = idx = cnt = cfull = dummy
        ks = ki = 0
        bm, nqb = BM, n_qblocks
        if grp.kind == "a_shape":
            mode = 0
            p0 = to_device(grp.sink, dev, torch.int32)
            p1 = to_device(grp.local, dev, torch.int32)
            if run.pair:  # exact per-row masks: any tile height
                bm, nqb = 2 * BM, cdiv(Lq, 2 * BM)
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
        _minference_fwd[(nqb, B * nH)](
            q, k, v, out, lse, heads_t, p0, p1, seg, segn, idx, cnt, cfull,
            scale * LOG2E, *strides,
            nH, Hq, Hq // Hkv, Lq, Lk, offset, nqb, ks, ki,
            MODE=mode, BLOCK_M=bm, BLOCK_N=BM, FLAT=flat and mode == 1, WIDE=run.wide and mode != 2, **common,
        )
    return out, lse
