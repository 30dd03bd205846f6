"""Typed configs: the model (read from a Hugging Face config.json), the parallel layout, one run."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF `architectures` entry -> our family name. The decoder in engine/model.py covers all three.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass
class RopeScaling:
    """RoPE frequency scaling. `type` is one of: default, linear, llama3."""

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    arch: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config dict (config.json or PretrainedConfig.to_dict())."""
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _MODEL_TYPES.get(hf.get("model_type", ""))
        if arch is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture: config.json has architectures={archs!r} "
                f"(model_type={hf.get('model_type')!r}); starshard supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        # transformers >= 5 nests theta and scaling under rope_parameters; older configs keep them flat.
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling_src = hf.get("rope_scaling") or rope
        rtype = scaling_src.get("rope_type", scaling_src.get("type", "default")) if scaling_src else "default"
        if rtype not in ("default", "linear", "llama3"):
            raise UnsupportedArchitectureError(
                f"unsupported rope scaling type {rtype!r}; supported: default, linear, llama3"
            )
        scaling = RopeScaling(type=rtype)
        if rtype != "default":
            scaling.factor = float(scaling_src.get("factor", 1.0))
        if rtype == "llama3":
            scaling.low_freq_factor = float(scaling_src["low_freq_factor"])
            scaling.high_freq_factor = float(scaling_src["high_freq_factor"])
            scaling.original_max_position_embeddings = int(scaling_src["original_max_position_embeddings"])
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = hf.get("sliding_window")
        if arch == "qwen2" and not hf.get("use_sliding_window", False):
            window = None
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(arch == "qwen2") or bool(hf.get("attention_bias", False)),
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        return cls(**d)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_strategy: str = "dense"  # dense | ring | ulysses | usp | star | apb
    pp_layers: list[int] | None = None  # layers per pipeline stage; None = even split
    block_size: int | None = None  # star: context block per forward (default ceil(context / cp))
    anchor_size: int | None = None  # star: anchor tokens before each block (default = block size)
    num_blocks: int | None = None  # star: context blocks when no block_size (default cp; cp=1 studies N hosts)
    query_rank: int | None = None  # CP rank that owns the query and generated KV (default: last)
    ulysses_degree: int | None = None  # usp: Ulysses ranks inside each ring rank (default: cp, i.e. Ulysses)
    passing_size: int | None = None  # apb: passing-block entries per KV head and host (default: paper table)
    compressor: str | None = None  # apb: query (default) | retaining-heads | random
    compressor_path: str | None = None  # apb: retaining-heads weights file
    embed_query: bool | None = None  # apb: False ablates the query embedded in the anchors (default True)
    prefix_len: int | None = None  # apb: template head tokens before the embedded query (default: the prompt's)
    apb_hosts: int | None = None  # apb with cp = 1: simulate this many hosts one after another (study mode)
    dp: int | None = None  # data-parallel replicas; None = whatever the world leaves (world / (tp*pp*cp))
    timeout_s: float = 600.0  # every collective gives up (with an error) after this long

    def __post_init__(self):
        if self.cp > 1 and self.cp_strategy == "dense":
            raise ValueError(f"cp={self.cp} needs a context strategy: --cp-strategy ring, ulysses, usp, star or apb")
        if self.ulysses_degree is not None and (self.ulysses_degree < 1 or self.cp % self.ulysses_degree):
            raise ValueError(f"--ulysses-degree {self.ulysses_degree} must divide --cp {self.cp}; valid: "
                             f"{[d for d in range(1, self.cp + 1) if self.cp % d == 0]}")
        if self.pp_layers is not None and len(self.pp_layers) != self.pp:
            raise ValueError(f"--pp-layers {self.pp_layers} gives {len(self.pp_layers)} stages but --pp is {self.pp}; "
                             f"give one layer count per stage")
        if self.timeout_s <= 0:
            raise ValueError(f"the collective timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
