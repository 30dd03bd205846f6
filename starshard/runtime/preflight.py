"""Pre-flight: what a launch learns about the weights from files alone, before any weight loads or any
collective starts (a bad input then fails on every rank alike, with a message, not a hang).

    weights = check_weights(path, fp8_linear=fp8.linear)   # the source, its config, its stored FP8
    plan = plan_memory(weights.config, layout, workload)   # a launcher plans memory from the same config
    llm = LLM(path, ..., weights=weights)                  # and LLM does not read them again
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from starshard.checkpoints.named import resolve_model, shipped_sparse_configs
from starshard.checkpoints.rope import parse_rope_scaling, with_rope_scaling
from starshard.checkpoints.sources import WeightSource, check_source_fp8, read_config, weight_source
from starshard.config import ModelConfig
from starshard.presets import preset_config


@dataclass
class Weights:
    """Where the weights come from. `path` is the checkpoint (None: random weights); `stored_fp8`: its
    projections are stored in e4m3 (converted with --fp8 linear, which then needs --fp8 linear)."""
    path: Path | None
    source: WeightSource
    stored_fp8: bool
    random_config: ModelConfig | None = None  # random weights' shape
    rope_scaling: str | None = None  # the user's switch (checkpoints/rope.py), e.g. "yarn:4"
    sparse_configs: dict[str, Path] = field(default_factory=dict)  # shipped for this model, by method (named.py)

    @cached_property
    def config(self) -> ModelConfig:
        """The model config, read on first use (a one-process load reads it with the weights instead)."""
        return with_rope_scaling(read_config(self.source, self.random_config), self.rope_scaling)


def check_weights(path: str | Path | None, *, random_weights: str | None = None, weights_seed: int = 0,
                  fp8_linear: bool = False, progress: bool = True, rope_scaling: str | None = None) -> Weights:
    """The weights' source for LLM's `path` / `random_weights` (path None: the embedded default model; it, a
    .gguf file and a model by name are converted once into the cache dir, with a progress bar if `progress`;
    rope_scaling: the user's RoPE switch, refused here if malformed). Refuses a missing or unreadable
    checkpoint (FileNotFoundError / ValueError), an unknown random-weights preset (ValueError, config read
    here) and an FP8 checkpoint without `fp8_linear` (CheckpointError naming the fix)."""
    if random_weights is not None and path is not None:
        raise ValueError("give either a model path or random_weights, not both")
    if rope_scaling is not None:
        parse_rope_scaling(rope_scaling)
    if random_weights is not None:
        return Weights(None, weight_source(None, random_seed=weights_seed), False, preset_config(random_weights),
                       rope_scaling)
    ckpt, cached = resolve_model(path, progress=progress)
    src = weight_source(ckpt, cached=cached)
    return Weights(ckpt, src, check_source_fp8(src, fp8_linear), rope_scaling=rope_scaling,
                   sparse_configs=shipped_sparse_configs(ckpt))
