"""Combine partial attention results over disjoint key sets by log-sum-exp (exact).

`merge_partials` (two results): every split of one query block's keys merges here: APB's passing
blocks (parallel/context, which re-exports it), the service's cascade (serving/cascade.py), a query
block after its offset keys (attention.causal_attention_at: Star's [anchor; block]), and a chunked
prefill's stored FP8 prefix with the chunk's own keys (engine/model.py dense_attend).
`merge_into` (a running float32 result and one more partial, in place): the ring's accumulator
(parallel/context/ring.py). On CUDA both are one Triton pass (`_merge_two_kernel`) instead of float32
copies.
`merge_stacked` (S results packed in one float32 tensor, out then lse in the last column): the merge of
a decode step over the CP group after one all-gather (parallel/context/group_merge.py), one Triton
launch on CUDA. `merge_many` (S float32 partials stacked next to their head dim): the torch S-way merge,
also the split-KV decode's torch path (decode.py; its kernel merges its own partials in registers).
`apply_sink` (attention sinks): once, after the last merge; partials that merge are computed without sinks.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton (non-Linux CPU) keep the torch path
    triton = None


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the kernel computes in float32


def merge_partials(out1, lse1, out2, lse2, use_triton: bool | None = None):
    """(out, lse) of attention over the union of two disjoint key sets.

    out*: [B, H, L, D], lse*: [B, H, L] float32. Rows empty in both stay out = 0, lse = -inf. On CUDA
    (`use_triton` defaults to it) one Triton pass reads both partials and writes the result in out1's
    dtype (6 bytes per element from bf16 partials; the torch ops' float32 copies move ~40).
    """
    use_triton = out1.is_cuda if use_triton is None else use_triton
    if (use_triton and triton is not None and out1.dim() == 4 and out1.shape == out2.shape
            and lse1.shape == lse2.shape == out1.shape[:-1] and lse1.dtype == lse2.dtype == torch.float32
            and out1.dtype in _KERNEL_DTYPES and out2.dtype in _KERNEL_DTYPES):  # else the torch ops below
        out = torch.empty(out1.shape, dtype=out1.dtype, device=out1.device)
        lse = torch.empty(lse1.shape, dtype=torch.float32, device=out1.device)
        _launch_merge(out1, lse1, out2, lse2, out, lse)
        return out, lse
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.nan_to_num(neginf=0.0)
    w1 = torch.exp(lse1 - safe).nan_to_num(nan=0.0).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).nan_to_num(nan=0.0).unsqueeze(-1)
    # w1 * out1 + w2 * out2 in float32, in place on fresh copies: two float32 [.., D] buffers alive, not four
    out = out1.to(torch.float32, copy=True).mul_(w1)
    out.add_(out2.to(torch.float32, copy=True).mul_(w2))
    return out.to(out1.dtype), lse


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    """(out, lse) of attention with per-head sink logits `sinks` [H] (GPT-OSS: exp(sink) joins the
    softmax denominator only) from the sink-free (out, lse) over all of a row's keys: out times
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); lse unchanged (the contract's lse excludes
    the sink). Apply once, to the merged result: a sink in every partial would count it per partial."""
    if sinks is None:
        return out, lse
    acc = torch.promote_types(out.dtype, torch.float32)
    w = torch.sigmoid(lse.to(acc) - sinks.to(device=lse.device, dtype=acc)[None, :, None])  # lse = -inf: weight 0
    return (out.to(acc) * w.unsqueeze(-1)).to(out.dtype), lse


def merge_many(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial results over disjoint key sets: outs [..., S, D] float32, lses [..., S]."""
    lse = torch.logsumexp(lses, dim=-1)
    w = torch.exp(lses - lse.nan_to_num(neginf=0.0)[..., None])  # all -inf rows: weights 0, not NaN
    return (w[..., None] * outs).sum(-2), lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               use_triton: bool | None = None) -> None:
    """acc <- the merge of acc and one more partial over disjoint keys, in place. acc_out [B, H, L, D]
    float32 and acc_lse [B, H, L] float32 (views allowed: a slice of a larger accumulator); out [B, H,
    L, D] and lse [B, H, L], any strides. On CUDA one pass that reads both and writes acc (10 bytes per
    element from bf16 partials; the torch ops + the copy back move ~50); elsewhere merge_partials' torch
    ops. `use_triton` defaults to CUDA inputs (TRITON_INTERPRET on CPU for tests)."""
    if acc_out.dtype != torch.float32 or acc_lse.dtype != torch.float32:
        raise ValueError(f"merge_into accumulates in float32, got acc {acc_out.dtype} / {acc_lse.dtype}")
    lse = lse.float()  # float32 by the attention contract; anything else is converted, not refused
    if acc_out.shape != out.shape or acc_lse.shape != lse.shape or acc_out.shape[:-1] != acc_lse.shape:
        raise ValueError(f"merge_into shapes differ: acc {tuple(acc_out.shape)} / {tuple(acc_lse.shape)}, "
                         f"partial {tuple(out.shape)} / {tuple(lse.shape)}")
    use_triton = acc_out.is_cuda if use_triton is None else use_triton
    if not use_triton or triton is None or out.dtype not in _KERNEL_DTYPES:
        o, l = merge_partials(acc_out, acc_lse, out, lse, use_triton=False)
        acc_out.copy_(o)
        acc_lse.copy_(l)
        return
    _launch_merge(acc_out, acc_lse, out, lse, acc_out, acc_lse)  # the result written over the accumulator


