"""The expert side of an MoE decode step in two launches: the experts' gate/up GEMVs, each program routing
its token itself, then their down GEMVs summed per token.

    act, weights, experts = routed_gate_up(x, router_logits, w13, top_k, renormalize)
    # act [T * k, F]: silu(gate) * up; weights [T, k] float32, experts [T, k] int32 (for expert_down)
    y = expert_down(act, experts, weights, w2)                         # [T, H]: sum_j weights[t, j] * down_j
    # e4m3 experts (--fp8 experts): w13 / w2 e4m3 with w13_scale= [E, 2F] / w2_scale= [E, H] float32 row scales

routed_gate_up is bit-equal to the routing and the GEMVs launched apart (the same code):

    weights, experts = route_topk(router_logits, top_k, renormalize)   # [T, k] float32, [T, k] int32
    act = expert_gate_up(x, experts, w13)                              # [T * k, F]

A decode step routes each token to k experts: P = tokens x k (token, expert) pairs of one row each, pair
p = t * k + j being token t's j-th choice. A grouped GEMM gives every pair a GEMM tile of its own that is
mostly padding, and the sort / un-sort around it costs more kernels than the products; here one program
computes a slice of one pair's output columns straight from its expert's rows (the weights are read once,
in order, and never copied), in pair order, so nothing is sorted. The gate and up rows of a column slice
are read by the same program and SiLU-mul is applied on the float32 accumulators. The down kernel runs
one program per (token, output slice) and loops over the token's k experts in slot order, scaling each
product by its routing weight in float32: a fixed summation order, no atomics, so every run and every
tensor-parallel rank gives the same bits. Routing (softmax, top k, renormalization) takes one token's
logits in one program's registers; in routed_gate_up every program of the token's pairs recomputes it
instead of waiting on a launch of its own (route_topk: ~2.5 us per layer on an H200, mostly launch and
drain). Together they replace the small torch kernels around the GEMVs (softmax, topk and its sort, the
renormalizing sum, casts, the pair -> token index, the per-token weighted sum), which at decode cost
about as much as the GEMVs themselves (docs/results.md, Decode).
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
# 24.5 us; bench/tune_moe_decode.py, docs/results.md, FP8).
GATE_UP_TILE = dict(block_n=4, block_k=512, warps=2)
DOWN_TILE = dict(block_n=1, block_k=1024, warps=1)
# e4m3 experts (--fp8 experts), one H100, each call routed to its own experts (bench/fp8_experts_check.py
# --sweep; docs/results.md, MoE): gate/up 16 x 1024 with 4 warps 14.7 us (the bf16 tile
# 16.6), down 2 x 1024 with 1 warp 10.5 us (12.0); the bf16 kernels take 21.8 / 11.4 us.
GATE_UP_TILE_E4M3 = dict(block_n=16, block_k=1024, warps=4)
DOWN_TILE_E4M3 = dict(block_n=2, block_k=1024, warps=1)


def _tile(w: torch.Tensor, block_n, block_k, warps, e4m3: dict, other: dict) -> tuple[int, int, int]:
    """The (BLOCK_N, BLOCK_K, warps) a call runs: the ones given, else the tile for w's dtype."""
    t = e4m3 if w.dtype == torch.float8_e4m3fn else other
    return (block_n or t["block_n"], block_k or t["block_k"], warps or t["warps"])


