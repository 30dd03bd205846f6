"""The model's projections: nn.Linear with a decode path, and the residual sum a projection may take over.

    y = Linear(K, N)(x)                      # F.linear, or on CUDA for one row (a decode step) the GEMV
    h = project_add(linear, x, residual)     # linear(x) + residual, added in the GEMV's epilogue if it can
    h = project_heads(wo, out, residual)     # the same on attention's output out [B, H, L, D] as rows [B, L, H * D]

Decode multiplies one row by each weight: cuBLAS's one-row path read bf16 projections up to 15% slower
than kernels/gemv.py on an H100 (the Qwen3-MoE router 85%; bench/bf16_gemv_probe.py; on an H200 the wide
ones are up to 9% faster in cuBLAS, see kernels/gemv.py), and a block's two residual adds are a kernel each.
Same parameters and state-dict keys as nn.Linear, so checkpoints, tensor parallelism (which swaps in
megatron-core's layers) and FP8 (parallel/fp8.py Fp8Linear) see no difference. CPU and prefill-sized
calls run F.linear exactly as before.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from starshard.kernels.gemv import gemv, use_gemv


class Linear(nn.Linear):
    # project_add hands this layer the block's residual (the GEMV adds it; F.linear's path adds after)
    adds_residual = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if use_gemv(x, self.weight):
            shape = x.shape
            y = gemv(x.reshape(-1, shape[-1]), self.weight, None, self.bias, residual=residual)  # gemv flattens it
            return y.view(*shape[:-1], self.out_features)
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y + residual


def project_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """linear(x) + residual. A projection that takes the residual itself (`adds_residual`: Linear,
    parallel/fp8.py Fp8Linear, whose decode GEMV adds it in its epilogue) gets it; the sum is the same."""
    if residual is None:
        return linear(x)
    if getattr(linear, "adds_residual", False):
        return linear(x, residual=residual)
    return linear(x) + residual


def project_heads(linear: nn.Module, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """linear(out read as rows [B, L, H * D]) + residual, for attention's output out [B, H, L, D]. A projection
    that reads the heads' layout itself (`reads_heads`: parallel/fp8.py Fp8Linear, whose prefill quantizes
    straight from it) gets out as it is; the rest get the transposing copy, then project_add."""
    if getattr(linear, "reads_heads", False):
        return linear.forward_heads(out, residual)
    B, H, L, D = out.shape
    return project_add(linear, out.transpose(1, 2).reshape(B, L, H * D), residual)
