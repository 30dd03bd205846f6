"""Building one rank's model: the layout checks that need only the config (run before any
collective), then this rank's pipeline stage with its tensor-parallel slice of every weight.

    plan = plan_parallel(cfg, parallel, source)      # bad layouts raise LayoutError here
    model = build_rank_model(cfg, source, plan, tp_rank, pp_rank, tp_group, dtype, device)

A checkpoint converted with --fp8 linear loads its e4m3 projections and scales straight into Fp8Linear
modules (swapped in on the meta model); the compute-dtype weights never exist.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from starshard.checkpoints.load import CheckpointError, check_layout, materialize, read_manifest, stored_fp8
from starshard.checkpoints.sources import WeightSource, rank_state
from starshard.config import ModelConfig, ParallelConfig
from starshard.engine.model import Transformer
from starshard.partition import TPShard, check_tp, partition_layers
from starshard.parallel.fp8 import quantize_linears
from starshard.parallel.tensor import apply_tensor_parallel
from starshard.parallel.topology import LayoutError
from starshard.strategies import get_spec, given_options


@dataclass(frozen=True)
class ParallelPlan:
    cfg: ModelConfig
    tp: int
    pp: int
    stages: list[list[int]]  # global layer ids per pipeline stage


def plan_parallel(cfg: ModelConfig, parallel: ParallelConfig, src: WeightSource) -> ParallelPlan:
    """Every check that needs only the config and the manifest: run before any collective."""
    try:
        check_tp(cfg, parallel.tp)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    try:
        stages = partition_layers(cfg.num_layers, parallel.pp, parallel.pp_layers)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    if src.kind == "starshard":
        manifest = read_manifest(src.path)
        check_layout(manifest, src.path, parallel.tp, parallel.pp)
        held = manifest.get("pp_layers")
        if held is not None and held != [len(s) for s in stages]:
            raise CheckpointError(
                f"checkpoint {src.path} splits the layers over stages as {held}, this run as {[len(s) for s in stages]}; "
                f"run with --pp-layers {','.join(map(str, held))} or convert again with the wanted --pp-layers"
            )
    check_context_heads(cfg, parallel)
    return ParallelPlan(cfg, parallel.tp, parallel.pp, stages)


def check_context_heads(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """A strategy that splits each tensor-parallel rank's heads (Ulysses, USP: over their all-to-all
    group) refuses a head count that does not split, from the config alone (before any collective)."""
    shard = TPShard(cfg, parallel.tp, 0)
    try:
        get_spec(parallel.cp_strategy).check_heads(shard.heads, shard.kv_heads, parallel.cp, given_options(parallel))
    except ValueError as e:
        raise LayoutError(str(e)) from None


def build_rank_model(cfg: ModelConfig, src: WeightSource, plan: ParallelPlan, tp_rank: int, pp_rank: int,
                     tp_group, dtype: torch.dtype, device) -> Transformer:
    """This rank's stage of the model with this rank's tensor-parallel part of each weight."""
    layers = plan.stages[pp_rank]
    first, last = pp_rank == 0, pp_rank == plan.pp - 1
    shard = TPShard(cfg, plan.tp, tp_rank)
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg, num_layers=len(layers)), layer_ids=layers).to(dtype)
    model.config = cfg  # the whole model's config: eos ids, window, vocab
    model.layer_ids = list(layers)
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm, model.output = None, None
    if plan.tp > 1:
        with torch.device("meta"):
            apply_tensor_parallel(model, shard, tp_group)
    if src.kind == "starshard" and "linear" in stored_fp8(read_manifest(src.path)):
        # e4m3 weights + scales in the shard: empty Fp8Linear modules (quantizing meta tensors reads nothing)
        quantize_linears(model, tp_group if plan.tp > 1 else None)
    local = {g: i for i, g in enumerate(layers)}
    state = {}
    for name, t in rank_state(src, cfg, shard, layers, first, last, pp_rank, dtype, device).items():
        if name.startswith("layers."):
            _, g, rest = name.split(".", 2)
            name = f"layers.{local[int(g)]}.{rest}"
        state[name] = t
    return materialize(model, state, dtype, device)
