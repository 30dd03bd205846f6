"""The Triton kernels: one program per (query block, batch x head), heaviest blocks first; A-shape /
dense heads stream two key spans, Vertical-Slash heads their diagonal ranges then their gathered
columns, Block-Sparse heads their selected key blocks. Runs on CUDA or under TRITON_INTERPRET=1.

`Launch` picks a variant (issue 18, item 3; docs/results.md, Sparse prefill,
one H100 at 128K): by default Vertical-Slash heads run `flat` where the
head dim is above 64 (1.08-1.18x the per-run loops at d128; at d64 it lost on the default pattern),
and `default_launch` sets warps and stages per head dim and kind; `flat` streams all diagonal runs of a
row block in one loop (one software pipeline instead of one per run), `wide` takes the mask-free chunks
of contiguous spans two at a time. Every variant computes exactly the same
visibility as the index says (tests/kernels/test_minference_kernel_variants.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.kernels.common import cdiv, to_device, triton_interpreted
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

    # ---- diagonal runs, counted per row block (the flat variant) ----------------------------------
    # Runs are sorted by diagonal, so a row block's key ranges descend and those that are non-empty
    # (or hold a step of the kind counted) form one contiguous stretch of runs.

    @triton.jit
    def _run_steps(d_first, d_last, base, Lk, BM: tl.constexpr):
        """Steps a run takes: the row block's BM-key chunks of its range."""
        lo = tl.maximum(base - d_last, 0)
        hi = tl.minimum(base + BM - d_first, Lk)
        return (tl.maximum(hi - lo, 0) + BM - 1) // BM

    @triton.jit
    def _runs(seg_ptr, r0, r1, base, Lk, BM: tl.constexpr, RB: tl.constexpr):
        """Runs r0 .. r1-1 counted RB at a time: (the first with a step, or r1; all their steps)."""
        first = r1
        total = r1 - r1
        for s0 in range(r0, r1, RB):
            rs = s0 + tl.arange(0, RB)
            ok = rs < r1
            d_first = tl.load(seg_ptr + 2 * rs, mask=ok, other=0)
            d_last = tl.load(seg_ptr + 2 * rs + 1, mask=ok, other=0)
            n = tl.where(ok, _run_steps(d_first, d_last, base, Lk, BM), 0)
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
                s, total = _runs(seg_ptr, 0, n_seg, base, Lk, BLOCK_M, RUNS_AT_ONCE)
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

def triton_available(q: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA tensors, or on CPU tensors when Triton is interpreted."""
    if triton is None or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if q.is_cuda:
        return True
    return q.device.type == "cpu" and triton_interpreted(_minference_fwd)


def default_launch(head_dim: int, kind: str = "vertical_slash") -> tuple[int, int]:
    """(num_warps, num_stages) for a 64-row block of `kind` heads, by measurement on an H100 at 128K
    (bench/minference_kernel_variants.py, structured inputs). head_dim 64: 4,2 (1.3x 4,3). head_dim
    128: 4 warps, 2x faster than 8 (Vertical-Slash 0.29 -> 0.63 of cuDNN's rate, A-shape 0.36 -> 0.76,
    Block-Sparse 0.48 -> 0.70; docs/results.md, Sparse prefill), 2 stages for Vertical-Slash, 3 for the
    others."""
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
    flat: a row block's diagonal runs in one loop (Vertical-Slash). wide: mask-free chunks of contiguous
    key spans two at a time (A-shape windows; Vertical-Slash runs unless flat, whose loops take one chunk
    per step)."""

    warps: int | None = None
    stages: int | None = None
    flat: bool | None = False  # None: `default_flat` (the default launch)
    wide: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Launch":
        """"flat+wide:W,S", "wide", "4,2", "default" (words in any order, numbers optional)."""
        words, _, nums = spec.strip().partition(":")
        if words and words[0].isdigit():
            words, nums = "", spec
        flags = {w for w in words.split("+") if w and w != "default"}
        if flags - {"flat", "wide"}:
            raise ValueError(f"unknown kernel variant words {sorted(flags - {'flat', 'wide'})} in {spec!r}")
        n = [int(x) for x in nums.split(",") if x.strip()]
        if len(n) not in (0, 2):
            raise ValueError(f"launch {spec!r}: expected num_warps,num_stages after ':'")
        return cls(*(n or (None, None)), flat="flat" in flags, wide="wide" in flags)

    def name(self) -> str:
        words = "+".join(w for w in ("flat", "wide") if getattr(self, w)) or "default"
        return words + (f":{self.warps},{self.stages}" if self.warps else "")

    def settings(self, block_d: int, kind: str = "vertical_slash") -> dict:
        """num_warps / num_stages of one launch."""
        w, s = (self.warps, self.stages) if self.warps is not None else default_launch(block_d, kind)
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
                      **run.settings(block_d, grp.kind))
        flat = run.flat_for(block_d)
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
        _minference_fwd[(n_qblocks, B * nH)](
            q, k, v, out, lse, heads_t, p0, p1, seg, segn, idx, cnt, cfull,
            scale * LOG2E, *strides,
            nH, Hq, Hq // Hkv, Lq, Lk, offset, n_qblocks, ks, ki,
            MODE=mode, BLOCK_M=BM, BLOCK_N=BM, FLAT=flat and mode == 1, WIDE=run.wide and mode != 2, **common,
        )
    return out, lse
