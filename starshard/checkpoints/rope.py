"""The user's RoPE switch: `--rope-scaling yarn:4` (LLM(..., rope_scaling="yarn:4")) runs a model whose
config declares plain RoPE with YaRN of that factor, its window raised from the config's N positions to
factor x N (Qwen2.5's recipe for 128K: yarn, factor 4, original 32,768). The scaling is the one
transformers computes for such a config (attention factor 0.1 ln(factor) + 1, beta_fast 32, beta_slow 1);
the engine reads it from ModelConfig.rope_scaling as for a model that declares it."""
from __future__ import annotations

import dataclasses
import math

from starshard.config import ModelConfig, RopeScaling, _yarn_mscale

KINDS = ("yarn",)


def parse_rope_scaling(text: str) -> tuple[str, float]:
    """("yarn", factor) from "yarn:FACTOR"; ValueError naming the form otherwise."""
    kind, sep, value = str(text).partition(":")
    try:
        factor = float(value)
    except ValueError:
        factor = math.nan
    if kind not in KINDS or not sep or not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"--rope-scaling {text!r}: give yarn:FACTOR with FACTOR a number > 1, e.g. yarn:4 "
                         "(a 32K model's window becomes 128K)")
    return kind, factor


def with_rope_scaling(cfg: ModelConfig, text: str | None) -> ModelConfig:
    """`cfg` run with the switch (`text` None: as it is). A model whose config already sets RoPE scaling
    is refused (ValueError naming the field) unless that is the same scaling."""
    if text is None:
        return cfg
    kind, factor = parse_rope_scaling(text)
    have = cfg.rope_scaling
    if have.type != "default":
        if have.type == kind and have.factor == factor:
            return cfg  # the config's own scaling: nothing to change
        raise ValueError(
            f"--rope-scaling {text}: this {cfg.arch} model's config already sets RoPE scaling (rope_scaling type "
            f"{have.type!r}, factor {have.factor:g}, window {cfg.max_position_embeddings}); drop --rope-scaling, "
            "or give the model's own setting")
    orig = cfg.max_position_embeddings
    rs = RopeScaling(type=kind, factor=factor, original_max_position_embeddings=orig,
                     attention_factor=_yarn_mscale(factor), partial_rotary_factor=have.partial_rotary_factor)
    return dataclasses.replace(cfg, rope_scaling=rs, max_position_embeddings=int(factor * orig))
