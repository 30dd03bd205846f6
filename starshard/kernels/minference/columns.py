"""The per-row-block column lists of a Vertical-Slash index in one Triton launch (issue 18: the index build).

    vs_columns(v, seg, seg_count, col, col_count, col_full, Lk=..., offset=..., block_size=BM)

For every (batch x head, row block m with first key index b = m*BM + offset): the selected columns v
(sorted, padded with Lk) that are not inside one of the head's slash ranges at this row block and not
past its last row, packed in order into col[..., m, :], their number into col_count and how many of
them every row of the block sees (j <= b) into col_full: what `index.vs_index` computes with a
searchsorted, a cumsum and a scatter over [B, nH, nM, KV] temporaries (2.1 ms of a SmolLM2 layer's
index build at 128K on one H200; docs/results.md, FP8).
Run (first, last) covers j at b iff b - j lies in [first - BM + 1, last + 1): the used runs of seg
[B, nH, KS, 2] read as 2 * seg_count increasing bounds, j is inside a range iff the number of bounds
<= b - j is odd (a binary search over the used runs only).
Runs on CUDA or under TRITON_INTERPRET=1; col must be zero-filled by the caller.
"""
from __future__ import annotations

import torch

from starshard.kernels.minference import estimate

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep index.py's torch path
    triton = None

BLOCK_KV = 512  # columns per tile


if triton is not None:

    @triton.jit
    def _columns_kernel(V, SEG, SCNT, COL, CNT, FULL, KV, NB, Lk, offset, nM,
                        BM: tl.constexpr, BLOCK_KV: tl.constexpr):
        m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        base = m * BM + offset
        v_row = V + bh * KV
        b_row = SEG + bh * NB  # (first, last) pairs: bound i is entry i, shifted
        n_used = 2 * tl.load(SCNT + bh)  # the search runs over the used runs' bounds only
        out = COL + (bh * nM + m) * KV
        count = tl.sum(tl.zeros([BLOCK_KV], dtype=tl.int32), 0)  # int32 scalars carried by the loop
        full = count
        for t0 in range(0, KV, BLOCK_KV):
            i = t0 + tl.arange(0, BLOCK_KV)
            ok = i < KV
            v = tl.load(v_row + i, mask=ok, other=Lk).to(tl.int32)
            t = base - v
            lo = tl.zeros([BLOCK_KV], dtype=tl.int32)  # bounds[:lo] <= t < bounds[hi:]
            hi = lo + n_used
            while tl.max(hi - lo, 0) > 0:  # about log2(n_used) rounds
                mid = (lo + hi) // 2
                go = lo < hi
                val = tl.load(b_row + mid, mask=go, other=0) + tl.where(mid % 2 == 0, 1 - BM, 1)
                right = go & (val <= t)
                lo = tl.where(right, mid + 1, lo)
                hi = tl.where(go & ~right, mid, hi)
            keep = ok & (v < Lk) & (v < base + BM) & ((lo % 2) == 0)
            k32 = keep.to(tl.int32)
            slot = count + tl.cumsum(k32, 0) - 1
            tl.store(out + slot, v.to(tl.int32), mask=keep)
            count += tl.sum(k32, 0)
            full += tl.sum((keep & (v <= base)).to(tl.int32), 0)
        tl.store(CNT + bh * nM + m, count)
        tl.store(FULL + bh * nM + m, full)


def use_columns_kernel(v: torch.Tensor) -> bool:
    """Whether vs_index uses the kernel by default: on CUDA once enabled (estimate.ON_CUDA_BY_DEFAULT)."""
    return estimate.ON_CUDA_BY_DEFAULT and triton is not None and v.is_cuda


def vs_columns(v: torch.Tensor, seg: torch.Tensor, seg_count: torch.Tensor, col: torch.Tensor,
               col_count: torch.Tensor, col_full: torch.Tensor, *, Lk: int, offset: int, block_size: int) -> None:
    """Fill col [B, nH, nM, KV] (zero-filled), col_count and col_full [B, nH, nM] (module docstring).
    v [B, nH, KV] int64 sorted columns, seg [B, nH, KS, 2] / seg_count [B, nH] int32 (`vs_runs`)."""
    if triton is None:
        raise RuntimeError("vs_columns: the Triton kernel needs the triton package")
    B, nH, nM, KV = col.shape
    NB = 2 * seg.shape[2]
    if B * nH * nM == 0 or KV == 0:
        return
    _columns_kernel[(nM, B * nH)](v.contiguous(), seg.contiguous(), seg_count.contiguous(), col, col_count, col_full,
                                  KV, NB, Lk, offset, nM, BM=block_size,
                                  BLOCK_KV=min(BLOCK_KV, triton.next_power_of_2(KV)), num_warps=4)
