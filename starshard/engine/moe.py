"""The mixture-of-experts MLP of Qwen3-MoE and Mixtral: a replicated router and stacked SwiGLU experts.

    weights, experts = route(router_logits, top_k, renormalize)      # [T, k] each
    out = grouped_experts(x, weights, experts, w13, w2)              # [T, H]

Routing follows transformers: softmax over all experts in float32, the top k, renormalized to sum
to 1 when the family says so (Mixtral always, Qwen3-MoE by `norm_topk_prob`). The experts are two
stacked tensors, `w13` [E, 2F, H] (each expert's gate rows, then its up rows) and `w2` [E, H, F], and
run as one grouped GEMM per projection: the (token, expert) pairs are sorted by expert so that each
expert's rows are contiguous, then `grouped_mm` multiplies every segment by its expert's matrix in
one call. No Python loop over experts: the work and the weights read follow the tokens' choices,
and an expert no token picked costs nothing.

Decode on the GPU (up to GEMV_MAX_PAIRS (token, expert) pairs) runs the expert side in two Triton
launches after the router's GEMV (kernels/moe_decode.py): the experts' gate/up GEMVs, which route the
tokens themselves, and their down GEMVs summed per token; no sort, no per-pair bookkeeping in torch. The
CPU keeps the torch path. With e4m3 experts (--fp8 experts, parallel/fp8.py Fp8GroupedExperts) the decode
kernels read them as stored with their row scales; prefill-sized calls run FP8 grouped GEMMs on per-row
quantized inputs (torch._scaled_grouped_mm), or that rounding on the dequantized weights (the CPU).

Tensor parallelism (parallel/tensor.py) cuts every expert's F columns over the ranks, as the dense
MLP's: each rank computes a partial output over its columns, and `combine` (identity on one device)
sums them.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from starshard.config import ModelConfig
from starshard.engine.linear import Linear
from starshard.kernels.activation import silu_mul, silu_mul_quant
from starshard.kernels.fp8 import FAST_ACCUM, FP8_DTYPE, dequantize, quantize_rows
from starshard.kernels.moe_decode import (
    GEMV_MAX_PAIRS,
    ROUTE_MAX_EXPERTS,
    expert_down,
    expert_gate_up,
    routed_gate_up,
    triton,
)

# torch >= 2.10 exports it as F.grouped_mm; earlier releases (2.8, 2.9) as torch._grouped_mm.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# e4m3 x e4m3 with row / channel scales per group (CUDA, Hopper): --fp8 experts' prefill GEMMs.
_SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)
GATHER_MAX_ROWS = 64  # fallback: up to this many (token, expert) pairs gather their experts' weights


@functools.cache
def grouped_mm_works(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether this torch runs grouped_mm for `dtype` on this device (CUDA: bf16 from sm80 on; some
    builds also float32 / float16; CPU from torch 2.9): probed once with a tiny product."""
    if _GROUPED_MM is None:
        return False
    dev = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        a = torch.ones(4, 16, device=dev, dtype=dtype)
        b = torch.ones(2, 16, 16, device=dev, dtype=dtype).transpose(-2, -1)
        out = _GROUPED_MM(a, b, offs=torch.tensor([1, 4], device=dev, dtype=torch.int32))
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def scaled_grouped_mm_works(device_index: int | None) -> bool:
    """Whether this torch runs the e4m3 grouped GEMM (torch._scaled_grouped_mm with a float32 scale per row of
    each operand) on this CUDA device, into bfloat16: probed once with a tiny product of two groups."""
    if _SCALED_GROUPED_MM is None:
        return False
    dev = torch.device("cuda", device_index) if device_index is not None else torch.device("cuda")
    try:
        a = torch.ones(32, 32, device=dev).to(FP8_DTYPE)
        b = torch.ones(2, 32, 32, device=dev).to(FP8_DTYPE)
        out = _SCALED_GROUPED_MM(a, b.transpose(-2, -1), torch.ones(32, device=dev), torch.full((2, 32), 2.0, device=dev),
                                 offs=torch.tensor([16, 32], device=dev, dtype=torch.int32), out_dtype=torch.bfloat16,
                                 use_fast_accum=FAST_ACCUM)
        return bool((out.float() == 64).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def use_expert_gemvs(x: torch.Tensor, top_k: int) -> bool:
    """Whether tokens x [T, H] run the experts through the Triton GEMVs (kernels/moe_decode.py): on the
    GPU, up to GEMV_MAX_PAIRS (token, expert) pairs (decode)."""
    return x.is_cuda and triton is not None and x.shape[0] * top_k <= GEMV_MAX_PAIRS


def use_decode_kernels(x: torch.Tensor, top_k: int, num_experts: int) -> bool:
    """Whether tokens x [T, H] take the whole Triton decode path: the expert GEMVs with the routing in
    the gate/up kernel (one token's logits in one program's registers: up to ROUTE_MAX_EXPERTS)."""
    return use_expert_gemvs(x, top_k) and num_experts <= ROUTE_MAX_EXPERTS


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k]), as transformers routes."""
    probs = logits.float().softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows x [N, K] sorted by expert (expert e owns rows offs[e-1]:offs[e]) times w[e]^T, w [E, M, K]."""
    return _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)


