"""Greedy decoding's argmax over a vocabulary row in one Triton launch (CUDA).

    ids = argmax_rows(logits)      # logits [B, V] -> [B] int64, as logits.argmax(-1)

torch's argmax of one 128K-wide float32 row took 28.7 us on an H200 (Llama-3.1-8B decode at 128K, 5 steps
profiled; docs/results.md, FP8): one block reduces the whole row. Greedy sampling runs
it every token after the graph replay. Here programs of ARGMAX_CHUNK columns each find their chunk's
winner (a running (value, index) per lane, the lanes reduced once), and a second launch picks among the
chunks' winners. (One program per row was 20.4 vs torch's 26.6 us on an H100: one SM cannot stream the
row fast enough.)

Same answer as torch.argmax: the first index of the largest value; NaN counts as larger than
everything (the first NaN wins), +inf as larger than every finite value.
"""
from __future__ import annotations

import torch

from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep torch.argmax
    triton = None

ARGMAX_BLOCK = 1024  # columns per tile
ARGMAX_CHUNK = 4096  # columns per stage-1 program (a 128K vocabulary: 32 programs)
ARGMAX_MIN_WIDTH = 8192  # narrower rows: torch.argmax is as fast


def use_argmax_kernel(logits: torch.Tensor) -> bool:
    """Whether argmax_rows is the faster choice: CUDA, a [B, V] float tensor of wide rows."""
    return (logits.is_cuda and triton is not None and logits.dim() == 2 and logits.shape[-1] >= ARGMAX_MIN_WIDTH
            and logits.is_floating_point())


if triton is not None:

    @triton.jit
    def _winner(best, best_i, valid):
        """Index of the winner among candidates (value, index): the lowest index of a NaN if any, else the
        lowest index of the largest value; `valid` marks real candidates."""
        nan = (best != best) & valid
        any_nan = tl.max(nan.to(tl.int32), 0) > 0
        top = tl.max(tl.where(nan | ~valid, float("-inf"), best), 0)
        win = tl.where(any_nan, nan, (best == top) & valid)
        return tl.min(tl.where(win, best_i, 2147483647), 0)

    @triton.jit
    def _argmax_chunks_kernel(X, VAL, IDX, V, s_xm, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
        """Stage 1, one program per (row, chunk of CHUNK columns): the chunk's winner and its value."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        best_i = tl.full([BLOCK], 2147483647, dtype=tl.int32)
        for c0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, V), BLOCK):
            i = c0 + offs
            ok = i < V
            x = tl.load(X + row * s_xm + i, mask=ok, other=float("-inf")).to(tl.float32)
            # strictly greater keeps the earlier of equal values; a NaN beats any number and the first NaN
            # stays; an unset lane takes its first column (a row of -inf answers its first index)
            take = ok & ((x > best) | ((x != x) & (best == best)) | (best_i == 2147483647))
            best = tl.where(take, x, best)
            best_i = tl.where(take, i, best_i)
        w = _winner(best, best_i, best_i != 2147483647)
        tl.store(IDX + row * n_chunks + c, w)
        tl.store(VAL + row * n_chunks + c, tl.load(X + row * s_xm + w).to(tl.float32))

    @triton.jit
    def _argmax_reduce_kernel(VAL, IDX, OUT, n_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Stage 2, one program per row: the winner among its chunks' winners (same rule)."""
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        ok = c < n_chunks
        best = tl.load(VAL + row * n_chunks + c, mask=ok, other=float("-inf"))
        best_i = tl.load(IDX + row * n_chunks + c, mask=ok, other=2147483647)
        tl.store(OUT + row, _winner(best, best_i, ok).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the index of each row's maximum [B] (int64), in two Triton launches."""
    if triton is None:
        raise RuntimeError("argmax_rows needs the triton package")
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows: expected logits [B, V], got shape {tuple(logits.shape)}")
    B, V = logits.shape
    if V == 0:
        raise ValueError("argmax_rows: rows of zero width have no maximum")
    if V >= 2**31:
        raise ValueError(f"argmax_rows: rows of {V} columns exceed int32 indices; use torch.argmax")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        block = min(ARGMAX_BLOCK, triton.next_power_of_2(V))
        n_chunks = triton.cdiv(V, ARGMAX_CHUNK)
        val = torch.empty(B, n_chunks, dtype=torch.float32, device=logits.device)
        idx = torch.empty(B, n_chunks, dtype=torch.int32, device=logits.device)
        _argmax_chunks_kernel[(B, n_chunks)](x, val, idx, V, x.stride(0), n_chunks, CHUNK=ARGMAX_CHUNK, BLOCK=block,
                                            num_warps=4, **pdl_launch(x))
        _argmax_reduce_kernel[(B,)](val, idx, out, n_chunks, BLOCK_C=max(16, triton.next_power_of_2(n_chunks)),
                                    num_warps=1, **pdl_launch(val))
    return out
