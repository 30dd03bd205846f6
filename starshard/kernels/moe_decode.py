"""The expert side of an MoE decode step in three launches: routing, the experts' gate/up GEMVs, their
down GEMVs summed per token.

    weights, experts = route_topk(router_logits, top_k, renormalize)   # [T, k] float32, [T, k] int32
    act = expert_gate_up(x, experts, w13)                              # [T * k, F]: silu(gate) * up
    y = expert_down(act, experts, weights, w2)                         # [T, H]: sum_j weights[t, j] * down_j

A decode step routes each token to k experts: P = tokens x k (token, expert) pairs of one row each, pair
p = t * k + j being token t's j-th choice. A grouped GEMM gives every pair a GEMM tile of its own that is
mostly padding, and the sort / un-sort around it costs more kernels than the products; here one program
computes a slice of one pair's output columns straight from its expert's rows (the weights are read once,
in order, and never copied), in pair order, so nothing is sorted. The gate and up rows of a column slice
are read by the same program and SiLU-mul is applied on the float32 accumulators. The down kernel runs
one program per (token, output slice) and loops over the token's k experts in slot order, scaling each
product by its routing weight in float32: a fixed summation order, no atomics, so every run and every
tensor-parallel rank gives the same bits. Routing (softmax, top k, renormalization) is one program per
token. Together they replace the small torch kernels around the GEMVs (softmax, topk and its sort, the
renormalizing sum, casts, the pair -> token index, the per-token weighted sum), which at decode cost
about as much as the GEMVs themselves (bench/results/2026-11-23-h200-decode-profile).
"""
from __future__ import annotations

import torch

from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton keep the torch paths (engine/moe.py)
    triton = None

GEMV_MAX_PAIRS = 64  # (token, expert) pairs up to which engine/moe.py runs these kernels on the GPU
ROUTE_MAX_EXPERTS = 1024  # one token's logits in one program's registers
# Tiles from bench/tune_moe_decode.py on one H200 (Qwen3-30B-A3B shape, one token): narrow column
# slices with long K tiles keep many programs with many bytes in flight (gate_up 11.4 us = 4.4 TB/s;
# the first guess, 32 x 128 with 4 warps, took 53 us). Down, one program per (token, output column)
# summing the token's k experts unrolled: 1 x 1024 with 1 warp, 7.1 us = 3.5 TB/s (8 x 256 / 2 warps:
# 24.5 us; bench/results/2026-11-24-h200/tune_moe_decode_d.json).
GATE_UP_TILE = dict(block_n=4, block_k=512, warps=2)
DOWN_TILE = dict(block_n=1, block_k=1024, warps=1)


