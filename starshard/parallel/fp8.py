"""FP8 linear layers applied to a built model from outside (like tensor parallelism, tensor.py).

    quantize_linears(model, tp_group)   # after the weights are loaded: wqkv, wo, w13, w2 -> Fp8Linear

Each decoder projection keeps its (tensor-parallel) shard, now in e4m3 with one float32 scale per
output channel (amax of the row / 448). Column-parallel layers (wqkv, w13) multiply their shard and
need nothing else; row-parallel ones (wo, w2) multiply their shard of the input and all-reduce the
partial output over the TP group, as megatron-core's RowParallelLinear does. The embedding, the
norms and the LM head stay in the compute dtype.

Why our own module rather than torchao's float8 inference path (torchao 0.18, which imports here): its
`quantize_` swaps nn.Linear modules, and our TP layers are megatron-core's Column / RowParallelLinear
(their own weight handling and communication), so they would need re-implementing either way; its
dynamic-activation path quantizes activations in separate eager ops (measured in issue 19: 1.02x
bf16 at 8K rows, 13x slower than bf16 at one row), and decode needs a weight-only kernel it does not
have. The matmul itself is torch._scaled_mm, the same op torchao calls (kernels/fp8.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from starshard.kernels.fp8 import FP8_DTYPE, fp8_linear, quantize_rows

COLUMN_PARALLEL = ("attention.wqkv", "feed_forward.w13")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


class Fp8Linear(nn.Module):
    """y = x @ (weight * weight_scale[:, None]).T (+ bias): weight e4m3 [N, K], weight_scale float32 [N].
    `reduce_group`: row-parallel: the local product is summed over this group, the bias added after."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce_group=None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)
        self.reduce_group = reduce_group

    @classmethod
    def quantize(cls, linear: nn.Module, reduce_group=None) -> Fp8Linear:
        """From a loaded linear (nn.Linear or a megatron-core parallel linear holding its shard)."""
        w8, scale = quantize_rows(linear.weight.detach())
        bias = getattr(linear, "bias", None)
        return cls(w8, scale, None if bias is None else bias.detach(), reduce_group)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce_group is None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        y = fp8_linear(x, self.weight, self.weight_scale)
        dist.all_reduce(y, group=self.reduce_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, row_parallel={self.reduce_group is not None}"


def quantize_linears(model: nn.Module, tp_group=None) -> nn.Module:
    """Swap every decoder layer's projections for Fp8Linear (in place; frees the bf16 weights).
    `tp_group`: the tensor-parallel group when tp > 1 (the row-parallel layers all-reduce over it).
    On a meta-device model it makes empty e4m3 modules of the right shapes, which an FP8 checkpoint's
    weights and scales are then assigned to (runtime/build.py, checkpoints/load.py)."""
    reduce = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    for block in model.layers:
        for names, group in ((COLUMN_PARALLEL, None), (ROW_PARALLEL, reduce)):
            for name in names:
                parent_name, attr = name.split(".")
                parent = getattr(block, parent_name)
                linear = getattr(parent, attr, None)
                weight = getattr(linear, "weight", None)
                if weight is None or weight.dim() != 2 or weight.dtype == FP8_DTYPE:  # not a dense projection (MoE experts)
                    continue
                setattr(parent, attr, Fp8Linear.quantize(linear, group))
    return model
