"""One sparse attention call: its `sparse=` spec (SparsePattern, whose hook the dispatcher calls) and
the entry points. Short or non-causal calls fall back to the dense dispatcher; with `rates` (a
plan.KernelRates), so does every head whose sparse kernel would not beat the dense one."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from starshard.kernels.attention import attention, causal_attention_at, head_subset
from starshard.kernels.common import MIN_SPARSE_ROWS, check_shapes, query_offset, to_device
from starshard.kernels.minference.kernel import attention_triton, triton_available
from starshard.kernels.minference.patterns import AShape, BlockSparse, Dense, VerticalSlash, head_pattern
from starshard.kernels.minference.plan import FallbackPlan, KernelRates, build_plan, start_plan
from starshard.kernels.minference.torch_path import attention_torch


@dataclass(frozen=True)
class SparsePattern:
    """The `sparse=` spec of one attention call: one pattern per query head of this call (a single
    pattern is broadcast to every head), plus the index parameters shared by all heads."""

    heads: tuple
    block_size: int = 64
    last_q: int = 64
    force_sink: int = 30
    force_local: int = 100
    vertical_aware: bool = True  # slash estimates leave out the chosen columns (False: MInference's)

    def __post_init__(self):
        heads = self.heads
        if isinstance(heads, (AShape, VerticalSlash, BlockSparse, Dense, dict)):
            heads = (heads,)
        object.__setattr__(self, "heads", tuple(head_pattern(h) for h in heads))
        if not self.heads:
            raise ValueError("SparsePattern needs at least one head pattern")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.last_q < 1:
            raise ValueError(f"last_q must be >= 1, got {self.last_q}")

    def for_heads(self, num_heads: int) -> tuple:
        if len(self.heads) == 1:
            return self.heads * num_heads
        if len(self.heads) != num_heads:
            raise ValueError(f"sparse pattern has {len(self.heads)} head patterns but the call has {num_heads} query heads")
        return self.heads

    def attention(self, q, k, v, *, q_pos, k_pos, causal=True, scale=None, rates=None, report=None):
        """The hook `attention(..., sparse=pattern)` calls (rates / report: see `minference_attention`)."""
        return minference_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, pattern=self, scale=scale, causal=causal,
                                    rates=rates, report=report)


def minference_attention(q, k, v, *, q_pos, k_pos, pattern, scale=None, causal=True, backend=None, launch=None,
                         rates: KernelRates | None = None, report=None):
    """Sparse prefill attention with lse. `pattern`: a SparsePattern (or anything `SparsePattern(...)`
    accepts: one HeadPattern, a sequence of them). backend: None (Triton on CUDA, else torch),
    "triton" or "torch". Non-causal calls and query blocks of fewer than MIN_SPARSE_ROWS rows run
    exact dense attention.

    rates: the cost model (plan.KernelRates, e.g. plan.measured_rates(head_dim)): heads whose sparse kernel would not
    beat the dense kernel run the dense dispatcher instead (`plan_with_fallback`, in two steps), so their (out, lse)
    are exactly dense attention's. report: anything with record(sparse_densities, dense_heads) (the
    installed method's counter, kernels/sparse.py), told what each call ran."""
    # A whole model's method (MInferenceConfig, config.py, which builds on this module) answers
    # pattern(layer, num_heads); one call takes that answer.
    if not isinstance(pattern, SparsePattern) and callable(getattr(pattern, "pattern", None)):
        raise TypeError("pass config.pattern(layer, num_heads) (one layer's SparsePattern), not the whole MInferenceConfig")
    if not isinstance(pattern, SparsePattern):
        pattern = SparsePattern(pattern if isinstance(pattern, (list, tuple)) else (pattern,))
    check_shapes(q, k, v)
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    heads = pattern.for_heads(Hq)
    if not causal or Lq < MIN_SPARSE_ROWS:
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
    if all(isinstance(p, Dense) for p in heads):
        if report is not None:
            report.record([], Hq)
        return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
    if Lk == 0:
        return torch.zeros_like(q), torch.full((B, Hq, Lq), float("-inf"), device=q.device)
    offset = query_offset(q_pos, k_pos, Lq, Lk)
    sm_scale = D**-0.5 if scale is None else scale
    if rates is None and report is None:
        groups = build_plan(q, k, pattern, offset=offset, scale=sm_scale)
        return attention_from_plan(q, k, v, groups, offset=offset, scale=sm_scale, block_size=pattern.block_size,
                                   backend=backend, launch=launch)
    pending = start_plan(q, k, pattern, offset=offset, scale=sm_scale, rates=rates)
    ran = None
    if pending.early and pending.vs is not None:  # the GPU runs them while the host waits for the estimate
        ran = (len(pending.early), *attention_from_plan(q, k, v, pending.early, offset=offset, scale=sm_scale,
                                                        block_size=pattern.block_size, backend=backend, launch=launch))
    plan = pending.finish()
    if report is not None:
        sparse = sorted(h for grp in plan.groups for h in grp.heads)
        report.record([plan.density[h] for h in sparse], len(plan.dense))
    return attention_with_fallback(q, k, v, plan, q_pos=q_pos, k_pos=k_pos, offset=offset, scale=scale,
                                   block_size=pattern.block_size, backend=backend, launch=launch, ran=ran)


