"""Tensor parallelism applied to the plain model (engine/model.py), gpt-fast / torchtitan style.

`apply_tensor_parallel` swaps the model's linears for megatron-core's tensor-parallel layers:
fused QKV and gate/up column-parallel (each rank computes its own heads / MLP columns, no
communication), o_proj and down row-parallel (one all-reduce each; an MoE layer's experts are split
the same way, by columns of every expert, with one all-reduce), the embedding vocab-parallel
(one all-reduce) and the LM head column-parallel over the (padded) vocabulary. The logits stay
sharded: greedy decoding and sampling exchange a few numbers per row, never the full vocabulary.

Shapes follow `partition.TPShard`, so a rank's converter shard loads straight in. Inference
only: weights are frozen, megatron-core runs its frozen-weight path (no autograd bookkeeping).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from starshard.partition import TPShard
from starshard.config import SamplingConfig
from starshard.engine.moe import GroupedExperts, MoEFeedForward


def _mp_config(tp: int, dtype: torch.dtype):
    from megatron.core.model_parallel_config import ModelParallelConfig

    # use_cpu_initialization: allocate with torch.empty on the current default device (meta while the
    # model is planned; real weights are assigned from the rank's shard afterwards). Without it
    # megatron-core allocates on torch.cuda.current_device(), which does not exist on CPU.
    return ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=dtype,
                               use_cpu_initialization=True, perform_initialization=False)


def _no_init(_):
    return None


@functools.cache
def _megatron_layers():
    """The layer classes, imported on first use (megatron-core takes seconds to import)."""
    with warnings.catch_warnings():  # megatron-core warns at import that Transformer Engine / Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    class ColumnParallel(ColumnParallelLinear):
        """Column-parallel linear with nn.Linear's call signature (returns the output only)."""

        def forward(self, x):
            return super().forward(x)[0]

    class RowParallel(RowParallelLinear):
        """Row-parallel linear (input already split, output all-reduced) returning the output only."""

        def forward(self, x):
            return super().forward(x)[0]

    return ColumnParallel, RowParallel, VocabParallelEmbedding


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


def apply_tensor_parallel(model: nn.Module, shard: TPShard, group) -> nn.Module:
    """Swap a (meta-device) Transformer's modules for tensor-parallel ones holding this rank's part.

    Run on a model built under `torch.device("meta")`, before its weights are loaded: the new
    modules hold `shard`'s shapes and keep the parameter names (`wqkv.weight`, ...), so the
    rank's shard of `plan_shard` / the converter loads with `load_state_dict`.
    """
    ColumnParallel, RowParallel, VocabEmbedding = _megatron_layers()
    cfg, tp = shard.cfg, shard.tp
    d, H = cfg.head_dim, cfg.hidden_size
    dtype = next(model.parameters()).dtype
    mp = _mp_config(tp, dtype)
    kw = dict(config=mp, init_method=_no_init, tp_group=group)
    # megatron-core sizes a layer by its global width / tp. With KV heads replicated (tp > KV heads)
    # the "global" fused QKV width is this rank's width * tp, not the model's.
    qkv_rows = (shard.heads + 2 * shard.kv_heads) * d
    ffn = cfg.intermediate_size // tp
    for block in model.layers:
        att, ff = block.attention, block.feed_forward
        att.n_heads, att.n_kv_heads = shard.heads, shard.kv_heads
        att.wqkv = ColumnParallel(H, qkv_rows * tp, bias=cfg.qkv_bias, gather_output=False, **kw)
        att.wo = RowParallel(cfg.q_size, H, bias=False, input_is_parallel=True, skip_bias_add=False, **kw)
        if isinstance(ff, MoEFeedForward):
            # Experts are tensor-parallel, not expert-parallel: each expert's width is split like the
            # dense MLP (gate/up rows column-parallel, down columns row-parallel, TPShard.expert_slice),
            # the router replicated, so every rank routes alike and computes its part of every chosen
            # expert; one all-reduce per layer, as the dense MLP. Why: each rank does exactly 1/tp of
            # every token's expert work and reads 1/tp of each active expert's weights whatever the
            # router picks (expert parallelism's load follows routing skew: a decode step's 8 of 128
            # experts land on few ranks), and it needs no all-to-all dispatch / combine of k x tokens.
            # Its cost, narrower expert GEMMs (Qwen3-30B-A3B: 768 / tp columns), matters at large tp
            # (across nodes expert parallelism would win; not built).
            ff.experts = GroupedExperts(cfg.num_experts, H, cfg.moe_intermediate_size // tp)
            ff.combine = functools.partial(_all_reduce, group=group)
            continue
        # w13 local rows are [gate part; up part] (TPShard), which FeedForward's chunk(2) splits.
        ff.w13 = ColumnParallel(H, 2 * ffn * tp, bias=False, gather_output=False, **kw)
        ff.w2 = RowParallel(cfg.intermediate_size, H, bias=False, input_is_parallel=True, skip_bias_add=False, **kw)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabEmbedding(shard.padded_vocab, H, init_method=_no_init, config=mp, tp_group=group)
    if model.output is not None:
        model.output = ColumnParallel(H, shard.padded_vocab, bias=False, gather_output=False, **kw)
    return model


# ---------------------------------------------------------------------------- vocab-parallel logits
@dataclass(frozen=True)
class VocabShard:
    """This rank's columns [start, start + size) of the padded vocabulary; `vocab_size` real tokens."""

    start: int
    size: int
    vocab_size: int
    group: object = None  # None: one rank holds everything

    @classmethod
    def of(cls, shard: TPShard, group) -> "VocabShard":
        s = shard.vocab_slice
        return cls(s.start, s.stop - s.start, shard.cfg.vocab_size, group if shard.tp > 1 else None)

    @property
    def padded_vocab(self) -> int:
        return self.size * self.world

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padding columns (zero weight rows, logit 0) must never win."""
        real = self.vocab_size - self.start
        if real >= self.size:
            return logits
        return logits.index_fill(-1, torch.arange(max(real, 0), self.size, device=logits.device), float("-inf"))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world * n], ranks in group order."""
        if self.group is None:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, op=op, group=self.group)
        return t