if triton is not None:

    @triton.jit
    def _fixed_sum(v):
        """The sum of values in [0, 1] (at most ROUTE_MAX_EXPERTS of them) in int64 units of 2^-52: integer
        adds in any order give the same bits, so the routing weights do not depend on the launch's warps
        (route_topk and routed_gate_up launch with different ones); the error is far below float32's."""
        return tl.sum((v * 4503599627370496.0).to(tl.int64), axis=0).to(tl.float32) * 2.220446049250313e-16

    @triton.jit
    def _route(logit_row, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
               RENORMALIZE: tl.constexpr):
        """One token's routing, shared by route_topk and routed_gate_up so both give the same bits: its
        logits [E] -> (weights [K_PAD] float32, expert ids [K_PAD] int32), slots past TOP_K zero."""
        e = tl.arange(0, BLOCK_E)
        logit = tl.load(logit_row + e, mask=e < E, other=float("-inf")).to(tl.float32)
        # Choose on the float32 logits (exact order; the probabilities' rounding can only merge neighbours
        # into ties), k rounds of argmax-and-mask; among equal logits the lowest expert id wins.
        left = logit
        slot = tl.arange(0, K_PAD)
        chosen_v = tl.full([K_PAD], float("-inf"), dtype=tl.float32)
        chosen_e = tl.zeros([K_PAD], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            v, best = tl.max(left, axis=0, return_indices=True, return_indices_tie_break_left=True)
            chosen_v = tl.where(slot == j, v, chosen_v)
            chosen_e = tl.where(slot == j, best.to(tl.int32), chosen_e)
            left = tl.where(e == best, float("-inf"), left)
            if j == 0:
                top = v  # the largest logit: every exp(logit - top) is in [0, 1]
        chosen_w = tl.exp(chosen_v - top) / _fixed_sum(tl.exp(logit - top))  # the padding slots hold zeros
        if RENORMALIZE:
            chosen_w = chosen_w / _fixed_sum(chosen_w)
        return chosen_w, chosen_e

    @triton.jit
    def _route_kernel(logit_ptr, weight_ptr, expert_ptr, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                      BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        t = tl.program_id(0)
        chosen_w, chosen_e = _route(logit_ptr + t.to(tl.int64) * stride_l, E, TOP_K, K_PAD, BLOCK_E, RENORMALIZE)
        slot = tl.arange(0, K_PAD)
        ok = slot < TOP_K
        tl.store(weight_ptr + t * TOP_K + slot, chosen_w, mask=ok)
        tl.store(expert_ptr + t * TOP_K + slot, chosen_e, mask=ok)

    @triton.jit
    def _gate_up_rows(x_row, w, s, out_row, K, F, stride_wn, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """silu(gate) * up of this program's column slice of one (token, expert) pair: x_row [K], w the
        expert's [2F, K] rows (gate, then up), s their [2F] channel scales (HAS_SCALE: e4m3 rows), out_row [F]."""
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < F
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
        if HAS_SCALE:  # the channel scale on the float32 sum, as kernels/gemv.py
            gate = gate * tl.load(s + n, mask=n_ok, other=0.0)
            up = up * tl.load(s + n + F, mask=n_ok, other=0.0)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_row + n, act.to(out_row.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _gate_up_kernel(x_ptr, exp_ptr, w_ptr, s_ptr, out_ptr, K, F, top_k, stride_x, stride_we, stride_wn,
                        stride_se, stride_o, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        pdl_wait(USE_PDL)  # kernels/pdl.py: nothing of the kernels ahead is read before this
        p = tl.program_id(0)  # pair p = token p // top_k's (p % top_k)-th expert
        e = tl.load(exp_ptr + p).to(tl.int64)
        _gate_up_rows(x_ptr + (p // top_k).to(tl.int64) * stride_x, w_ptr + e * stride_we, s_ptr + e * stride_se,
                      out_ptr + p.to(tl.int64) * stride_o, K, F, stride_wn, HAS_SCALE, BLOCK_N, BLOCK_K)

    @triton.jit
    def _routed_gate_up_kernel(x_ptr, logit_ptr, w_ptr, s_ptr, out_ptr, weight_ptr, expert_ptr, E, K, F, stride_x,
                               stride_l, stride_we, stride_wn, stride_se, stride_o, TOP_K: tl.constexpr,
                               K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
                               HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               USE_PDL: tl.constexpr = False):
        pdl_trigger(USE_PDL)
        # kernels/pdl.py: nothing of the kernels ahead is read before this; the expert rows to load
        # depend on the logits, so there is nothing to prefetch either
        pdl_wait(USE_PDL)
        p = tl.program_id(0)  # pair p = token t's j-th expert
        t = p // TOP_K
        j = p % TOP_K
        # Every program routes its token again (k + 1 reductions over the E logits in registers) instead of
        # waiting on a routing launch; the same code as route_topk, so the same bits.
        chosen_w, chosen_e = _route(logit_ptr + t.to(tl.int64) * stride_l, E, TOP_K, K_PAD, BLOCK_E, RENORMALIZE)
        slot = tl.arange(0, K_PAD)
        mine = slot == j
        if tl.program_id(1) == 0:  # one program per pair writes its slot for the down kernel
            tl.store(weight_ptr + t * TOP_K + slot, chosen_w, mask=mine)
            tl.store(expert_ptr + t * TOP_K + slot, chosen_e, mask=mine)
        e = tl.sum(tl.where(mine, chosen_e, 0), axis=0).to(tl.int64)
        _gate_up_rows(x_ptr + t.to(tl.int64) * stride_x, w_ptr + e * stride_we, s_ptr + e * stride_se,
                      out_ptr + p.to(tl.int64) * stride_o, K, F, stride_wn, HAS_SCALE, BLOCK_N, BLOCK_K)

    @triton.jit
    def _down_kernel(a_ptr, exp_ptr, pw_ptr, w_ptr, s_ptr, res_ptr, out_ptr, K, N, stride_a, stride_we, stride_wn,
                     stride_se, stride_r, stride_o, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
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
            e = tl.load(exp_ptr + p).to(tl.int64)
            w = w_ptr + e * stride_we
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < K
                av = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                wv = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                             other=0.0)
                acc += tl.sum(wv.to(tl.float32) * av, axis=1)
            if HAS_SCALE:  # e4m3 rows: their channel scales on the float32 sum
                acc = acc * tl.load(s_ptr + e * stride_se + n, mask=n_ok, other=0.0)
            total += acc * tl.load(pw_ptr + p)
        if HAS_RES:  # the block's residual, added as `moe(x) + residual` rounds: the sum first to out's dtype
            total = total.to(out_ptr.dtype.element_ty).to(tl.float32) + tl.load(
                res_ptr + t.to(tl.int64) * stride_r + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * stride_o + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def _check(w: torch.Tensor, name: str, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Checks an expert weight [E, N, K] and its optional channel scales [E, N] (float32, an e4m3 weight's);
    returns the scales contiguous."""
    if w.dim() != 3 or w.stride(-1) != 1:
        raise ValueError(f"{name} must be [E, N, K] with unit stride along K, got shape {tuple(w.shape)} "
                         f"strides {w.stride()}")
    if (w.dtype == torch.float8_e4m3fn) != (scale is not None):
        raise ValueError(f"{name}: e4m3 weights need their {name}_scale [E, N] and 16-bit ones take none; got "
                         f"{w.dtype} {'without' if scale is None else 'with'} a scale")
    if scale is None:
        return None
    if tuple(scale.shape) != tuple(w.shape[:2]) or scale.dtype != torch.float32:
        raise ValueError(f"{name}_scale must be float32 [E, N] = {tuple(w.shape[:2])} (one per expert row), got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    return scale.contiguous()


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32) in one launch: the
    softmax over all experts in float32, the k most probable (largest first), renormalized to sum to 1
    if asked, as engine/moe.py `route` (transformers). Ties: torch.topk does not say which of equal
    values it returns; this kernel takes the lowest expert id among equal logits."""
    weights, experts = _routing_outputs("route_topk", logits, top_k)
    T, E = logits.shape
    if T == 0:
        return weights, experts
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _route_kernel[(T,)](logits, weights, experts, E, logits.stride(0), TOP_K=top_k,
                        K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                        RENORMALIZE=renormalize, num_warps=1 if E <= 256 else 4, **pdl_launch(logits))
    return weights, experts


def _routing_outputs(name: str, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks router logits [T, E] and top_k; the empty weights [T, k] float32 and expert ids [T, k] int32."""
    if logits.dim() != 2:
        raise ValueError(f"{name}: router logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    T, E = logits.shape
    if not 0 < top_k <= E or E > ROUTE_MAX_EXPERTS:
        raise ValueError(f"{name}: top_k={top_k} of {E} experts (at most {ROUTE_MAX_EXPERTS})")
    return (torch.empty(T, top_k, dtype=torch.float32, device=logits.device),
            torch.empty(T, top_k, dtype=torch.int32, device=logits.device))


def expert_gate_up(x: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, block_n: int | None = None,
                   block_k: int | None = None, warps: int | None = None,
                   w13_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of every (token, expert) pair: x [T, H] (rows unit-stride), experts [T, k] (int;
    token t's j-th expert), w13 [E, 2F, H] (each expert's F gate rows, then its F up rows) -> [T * k, F]
    in x.dtype, row t * k + j for token t's j-th expert. w13_scale [E, 2F] float32: w13 is e4m3 with these
    channel scales (applied to each row's float32 sum before silu-mul). Tile: GATE_UP_TILE (16-bit) or
    GATE_UP_TILE_E4M3 unless given."""
    w13_scale = _check(w13, "w13", w13_scale)
    block_n, block_k, warps = _tile(w13, block_n, block_k, warps, GATE_UP_TILE_E4M3, GATE_UP_TILE)
    (T, k), (_, F2, H) = experts.shape, w13.shape
    F = F2 // 2
    out = torch.empty(T * k, F, dtype=x.dtype, device=x.device)
    if T * k == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    scale = w13_scale if w13_scale is not None else out  # an unused pointer without scales
    _gate_up_kernel[(T * k, triton.cdiv(F, block_n))](
        x, experts.contiguous(), w13, scale, out, H, F, k, x.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0) if w13_scale is not None else 0, out.stride(0), HAS_SCALE=w13_scale is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_launch(x))
    return out


def routed_gate_up(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, top_k: int, renormalize: bool,
                   block_n: int | None = None, block_k: int | None = None, warps: int | None = None,
                   w13_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_topk and expert_gate_up in one launch: x [T, H] (rows unit-stride), router logits [T, E],
    w13 [E, 2F, H] (e4m3 with w13_scale [E, 2F], or 16-bit) -> (act [T * k, F] in x.dtype, weights [T, k]
    float32, expert ids [T, k] int32), each bit-equal to `w, e = route_topk(logits, top_k, renormalize);
    act = expert_gate_up(x, e, w13, w13_scale=w13_scale)` at the same tile (the same routing and GEMV code).
    weights and experts feed expert_down. Tile as expert_gate_up."""
    w13_scale = _check(w13, "w13", w13_scale)
    block_n, block_k, warps = _tile(w13, block_n, block_k, warps, GATE_UP_TILE_E4M3, GATE_UP_TILE)
    weights, experts = _routing_outputs("routed_gate_up", logits, top_k)
    (T, E), (_, F2, H) = logits.shape, w13.shape
    if w13.shape[0] != E:
        raise ValueError(f"routed_gate_up: {E} router logits per token for {w13.shape[0]} experts in w13")
    if x.dim() != 2 or tuple(x.shape) != (T, H):
        raise ValueError(f"routed_gate_up: x must be [{T}, {H}] (tokens of the logits, w13's hidden size), "
                         f"got shape {tuple(x.shape)}")
    F = F2 // 2
    act = torch.empty(T * top_k, F, dtype=x.dtype, device=x.device)
    if T == 0:
        return act, weights, experts
    x = x if x.stride(-1) == 1 else x.contiguous()
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _routed_gate_up_kernel[(T * top_k, triton.cdiv(F, block_n))](
        x, logits, w13, w13_scale if w13_scale is not None else act, act, weights, experts, E, H, F, x.stride(0),
        logits.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0) if w13_scale is not None else 0,
        act.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
        RENORMALIZE=renormalize, HAS_SCALE=w13_scale is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl_launch(x))
    return act, weights, experts


def expert_down(act: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w2: torch.Tensor,
                out_dtype: torch.dtype | None = None, block_n: int | None = None, block_k: int | None = None,
                warps: int | None = None, residual: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * (w2[experts[t, j]] @ act[t * k + j]) of every token, in float32, in slot
    order: act [T * k, F] (expert_gate_up's output), experts [T, k] (int), weights [T, k], w2 [E, H, F]
    -> [T, H] in out_dtype (default act.dtype). residual [T, H]: + residual, added in the kernel after the
    sum is rounded to out_dtype (what `expert_down(...) + residual` gives). w2_scale [E, H] float32: w2 is
    e4m3 with these channel scales (each expert's product scaled before its routing weight). Tile: DOWN_TILE
    (16-bit) or DOWN_TILE_E4M3 unless given."""
    w2_scale = _check(w2, "w2", w2_scale)
    block_n, block_k, warps = _tile(w2, block_n, block_k, warps, DOWN_TILE_E4M3, DOWN_TILE)
    (T, k), (_, H, F) = experts.shape, w2.shape
    out = torch.empty(T, H, dtype=out_dtype or act.dtype, device=act.device)
    if T * k == 0:
        return out.zero_() if residual is None else out.copy_(residual)
    act = act.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    _down_kernel[(T, triton.cdiv(H, block_n))](
        act, experts.contiguous(), weights.float().contiguous(), w2, w2_scale if w2_scale is not None else out,
        residual if residual is not None else out, out, F, H, act.stride(0), w2.stride(0), w2.stride(1),
        w2_scale.stride(0) if w2_scale is not None else 0, residual.stride(0) if residual is not None else 0,
        out.stride(0), TOP_K=k, HAS_SCALE=w2_scale is not None, HAS_RES=residual is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, **pdl_launch(act))
    return out
