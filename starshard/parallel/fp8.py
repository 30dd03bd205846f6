"""FP8 linear layers applied to a built model from outside (like tensor parallelism, tensor.py).

    quantize_linears(model, tp_group)   # after the weights are loaded: wqkv, wo, w13, w2 -> Fp8Linear
    fuse_inputs(model)                  # the norms and the silu-mul before them move into them
    quantize_experts(model)             # --fp8 experts: each MoE layer's experts -> Fp8GroupedExperts

Each decoder projection keeps its (tensor-parallel) shard, now in e4m3 with one float32 scale per
output channel (amax of the row / 448). Column-parallel layers (wqkv, w13) multiply their shard and
need nothing else; row-parallel ones (wo, w2) multiply their shard of the input and all-reduce the
partial output over the TP group, as megatron-core's RowParallelLinear does. The embedding, the
norms and the LM head stay in the compute dtype.

Prefill activations are quantized by the op that makes them (kernels/activation.py): fuse_inputs
hands each block's attention_norm to wqkv and, in dense layers, ffn_norm to w13 and the SwiGLU's
silu-mul to w2. On CUDA with more than WEIGHT_ONLY_MAX_ROWS rows the projection then runs one
norm-and-quantize (or silu-mul-and-quantize) kernel and the FP8 GEMM, instead of the norm's pass, the
quantization pass (and silu's and the multiply's); elsewhere (decode, the CPU) it applies the norm /
silu-mul exactly as the block did, then fp8_linear: CPU numerics are unchanged. The norm module stays
registered where it was (its weight keeps its checkpoint name, layers.i.attention_norm.weight, and is
assigned there when an FP8 checkpoint loads into the meta model), now a DeferredRMSNorm that passes
its input through; the projection holds a reference to it. MoE layers keep ffn_norm in the block (the
router and the bf16 experts read its output).

Why our own module rather than torchao's float8 inference path (torchao 0.18, which imports here): its
`quantize_` swaps nn.Linear modules, and our TP layers are megatron-core's Column / RowParallelLinear
(their own weight handling and communication), so they would need re-implementing either way; its
dynamic-activation path quantizes activations in separate eager ops (measured in issue 19: 1.02x
bf16 at 8K rows, 13x slower than bf16 at one row), and decode needs a weight-only kernel it does not
have. The matmul itself is torch._scaled_mm, the same op torchao calls (kernels/fp8.py). NVIDIA's
Transformer Engine (te.pytorch.Linear / fp8_autocast, FP8 GEMMs with their own scaling recipes) is the other
maintained route; its PyTorch extension builds against the machine's CUDA toolkit and cannot be installed on
the device machines this project measures on, so it is an alternative left untested here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from starshard.engine.model import FeedForward, RMSNorm, SiluMul
from starshard.engine.moe import GroupedExperts, MoEFeedForward
from starshard.kernels.activation import quantize_heads, rms_norm_quant, silu_mul, silu_mul_quant, use_fused_quant
from starshard.kernels.fp8 import FP8_DTYPE, fp8_linear, quantize_rows, scaled_mm

COLUMN_PARALLEL = ("attention.wqkv", "feed_forward.w13")
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


class DeferredRMSNorm(RMSNorm):
    """A block's RMSNorm once the Fp8Linear reading its output applies it (Fp8Linear.input_norm): the
    block's call passes x through, `normalize` is RMSNorm's forward. The weight stays here, under its
    checkpoint name, and still tells the runtime the compute dtype and device."""

    @classmethod
    def of(cls, norm: RMSNorm) -> DeferredRMSNorm:
        deferred = cls(norm.weight.shape[0], norm.eps)
        deferred.weight = norm.weight
        return deferred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, applied by the next projection"


class Fp8Linear(nn.Module):
    """y = x @ (weight * weight_scale[:, None]).T (+ bias): weight e4m3 [N, K], weight_scale float32 [N].
    `reduce_group`: row-parallel: the local product is summed over this group, the bias added after.
    Optional input transform, applied before the product (set by fuse_inputs):
    `input_norm` a DeferredRMSNorm (x is the un-normalized hidden state [.., K]), or
    `input_act` "silu_mul" (x is w13's output [.., 2K], gate columns first)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce_group=None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)
        self.reduce_group = reduce_group
        self.input_norm: DeferredRMSNorm | None = None  # set by fuse_norm: a reference, not a submodule
        self.input_act: str | None = None

    @classmethod
    def quantize(cls, linear: nn.Module, reduce_group=None) -> Fp8Linear:
        """From a loaded linear (nn.Linear or a megatron-core parallel linear holding its shard)."""
        w8, scale = quantize_rows(linear.weight.detach())
        bias = getattr(linear, "bias", None)
        return cls(w8, scale, None if bias is None else bias.detach(), reduce_group)

    def fuse_norm(self, norm: DeferredRMSNorm) -> None:
        """Apply `norm` to the input first. Kept out of this module's children (object.__setattr__): the
        norm stays registered in its block, where its weight loads."""
        object.__setattr__(self, "input_norm", norm)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    # The engine's blocks hand this layer their residual (engine/linear.py project_add): the decode GEMV
    # adds it in its epilogue, one kernel fewer per projection than `linear(x) + residual`.
    adds_residual = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W.T (+ bias) (+ residual: added after the row-parallel sum, as `linear(x) + residual`)."""
        if (self.input_norm is not None or self.input_act is not None) and use_fused_quant(x):
            return self.finish(self.fused_forward(x), residual)
        if self.reduce_group is None:
            return fp8_linear(self.transform_input(x), self.weight, self.weight_scale, self.bias, residual=residual)
        return self.finish(fp8_linear(self.transform_input(x), self.weight, self.weight_scale), residual)

    # engine/linear.py project_heads hands this layer attention's output in the heads' layout (wo).
    reads_heads = True

    def forward_heads(self, o: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """This layer on attention's output o [B, H, L, D] read as rows [B, L, H * D] (+ residual). Prefill-
        sized CUDA inputs are quantized straight from the heads' layout (kernels/activation.py
        quantize_heads), without the transposing copy first; the rest take forward on that copy."""
        B, H, L, D = o.shape
        if self.input_norm is None and self.input_act is None and use_fused_quant(o, H * D):
            x8, sx = quantize_heads(o)
            y = scaled_mm(x8, sx, self.weight, self.weight_scale, self.local_bias, o.dtype)
            return self.finish(y.view(B, L, self.out_features), residual)
        return self(o.transpose(1, 2).reshape(B, L, H * D), residual)

    @property
    def local_bias(self) -> torch.Tensor | None:
        """The bias to add to this rank's product: all of it, unless row-parallel (added after the sum)."""
        return self.bias if self.reduce_group is None else None

    def finish(self, y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """This rank's product with local_bias -> the layer's output: the row-parallel sum and bias, + residual."""
        if self.reduce_group is not None:
            dist.all_reduce(y, group=self.reduce_group)
            if self.bias is not None:
                y = y + self.bias
        return y if residual is None else y + residual

    def transform_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input transform as torch ops / the decode kernels (what the block computed before the move)."""
        if self.input_norm is not None:
            return self.input_norm.normalize(x)
        if self.input_act == "silu_mul":
            return silu_mul(x)
        return x

    def fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill: one kernel transforms and quantizes the input rows, then the FP8 GEMM (+ local_bias)."""
        if self.input_norm is not None:
            x8, sx = rms_norm_quant(x, self.input_norm.weight, self.input_norm.eps)
        else:
            x8, sx = silu_mul_quant(x)
        y = scaled_mm(x8, sx, self.weight, self.weight_scale, self.local_bias, x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fused = ", input=rms_norm" if self.input_norm is not None else f", input={self.input_act}" if self.input_act else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, e4m3, "
                f"row_parallel={self.reduce_group is not None}{fused}")


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


def fuse_inputs(model: nn.Module) -> nn.Module:
    """After quantize_linears: in every decoder layer move attention_norm into attention.wqkv and, in a
    dense layer, ffn_norm into feed_forward.w13 and the silu-mul into feed_forward.w2 (module docstring).
    In place; the model computes what it did before (same numbers on the CPU); calling it again changes
    nothing; works on a meta-device model too (the norm weights load where they were).
    Tensor parallelism: wqkv and w13 are column-parallel and read the replicated hidden state, so the
    full norm weight is right on every rank; w2 reads this rank's [gate | up] columns of w13's output,
    and the silu-mul is elementwise."""
    for block in model.layers:
        _fuse_block_inputs(block)
    return model


def _fuse_block_inputs(block: nn.Module) -> None:
    att, ff = block.attention, block.feed_forward
    if isinstance(att.wqkv, Fp8Linear) and type(block.attention_norm) is RMSNorm:
        block.attention_norm = DeferredRMSNorm.of(block.attention_norm)
        att.wqkv.fuse_norm(block.attention_norm)
    if not isinstance(ff, FeedForward):  # MoE: the router and the bf16 experts read ffn_norm's output
        return
    if isinstance(ff.w13, Fp8Linear) and type(block.ffn_norm) is RMSNorm:
        block.ffn_norm = DeferredRMSNorm.of(block.ffn_norm)
        ff.w13.fuse_norm(block.ffn_norm)
    if isinstance(ff.w2, Fp8Linear) and ff.w2.input_act is None and type(ff.act) is SiluMul:  # GeGLU stays
        ff.act = nn.Identity()
        ff.w2.input_act = "silu_mul"


class Fp8GroupedExperts(GroupedExperts):
    """An MoE layer's stacked experts in e4m3 (--fp8 experts): `w13` [E, 2F, H] and `w2` [E, H, F] e4m3
    buffers with one float32 scale per expert row, `w13_scale` [E, 2F] and `w2_scale` [E, H] (amax of the
    row / 448, as quantize_rows). Under tensor parallelism each rank quantizes its own shard (w2's rows
    then scale this rank's part of the width; the partial outputs are summed as before). The decode
    kernels (kernels/moe_decode.py) read the e4m3 rows and scale each row's float32 sum; prefill runs FP8
    grouped GEMMs, the CPU a reference on the dequantized weights (engine/moe.py grouped_experts)."""

    def __init__(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor):
        nn.Module.__init__(self)
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", w13_scale)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_scale", w2_scale)

    @classmethod
    def quantize(cls, experts: GroupedExperts) -> Fp8GroupedExperts:
        w13, s13 = quantize_rows(experts.w13.detach())
        w2, s2 = quantize_rows(experts.w2.detach())
        return cls(w13, s13, w2, s2)

    def extra_repr(self) -> str:
        E, F2, H = self.w13.shape
        return f"experts={E}, width={F2 // 2}, hidden={H}, e4m3 with row scales"


def quantize_experts(model: nn.Module) -> int:
    """Swap every MoE layer's GroupedExperts for Fp8GroupedExperts (in place; frees the 16-bit expert
    weights); returns how many layers it swapped (0: no MoE layer here; calling it again swaps none)."""
    swapped = 0
    for block in model.layers:
        ff = block.feed_forward
        if isinstance(ff, MoEFeedForward) and not isinstance(ff.experts, Fp8GroupedExperts):
            ff.experts = Fp8GroupedExperts.quantize(ff.experts)
            swapped += 1
    return swapped