def gather_logits(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Full logits [..., vocab_size] from every rank's shard (tests and debugging only)."""
    return shard.all_gather(local)[..., : shard.vocab_size]


def vocab_parallel_argmax(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """argmax over the whole vocabulary of sharded scores [B, n] -> token ids [B], same on every rank.

    Each rank offers its best (score, id); ties go to the lowest id, as torch.argmax does.
    """
    local = shard.mask_padding(local.float())
    val, idx = local.max(-1)
    pair = torch.stack([val.double(), (idx + shard.start).double()], dim=-1)  # [B, 2]; ids exact in float64
    if shard.group is None:
        return pair[:, 1].long()
    every = shard.all_gather(pair[..., None])  # [B, 2, world]
    best = every[:, 0].argmax(-1)  # first maximum = lowest rank = lowest id among equal scores
    return every[:, 1].gather(-1, best[:, None]).squeeze(-1).long()


def _top_p_threshold(x: torch.Tensor, shard: VocabShard, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest probability nucleus sampling keeps [B, 1], local probabilities [B, n]) from
    sharded scores x [B, n].

    Every token of the global nucleus lies in its rank's local prefix (by probability) whose local
    mass stays below top_p, so those prefixes (usually short) are all that is exchanged.
    """
    m = shard.all_reduce(x.max(-1, keepdim=True).values, dist.ReduceOp.MAX)
    z = shard.all_reduce((x - m).exp().sum(-1, keepdim=True))
    probs = (x - m).exp() / z
    sp = probs.sort(-1, descending=True).values
    n = ((sp.cumsum(-1) - sp) < top_p).sum(-1).max().reshape(1)
    n = int(shard.all_reduce(n, dist.ReduceOp.MAX))
    cand = shard.all_gather(sp[:, :n].contiguous()).sort(-1, descending=True).values  # [B, world * n]
    keep = (cand.cumsum(-1) - cand) < top_p  # sample()'s rule: keep while the mass before is short
    return cand.masked_fill(~keep, float("inf")).min(-1, keepdim=True).values, probs


def vocab_parallel_sample(local: torch.Tensor, shard: VocabShard, cfg: SamplingConfig,
                          gen: torch.Generator | None) -> torch.Tensor:
    """Sample token ids [B] from sharded logits [B, n] with greedy / temperature / top-k / top-p.

    Same filtering as engine.sampling.sample; the draw is Gumbel-max (argmax of logits / T plus
    Gumbel noise) so only (score, id) pairs cross ranks. The noise for the whole padded vocabulary
    comes from `gen` on every rank, which must therefore be in the same state on every rank of the
    group; each rank uses its own columns. Same distribution as `sample`, not the same draws.
    """
    if cfg.temperature == 0:
        return vocab_parallel_argmax(local, shard)
    x = shard.mask_padding(local.float()) / cfg.temperature
    if cfg.top_k:
        k = min(cfg.top_k, shard.vocab_size)
        best = shard.all_gather(x.topk(min(k, x.shape[-1]), dim=-1).values)
        kth = best.topk(k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1:
        tau, probs = _top_p_threshold(x, shard, cfg.top_p)
        x = x.masked_fill(probs < tau, float("-inf"))
    noise = torch.empty(x.shape[0], shard.padded_vocab, device=x.device).exponential_(generator=gen)
    gumbel = -noise[:, shard.start : shard.start + shard.size].log()
    return vocab_parallel_argmax(x + gumbel, shard)
