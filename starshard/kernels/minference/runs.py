"""A Vertical-Slash index's diagonal runs and their kernel cost in one Triton launch (issue 18: the
index build).

    seg, seg_count, cost = vs_runs_kernel(s_idx, ndiag=..., Lq=..., Lk=..., offset=..., block_size=BM)

What `index.vs_segments` and `plan.slash_cost` compute with ~70 small torch ops on [B, nH, KS]
tensors (the build ran at the host's launch speed: on one H200 at 128K keys its GPU was busy ~1.6 of
~4.5 ms; docs/results.md, Sparse prefill), here one program per (batch x head) scans its
sorted diagonals in chunks: a run starts where the gap to the previous diagonal exceeds BM and ends
before the next start; the runs are packed in order into seg (first, last) and each run's score
entries are summed in closed form (the same clamped ramps as `slash_cost`, in int64).
Runs on CUDA or under TRITON_INTERPRET=1 (the kernel writes the used runs only: `vs_runs_kernel`
hands it a zero-filled seg).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch ops
    triton = None

BLOCK_S = 1024  # diagonals per chunk


if triton is not None:

    @triton.jit
    def _fdiv(a, b):
        """floor(a / b) for b > 0, whatever the integer division's rounding."""
        q = a // b
        return tl.where(q * b > a, q - 1, q)

    @triton.jit
    def _upto(x, cap):
        """sum of clamp(t, 0, cap) over t = 0 .. x (0 for x < 0)."""
        x = tl.maximum(x, -1)
        low = tl.maximum(tl.minimum(x, cap), 0)
        return tl.where(x < 0, 0, low * (low + 1) // 2 + tl.maximum(x - low, 0) * cap)

    @triton.jit
    def _ramp(x0, x1, cap):
        return tl.where(x1 < x0, 0, _upto(x1, cap) - _upto(x0 - 1, cap))

    @triton.jit
    def _runs_kernel(S, SEG, CNT, COST, KS, ndiag, Lk, offset, nM, BM: tl.constexpr, BLOCK_S: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        row = S + bh * KS
        out = SEG + bh * KS * 2
        count = tl.sum(tl.zeros([BLOCK_S], dtype=tl.int32), 0)  # int32 / int64 scalars carried by the loop
        cost = tl.sum(tl.zeros([BLOCK_S], dtype=tl.int64), 0)
        cl = (Lk + BM - 1) // BM
        for c0 in range(0, KS, BLOCK_S):
            i = c0 + tl.arange(0, BLOCK_S)
            ok = i < KS
            s = tl.load(row + i, mask=ok, other=ndiag)
            prev = tl.load(row + i - 1, mask=ok & (i > 0), other=-(2 * BM + 2))
            nxt = tl.load(row + i + 1, mask=i + 1 < KS, other=ndiag)
            valid = ok & (s < ndiag)
            start = valid & (s - prev > BM)
            end = valid & ((nxt >= ndiag) | (nxt - s > BM))
            sid = count + tl.cumsum(start.to(tl.int32), 0) - 1
            tl.store(out + sid.to(tl.int64) * 2, s.to(tl.int32), mask=start)
            tl.store(out + sid.to(tl.int64) * 2 + 1, s.to(tl.int32), mask=end)
            count += tl.sum(start.to(tl.int32), 0)
            # A run's cost needs its first diagonal, stored above by another thread or in an earlier
            # chunk: read it back once every store of this chunk is visible to the whole program.
            tl.debug_barrier()
            a_run = tl.load(out + sid.to(tl.int64) * 2, mask=end, other=0).to(tl.int64)
            b_run = s.to(tl.int64)
            capr = 1 + (b_run - a_run + BM - 1) // BM
            c_0 = -_fdiv(a_run - offset - BM, BM)
            m_c = tl.minimum(tl.maximum(_fdiv(Lk - offset - BM + a_run, BM) + 1, 0), nM)
            k_1 = -_fdiv(offset - Lk - b_run, BM)
            run_cost = _ramp(c_0, c_0 + m_c - 1, capr) + _ramp(k_1 - nM + 1, k_1 - m_c, cl)
            cost += tl.sum(tl.where(end, run_cost, 0), 0)
        tl.store(CNT + bh, count)
        tl.store(COST + bh, cost * BM * BM)


def vs_runs_kernel(s_idx: torch.Tensor, *, ndiag: int, Lq: int, Lk: int, offset: int, block_size: int):
    """(seg [B, nH, KS, 2] int32, seg_count [B, nH] int32, cost [B, nH] int64): `index.vs_segments`
    and `plan.slash_cost` of sorted diagonals s_idx [B, nH, KS] (padded with ndiag)."""
    if triton is None:
        raise RuntimeError("vs_runs_kernel: the Triton kernel needs the triton package")
    B, nH, KS = s_idx.shape
    dev = s_idx.device
    seg = torch.zeros(B, nH, KS, 2, dtype=torch.int32, device=dev)
    count = torch.zeros(B, nH, dtype=torch.int32, device=dev)
    cost = torch.zeros(B, nH, dtype=torch.int64, device=dev)
    if B * nH == 0 or KS == 0:
        return seg, count, cost
    nM = -(-Lq // block_size)
    _runs_kernel[(B * nH,)](s_idx.contiguous(), seg, count, cost, KS, ndiag, Lk, offset, nM, BM=block_size,
                            BLOCK_S=min(BLOCK_S, triton.next_power_of_2(KS)), num_warps=4)
    return seg, count, cost
