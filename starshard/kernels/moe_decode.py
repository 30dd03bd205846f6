"""Expert GEMVs for MoE decode: a few (token, expert) pairs, each multiplied by its own expert's weights.

    act = expert_gate_up(x, token_of_pair, expert_of_pair, w13)        # [P, F]: silu(gate) * up
    y = expert_down(act, expert_of_pair, pair_weight, w2)              # [P, H] float32, routing weight applied

A decode step routes each token to k experts: P = tokens x k pairs of one row each. A grouped GEMM
gives every pair a GEMM tile of its own that is mostly padding, and the sort / un-sort around it costs
more kernels than the products; here one program computes a slice of one pair's output columns
straight from its expert's rows (the weights are read once, in order, and never copied), in pair order,
so nothing is sorted. The gate and up rows of a column slice are read by the same program and SiLU-mul
is applied on the float32 accumulators; the down product is scaled by the pair's routing weight.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch paths (engine/moe.py)
    triton = None

GEMV_MAX_PAIRS = 64  # (token, expert) pairs up to which engine/moe.py runs these kernels on the GPU
# Tiles from bench/tune_moe_decode.py on one H200 (Qwen3-30B-A3B shape, one token): narrow column
# slices with long K tiles keep many programs with many bytes in flight (gate_up 11.4 us = 4.4 TB/s,
# down 6.1 us = 4.1 TB/s; the first guess, 32 x 128 / 64 x 128 with 4 warps, took 53 / 16 us).
GATE_UP_TILE = dict(block_n=4, block_k=512, warps=2)
DOWN_TILE = dict(block_n=8, block_k=256, warps=2)


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, tok_ptr, exp_ptr, w_ptr, out_ptr, K, F, stride_x, stride_we, stride_wn, stride_o,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < F
        x_row = x_ptr + tl.load(tok_ptr + p).to(tl.int64) * stride_x
        w = w_ptr + tl.load(exp_ptr + p).to(tl.int64) * stride_we
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            m = n_ok[:, None] & k_ok[None, :]
            wg = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=m, other=0.0).to(tl.float32)
            wu = tl.load(w + (n[:, None] + F) * stride_wn + k[None, :], mask=m, other=0.0).to(tl.float32)
            gate += tl.sum(wg * xv, axis=1)
            up += tl.sum(wu * xv, axis=1)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + p * stride_o + n, act.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_kernel(a_ptr, exp_ptr, pw_ptr, w_ptr, out_ptr, K, N, stride_a, stride_we, stride_wn, stride_o,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        a_row = a_ptr + p.to(tl.int64) * stride_a
        w = w_ptr + tl.load(exp_ptr + p).to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            av = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            wv = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(wv.to(tl.float32) * av, axis=1)
        acc = acc * tl.load(pw_ptr + p)
        tl.store(out_ptr + p * stride_o + n, acc, mask=n_ok)


def _check(w: torch.Tensor, name: str) -> None:
    if w.dim() != 3 or w.stride(-1) != 1:
        raise ValueError(f"{name} must be [E, N, K] with unit stride along K, got shape {tuple(w.shape)} "
                         f"strides {w.stride()}")


def expert_gate_up(x: torch.Tensor, token_of_pair: torch.Tensor, expert_of_pair: torch.Tensor,
                   w13: torch.Tensor, block_n: int = GATE_UP_TILE["block_n"], block_k: int = GATE_UP_TILE["block_k"],
                   warps: int = GATE_UP_TILE["warps"]) -> torch.Tensor:
    """silu(gate) * up of every pair: x [T, H] (rows unit-stride), token_of_pair / expert_of_pair [P]
    (int), w13 [E, 2F, H] (each expert's F gate rows, then its F up rows) -> [P, F] in x.dtype."""
    _check(w13, "w13")
    P, (E, F2, H) = token_of_pair.numel(), w13.shape
    F = F2 // 2
    out = torch.empty(P, F, dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    _gate_up_kernel[(P, triton.cdiv(F, block_n))](
        x, token_of_pair, expert_of_pair, w13, out, H, F, x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def expert_down(act: torch.Tensor, expert_of_pair: torch.Tensor, pair_weight: torch.Tensor,
                w2: torch.Tensor, block_n: int = DOWN_TILE["block_n"], block_k: int = DOWN_TILE["block_k"],
                warps: int = DOWN_TILE["warps"]) -> torch.Tensor:
    """pair_weight[p] * (w2[e_p] @ act[p]) of every pair: act [P, F], pair_weight [P] float32,
    w2 [E, H, F] -> [P, H] float32 (the caller sums each token's pairs)."""
    _check(w2, "w2")
    P, (E, H, F) = act.shape[0], w2.shape
    out = torch.empty(P, H, dtype=torch.float32, device=act.device)
    if P == 0:
        return out
    act = act.contiguous()
    _down_kernel[(P, triton.cdiv(H, block_n))](
        act, expert_of_pair, pair_weight.float().contiguous(), w2, out, F, H, act.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out