def attention_with_fallback(q, k, v, plan: FallbackPlan, *, q_pos, k_pos, offset: int, scale=None, block_size: int = 64,
                            backend=None, launch=None, ran=None):
    """Run a FallbackPlan: its sparse groups through the sparse kernel, its dense heads through the
    dense dispatcher (the whole call when every head is dense, so nothing but dense attention runs).
    ran: (n, out, lse) when the plan's first n groups already ran into out / lse (`minference_attention`
    runs the groups decided before the estimate's read early); the call completes them."""
    def dense(q, k, v):
        return causal_attention_at(q, k, v, q_pos=q_pos, k_pos=k_pos, offset=offset, scale=scale)

    if not plan.groups:
        return dense(q, k, v)
    sm_scale = q.shape[-1] ** -0.5 if scale is None else scale
    done, out, lse = (0, None, None) if ran is None else ran
    rest = plan.groups[done:]
    if out is None:
        out, lse = attention_from_plan(q, k, v, rest, offset=offset, scale=sm_scale, block_size=block_size,
                                       backend=backend, launch=launch)
    elif rest:
        o, m = attention_from_plan(q, k, v, rest, offset=offset, scale=sm_scale, block_size=block_size,
                                   backend=backend, launch=launch)
        idx = to_device(sorted(h for grp in rest for h in grp.heads), q.device)
        out.index_copy_(1, idx, o.index_select(1, idx))
        lse.index_copy_(1, idx, m.index_select(1, idx))
    if plan.dense:
        o, m = dense(*head_subset(q, k, v, plan.dense))
        idx = to_device(plan.dense, q.device)
        out.index_copy_(1, idx, o)
        lse.index_copy_(1, idx, m)
    return out, lse


def attention_from_plan(q, k, v, groups, *, offset: int, scale=None, block_size: int = 64, backend=None, launch=None):
    """The attention step alone, from `build_plan`'s groups (benchmarks time the two apart; tests feed
    hand-made indices). backend / launch as in `minference_attention`."""
    check_shapes(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # Default: Triton on CUDA; on CPU the torch path (the interpreter is for tests, which ask for it).
    use_triton = q.is_cuda and triton_available(q) if backend is None else backend == "triton"
    if use_triton:
        if not triton_available(q):
            raise RuntimeError("the Triton MInference kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU) and float16/bfloat16/float32")
        return attention_triton(q, k, v, groups, offset=offset, scale=scale, block_size=block_size, launch=launch)
    return attention_torch(q, k, v, groups, offset=offset, scale=scale, block_size=block_size)