if triton is not None:

    @triton.jit
    def _route_kernel(logit_ptr, weight_ptr, expert_ptr, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                      BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        logit = tl.load(logit_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
        num = tl.exp(logit - tl.max(logit, axis=0))
        probs = num / tl.sum(num, axis=0)
        # Choose on the float32 logits (exact order; the probabilities' rounding can only merge neighbours
        # into ties), k rounds of argmax-and-mask; among equal logits the lowest expert id wins.
        left = logit
        slot = tl.arange(0, K_PAD)
        chosen_w = tl.zeros([K_PAD], dtype=tl.float32)
        chosen_e = tl.zeros([K_PAD], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(left, axis=0, tie_break_left=True)
            w = tl.sum(tl.where(e == best, probs, 0.0), axis=0)
            chosen_w = tl.where(slot == j, w, chosen_w)
            chosen_e = tl.where(slot == j, best.to(tl.int32), chosen_e)
            left = tl.where(e == best, float("-inf"), left)
        if RENORMALIZE:
            chosen_w = chosen_w / tl.sum(chosen_w, axis=0)  # the padding slots hold zeros
        ok = slot < TOP_K
        tl.store(weight_ptr + t * TOP_K + slot, chosen_w, mask=ok)
        tl.store(expert_ptr + t * TOP_K + slot, chosen_e, mask=ok)

    @triton.jit
    def _gate_up_kernel(x_ptr, exp_ptr, w_ptr, out_ptr, K, F, top_k, stride_x, stride_we, stride_wn, stride_o,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        p = tl.program_id(0)  # pair p = token p // top_k's (p % top_k)-th expert
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < F
        x_row = x_ptr + (p // top_k).to(tl.int64) * stride_x
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
        tl.store(out_ptr + p.to(tl.int64) * stride_o + n, act.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_kernel(a_ptr, exp_ptr, pw_ptr, w_ptr, res_ptr, out_ptr, K, N, stride_a, stride_we, stride_wn, stride_r,
                     stride_o, TOP_K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        t = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        # Unrolled over the token's experts (slot order: a fixed summation order), so the loads of all k
        # experts' rows are in flight together rather than one expert after another.
        for j in tl.static_range(TOP_K):
            p = t * TOP_K + j
            a_row = a_ptr + p.to(tl.int64) * stride_a
            w = w_ptr + tl.load(exp_ptr + p).to(tl.int64) * stride_we
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                av = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                wv = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                             other=0.0)
                acc += tl.sum(wv.to(tl.float32) * av, axis=1)
            total += acc * tl.load(pw_ptr + p)
        if HAS_RES:  # the block's residual, added as `moe(x) + residual` rounds: the sum first to out's dtype
            total = total.to(out_ptr.dtype.element_ty).to(tl.float32) + tl.load(
                res_ptr + t.to(tl.int64) * stride_r + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * stride_o + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def _check(w: torch.Tensor, name: str) -> None:
    if w.dim() != 3 or w.stride(-1) != 1:
        raise ValueError(f"{name} must be [E, N, K] with unit stride along K, got shape {tuple(w.shape)} "
                         f"strides {w.stride()}")


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32) in one launch: the
    softmax over all experts in float32, the k most probable (largest first), renormalized to sum to 1
    if asked, as engine/moe.py `route` (transformers). Ties: torch.topk does not say which of equal
    values it returns; this kernel takes the lowest expert id among equal logits."""
    T, E = logits.shape
    if not 0 < top_k <= E or E > ROUTE_MAX_EXPERTS:
        raise ValueError(f"route_topk: top_k={top_k} of {E} experts (at most {ROUTE_MAX_EXPERTS})")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, experts
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_kernel[(T,)](logits, weights, experts, E, logits.stride(0), TOP_K=top_k,
                        K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                        RENORMALIZE=renormalize, num_warps=1 if E <= 256 else 4, **pdl_launch(logits))
    return weights, experts


def expert_gate_up(x: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                   block_n: int = GATE_UP_TILE["block_n"], block_k: int = GATE_UP_TILE["block_k"],
                   warps: int = GATE_UP_TILE["warps"]) -> torch.Tensor:
    """silu(gate) * up of every (token, expert) pair: x [T, H] (rows unit-stride), experts [T, k] (int;
    token t's j-th expert), w13 [E, 2F, H] (each expert's F gate rows, then its F up rows) -> [T * k, F]
    in x.dtype, row t * k + j for token t's j-th expert."""
    _check(w13, "w13")
    (T, k), (_, F2, H) = experts.shape, w13.shape
    F = F2 // 2
    out = torch.empty(T * k, F, dtype=x.dtype, device=x.device)
    if T * k == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    _gate_up_kernel[(T * k, triton.cdiv(F, block_n))](
        x, experts.contiguous(), w13, out, H, F, k, x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_launch(x))
    return out


def expert_down(act: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w2: torch.Tensor,
                out_dtype: torch.dtype | None = None, block_n: int = DOWN_TILE["block_n"],
                block_k: int = DOWN_TILE["block_k"], warps: int = DOWN_TILE["warps"],
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * (w2[experts[t, j]] @ act[t * k + j]) of every token, in float32, in slot
    order: act [T * k, F] (expert_gate_up's output), experts [T, k] (int), weights [T, k], w2 [E, H, F]
    -> [T, H] in out_dtype (default act.dtype). residual [T, H]: + residual, added in the kernel after the
    sum is rounded to out_dtype (what `expert_down(...) + residual` gives)."""
    _check(w2, "w2")
    (T, k), (_, H, F) = experts.shape, w2.shape
    out = torch.empty(T, H, dtype=out_dtype or act.dtype, device=act.device)
    if T * k == 0:
        return out.zero_() if residual is None else out.copy_(residual)
    act = act.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    _down_kernel[(T, triton.cdiv(H, block_n))](
        act, experts.contiguous(), weights.float().contiguous(), w2, residual if residual is not None else out, out,
        F, H, act.stride(0), w2.stride(0), w2.stride(1), residual.stride(0) if residual is not None else 0,
        out.stride(0), TOP_K=k, HAS_RES=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl_launch(act))
    return out