def _gathered(x: torch.Tensor, w: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
    """Fallback for few rows: each row with its own expert's matrix (a gather of the chosen experts,
    then one batched product)."""
    return torch.bmm(w[expert_of_row], x[:, :, None])[:, :, 0]


def _padded(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Fallback for many rows: every expert's segment padded to the longest one, one batched product
    over experts [E, C, K] x [E, K, M], the padding dropped."""
    E = w.shape[0]
    cap = int(counts.max())
    start = offs.long() - counts
    slot = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(start, counts)
    expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts)
    buf = x.new_zeros(E, cap, x.shape[1])
    buf[expert, slot] = x
    return torch.bmm(buf, w.transpose(-2, -1))[expert, slot]


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, impl: str | None = None, residual: torch.Tensor | None = None,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for every token t. x [T, H]; w13 [E, 2F, H]
    (gate rows, then up rows); w2 [E, H, F]. impl: None picks, on a GPU with up to GEMV_MAX_PAIRS
    (token, expert) pairs (decode), "gemv" (the Triton expert GEMVs of kernels/moe_decode.py: no sort,
    weights read in place, SiLU-mul fused), else grouped_mm where the device and dtype run it, else
    "gather" for up to GATHER_MAX_ROWS pairs and "padded" above; tests name one.
    e4m3 experts (--fp8 experts): w13 / w2 e4m3 with w13_scale [E, 2F] / w2_scale [E, H] (float32 row
    scales). "gemv" reads them as stored; past GEMV_MAX_PAIRS pairs the GEMMs are FP8 as --fp8 linear's
    prefill: each row of the gathered input and of silu(gate) * up quantized to e4m3, "grouped_fp8"
    (torch._scaled_grouped_mm, on a GPU that runs it, bfloat16) or, elsewhere, the same rounding then the
    16-bit paths on the dequantized weights (the CPU's reference).
    The weighted sum is taken in float32, in a fixed order (no atomics), so every TP rank and every
    run gives the same bits for the same inputs. residual [T, H]: returns the sum + residual (the "gemv"
    path adds it in its down kernel)."""
    T, k = experts.shape
    E = w13.shape[0]
    flat = experts.reshape(-1)
    fp8 = w13_scale is not None
    if impl is None and use_expert_gemvs(x, k):
        impl = "gemv"  # decode: one row per pair, the Triton expert GEMVs (kernels/moe_decode.py), no sort
    if impl == "gemv":  # each token's k experts summed in the down kernel, in float32, in slot order
        act = expert_gate_up(x, experts, w13, w13_scale=w13_scale)
        return expert_down(act, experts, weights, w2, out_dtype=x.dtype, residual=residual, w2_scale=w2_scale)
    if residual is not None:
        return grouped_experts(x, weights, experts, w13, w2, impl, w13_scale=w13_scale, w2_scale=w2_scale) + residual
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
    src = order // k  # each pair's token
    counts = torch.zeros(E, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0)
    quantize_acts = fp8 and T * k > GEMV_MAX_PAIRS  # the FP8 GEMMs' numerics (the kernels' below it)
    if (impl is None and quantize_acts and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0
            and w2.shape[-1] % 16 == 0 and scaled_grouped_mm_works(x.device.index)):  # e4m3 rows 16-byte aligned
        impl = "grouped_fp8"
    if impl == "grouped_fp8":
        offs32 = offs.to(torch.int32)
        x8, sx = quantize_rows(x)  # T rows, then gathered: an eighth of quantizing the T * k pairs
        # Fast accumulation, as the dense FP8 GEMM (kernels/fp8.py FAST_ACCUM); with the promoted one torch's
        # kernel for 256-1024 rows per expert ran 2-3x slower than bf16 on an H100 (Qwen3-30B-A3B, 4K-16K tokens;
        # bench/scaled_grouped_mm_probe.py; docs/results.md, FP8).
        h = _SCALED_GROUPED_MM(x8[src], w13.transpose(-2, -1), sx[src], w13_scale, offs=offs32, out_dtype=x.dtype,
                               use_fast_accum=FAST_ACCUM)
        a8, sa = silu_mul_quant(h)
        y = _SCALED_GROUPED_MM(a8, w2.transpose(-2, -1), sa, w2_scale, offs=offs32, out_dtype=x.dtype,
                               use_fast_accum=FAST_ACCUM)
    else:
        if fp8:  # the reference: dequantized weights, the FP8 GEMMs' rounding of the inputs where they would run
            w13, w2 = dequantize(w13, w13_scale, x.dtype), dequantize(w2, w2_scale, x.dtype)
        # [T * k, H]; where FP8 GEMMs would run, the tokens rounded through e4m3 before the gather, as there
        rows = (dequantize(*quantize_rows(x), x.dtype) if quantize_acts else x)[src]
        if impl is None:
            idx = x.device.index if x.device.type == "cuda" else None
            # grouped_mm wants 16-byte aligned rows (CPU and CUDA): widths of a multiple of 16 bytes.
            aligned = (x.shape[-1] * x.element_size()) % 16 == 0 and (w2.shape[-1] * x.element_size()) % 16 == 0
            if aligned and grouped_mm_works(x.device.type, idx, x.dtype):
                impl = "grouped"
            else:
                impl = "gather" if T * k <= GATHER_MAX_ROWS else "padded"
        if impl == "grouped":
            offs32 = offs.to(torch.int32)

            def mm(a, w):
                return _grouped(a, w, offs32)
        elif impl == "gather":
            sorted_experts = flat[order]

            def mm(a, w):
                return _gathered(a, w, sorted_experts)
        elif impl == "padded":
            def mm(a, w):
                return _padded(a, w, counts, offs)
        else:
            raise ValueError(f"unknown expert GEMM {impl!r}; one of gemv, grouped, grouped_fp8, gather, padded")
        act = silu_mul(mm(rows, w13))  # SwiGLU, gate columns first (one kernel on CUDA)
        if quantize_acts:
            act = dequantize(*quantize_rows(act), x.dtype)
        y = mm(act, w2)  # [T * k, H], sorted by expert
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(T, k, -1)
    out = (unsorted.float() * weights[..., None]).sum(dim=1)
    return out.to(x.dtype)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked: `w13` [E, 2F, H] (gate rows, then up rows, as FeedForward.w13 per
    expert), `w2` [E, H, F]. F is this rank's share of the expert width under tensor parallelism.
    `w13_scale` / `w2_scale`: None here; float32 [E, 2F] / [E, H] where the weights are e4m3
    (parallel/fp8.py Fp8GroupedExperts, --fp8 experts), which the decode kernels read as stored."""

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class MoEFeedForward(nn.Module):
    """Router (replicated on every TP rank: each rank routes its full copy of the hidden state the
    same way) + grouped experts. `combine` sums partial expert outputs over ranks that each hold
    part of every expert's width (set by parallel/tensor.py; identity on one device)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.combine: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.decode_kernels: bool | None = None  # None: use_decode_kernels decides; tests force True on CPU

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum for x [..., hidden] (+ residual, the block's sum, when given)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        decode = self.decode_kernels
        if decode is None:
            decode = use_decode_kernels(x, self.top_k, logits.shape[-1])
        # the residual goes into the down kernel where nothing follows it (one device: combine is identity)
        fused = residual is not None and decode and self.combine is _identity
        ex = self.experts
        if decode:  # gate/up with the routing, then down: two launches, no host sync (CUDA-graph safe)
            act, weights, experts = routed_gate_up(x, logits, ex.w13, self.top_k, self.renormalize,
                                                   w13_scale=ex.w13_scale)
            out = expert_down(act, experts, weights, ex.w2, out_dtype=x.dtype, w2_scale=ex.w2_scale,
                              residual=residual.reshape(-1, shape[-1]) if fused else None)
        else:
            weights, experts = route(logits, self.top_k, self.renormalize)
            out = grouped_experts(x, weights, experts, ex.w13, ex.w2, w13_scale=ex.w13_scale, w2_scale=ex.w2_scale)
        out = self.combine(out).view(shape)
        return out if residual is None or fused else out + residual
