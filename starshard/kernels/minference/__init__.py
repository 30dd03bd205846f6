"""MInference sparse prefill attention: A-shape, Vertical-Slash and Block-Sparse heads, with lse.

    pattern = MInferenceConfig.load("cfg.json").pattern(layer, num_heads=Hq)   # one layer, this rank's heads
    out, lse = attention(q, k, v, q_pos=..., k_pos=..., sparse=pattern)       # dispatcher hook
    out, lse = minference_attention(q, k, v, q_pos=..., k_pos=..., pattern=pattern)  # same thing, direct

Same contract as `attention` (docs/design.md): q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (GQA), causal by
global position, out in q.dtype, lse float32 (natural log), rows with no visible key get out = 0 and
lse = -inf, so results merge with other partial results by lse.

Positions (shared by the batch): q_pos and k_pos runs of consecutive positions with q_pos[0] >=
k_pos[0] (q_pos = k_pos = arange(L); a query block at the end of its keys; a block after them), or
q_pos equal to the last entries of strictly increasing k_pos (gaps allowed, e.g. Star's [anchor;
block]). Everything works in "key index" space: query row i sits at key index i + off (off =
q_pos[0] - k_pos[0], or Lk - Lq in the second case; `common.query_offset`), key j is visible to row i
iff j <= i + off, and sinks, windows and diagonals are counted in key indices. Other layouts raise
ValueError.

The modules, in the order a call runs through them:
- patterns.py: the per-head patterns and what each one sees; config.py: a model's patterns per
  layer and head, and their file formats.
- attend.py: SparsePattern (one call's `sparse=` spec) and the entry points.
- index.py: Vertical-Slash / Block-Sparse index building (torch, shared by both backends; the
  Vertical-Slash estimate's softmax rows, diagonal runs and column lists also as Triton launches in
  estimate.py, runs.py and columns.py, on by default for CUDA);
  plan.py: heads grouped by kind with their indices, visibility masks and kernel cost, and the cost
  model (measured kernel rates, `plan_with_fallback`) that sends heads whose sparse kernel would not
  beat the dense one to the dense dispatcher.
- kernel.py: the Triton kernel (one program per (query block, batch x head), heaviest blocks first)
  on CUDA or under TRITON_INTERPRET=1; torch_path.py: otherwise, the very same visibility as a mask
  (torch's fused CPU flash kernel with an additive bias for float32/bfloat16 on CPU, float32 math
  otherwise, float64 for float64 inputs).
"""
from starshard.kernels.common import MIN_SPARSE_ROWS, query_offset
from starshard.kernels.common import cdiv as _cdiv  # noqa: F401  (the pattern search and benchmarks use mi._cdiv)
from starshard.kernels.minference.attend import SparsePattern, attention_from_plan, attention_with_fallback, minference_attention
from starshard.kernels.minference.config import MInferenceConfig
from starshard.kernels.minference.index import (
    BSIndex, VSIndex, bs_select, pick_slash, pick_vertical, vs_estimate, vs_index, vs_pick, vs_scores, vs_segments,
    vs_select,
)
from starshard.kernels.minference.kernel import default_launch, default_settings, triton_available
from starshard.kernels.minference.kernel import triton  # noqa: F401  (None without triton; benchmarks report its version)
from starshard.kernels.minference.patterns import (
    PUBLISHED_BLOCK_TOPK, AShape, BlockSparse, Dense, HeadPattern, VerticalSlash, head_pattern,
)
from starshard.kernels.minference.plan import (
    MEASURED_RATES, FallbackPlan, HeadGroup, KernelRates, block_sparse_cost, build_plan, column_cost, dense_cost,
    group_mask, kernel_cost, measured_rates, plan_with_fallback, slash_cost, vs_runs,
)

__all__ = [
    "AShape", "VerticalSlash", "BlockSparse", "Dense", "HeadPattern", "PUBLISHED_BLOCK_TOPK", "head_pattern",
    "SparsePattern", "MInferenceConfig", "minference_attention", "attention_from_plan", "query_offset",
    "MIN_SPARSE_ROWS", "vs_estimate", "vs_scores", "vs_pick", "pick_vertical", "pick_slash", "vs_select",
    "vs_segments", "vs_index", "bs_select", "VSIndex", "BSIndex", "HeadGroup", "build_plan", "group_mask",
    "kernel_cost", "dense_cost", "default_launch", "default_settings", "triton_available", "KernelRates",
    "MEASURED_RATES", "measured_rates", "FallbackPlan",
    "plan_with_fallback", "attention_with_fallback", "slash_cost", "column_cost", "block_sparse_cost", "vs_runs",
]