def _launch_merge(o1, l1, o2, l2, out, lse) -> None:
    """out, lse <- the merge of (o1, l1) and (o2, l2), all [B, H, L(, D)] with any strides (out may be o1)."""
    B, H, L, D = o1.shape
    if B * H * L == 0:
        return
    BLOCK_R = 32
    _merge_two_kernel[(triton.cdiv(L, BLOCK_R), B * H)](
        o1, l1, o2, l2, out, lse, *o1.stride(), *l1.stride(), *o2.stride(), *l2.stride(), *out.stride(),
        *lse.stride(), H, L, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_R=BLOCK_R, num_warps=4)


def merge_stacked(packed: torch.Tensor, dtype: torch.dtype, use_triton: bool | None = None):
    """(out, lse) of attention over the union of S disjoint key sets, from their partials stacked and
    packed: packed [S, B, H, L, D + 1] float32, [..., :D] a partial out, [..., D] its lse. Returns out
    [B, H, L, D] in `dtype` and lse [B, H, L] float32; rows empty in every partial get out = 0, lse =
    -inf. `use_triton` defaults to CUDA inputs (set it to run the kernel under TRITON_INTERPRET on CPU)."""
    if packed.dim() < 2 or packed.dtype != torch.float32 or packed.shape[-1] < 2:
        raise ValueError(f"merge_stacked wants float32 [S, ..., D + 1] partials, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    use_triton = packed.is_cuda if use_triton is None else use_triton
    S, rest, D = packed.shape[0], packed.shape[1:-1], packed.shape[-1] - 1
    if not use_triton or triton is None:
        out, lse = merge_many(packed[..., :D].movedim(0, -2), packed[..., D].movedim(0, -1))
        return out.to(dtype), lse
    packed = packed.contiguous()
    rows = packed[0, ..., 0].numel()
    out = torch.empty(*rest, D, dtype=dtype, device=packed.device)
    lse = torch.empty(rest, dtype=torch.float32, device=packed.device)
    if rows:
        _merge_stacked_kernel[(rows,)](packed, out, lse, rows, S, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                                       BLOCK_S=triton.next_power_of_2(S))
    return out, lse


if triton is not None:

    @triton.jit(do_not_specialize=["L"])
    def _merge_two_kernel(A, LA, P, LP, O, LO,
                          s_ab, s_ah, s_am, s_ad, s_lb, s_lh, s_lm, s_pb, s_ph, s_pm, s_pd, s_qb, s_qh, s_qm,
                          s_ob, s_oh, s_om, s_od, s_rb, s_rh, s_rm,
                          H, L, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
        """BLOCK_R rows of one (batch, head): two partials weighted by exp(lse - max), written to O / LO
        (which may be A / LA: each program reads its tile before writing it)."""
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # r x row stride can pass 2^31
        d = tl.arange(0, BLOCK_D)
        r_ok = r < L
        ok = r_ok[:, None] & (d < HEAD_DIM)[None, :]
        l1 = tl.load(LA + b * s_lb + h * s_lh + r * s_lm, mask=r_ok, other=float("-inf"))
        l2 = tl.load(LP + b * s_qb + h * s_qh + r * s_qm, mask=r_ok, other=float("-inf"))
        o1 = tl.load(A + b * s_ab + h * s_ah + r[:, None] * s_am + d[None, :] * s_ad, mask=ok, other=0.0)
        o2 = tl.load(P + b * s_pb + h * s_ph + r[:, None] * s_pm + d[None, :] * s_pd, mask=ok, other=0.0)
        m = tl.maximum(l1, l2)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w1 = tl.exp(l1 - m_use)
        w2 = tl.exp(l2 - m_use)
        den = w1 + w2
        empty = den == 0.0
        inv = 1.0 / tl.where(empty, 1.0, den)
        res = (w1 * inv)[:, None] * o1.to(tl.float32) + (w2 * inv)[:, None] * o2.to(tl.float32)
        tl.store(O + b * s_ob + h * s_oh + r[:, None] * s_om + d[None, :] * s_od, res.to(O.dtype.element_ty), mask=ok)
        lse = tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, den)))
        tl.store(LO + b * s_rb + h * s_rh + r * s_rm, lse, mask=r_ok)

    @triton.jit(do_not_specialize=["rows", "n_parts"])
    def _merge_stacked_kernel(P, O, LSE, rows, n_parts, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_S: tl.constexpr):
        """One program per row: its S partials' lse and out read at once, weighted by exp(lse - max)."""
        row = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < n_parts
        d_ok = offs_d < HEAD_DIM
        base = (offs_s.to(tl.int64) * rows + row) * (HEAD_DIM + 1)
        lp = tl.load(P + base + HEAD_DIM, mask=s_ok, other=float("-inf"))
        o = tl.load(P + base[:, None] + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        m = tl.max(lp, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lp - m_use)
        den = tl.sum(w, 0)
        empty = den == 0.0
        out = tl.sum(w[:, None] * o, 0) / tl.where(empty, 1.0, den)
        tl.store(O + row.to(tl.int64) * HEAD_DIM + offs_d, out.to(O.dtype.element_ty), mask=d_ok)
        tl.store(LSE + row, tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, den))))
