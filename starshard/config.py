"""Typed configs: the model (read from a Hugging Face config.json), the parallel layout, one run."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF `architectures` entry -> our family name. The decoder in engine/model.py covers all of them:
# Llama / Mistral / Qwen2 share one layout; Qwen3 adds a per-head RMSNorm of q and k before RoPE;
# Phi-3 fuses qkv_proj and gate_up_proj, which the loader splits into the same fused layout;
# Gemma 2 / 3 (text only) see GEMMA_ARCHS. Sliding windows: _layer_types_from_hf.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gemma2": "gemma2", "gemma3_text": "gemma3"}
# Gemma 2 / 3 (text): RMSNorm scaling by (1 + weight), norms after attention and after the MLP as well as
# before, the embedding scaled by sqrt(hidden), a GeGLU MLP (gelu_pytorch_tanh), tied embeddings,
# query_pre_attn_scalar for the attention scale, local (sliding-window) and global layers; Gemma 2 soft-caps
# attention and final logits, Gemma 3 has q/k norms and a RoPE base of its own for the local layers.
GEMMA_ARCHS = ("gemma2", "gemma3")
# The attention kind of each layer (transformers' config.layer_types): a sliding window of
# config.sliding_window keys, or every earlier key.
LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Mixture-of-experts families (engine/moe.py): Qwen3-MoE (Qwen3's attention, `decoder_sparse_step` /
# `mlp_only_layers` pick the sparse layers, `norm_topk_prob`) and Mixtral (Mistral's attention, every
# layer sparse, top-k weights always renormalized). Neither has shared experts.
MOE_ARCHS = ("qwen3_moe", "mixtral")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# RoPE types whose frequencies depend on the run's length (Transformer.set_rope_length).
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass
class RopeScaling:
    """RoPE frequency scaling, mirroring transformers' `rope_parameters` (modeling_rope_utils.py).

    `type`: default | linear | llama3 | yarn | dynamic | longrope. Every default left open in the
    HF config is resolved by `ModelConfig.from_hf` (factor, original window, attention factor), so the
    engine reads numbers only.
    - linear: inv_freq / factor.
    - llama3: low_freq_factor, high_freq_factor, original_max_position_embeddings (Llama 3.1).
    - yarn: factor, original_max_position_embeddings, beta_fast, beta_slow, truncate; the ramp
      between interpolated and original frequencies; cos / sin scaled by `attention_factor` (from
      mscale / mscale_all_dim when the config does not give it).
    - dynamic (NTK): the base grows with the run's length past `original_max_position_embeddings`
      (HF's max_position_embeddings for this type).
    - longrope (Phi-3): `long_factor` when the run's length exceeds
      `original_max_position_embeddings`, else `short_factor`; cos / sin scaled by `attention_factor`.
    `partial_rotary_factor`: the share of each head's dimensions RoPE rotates (the rest pass).
    """

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn, longrope)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    partial_rotary_factor: float = 1.0

    @property
    def length_dependent(self) -> bool:
        """True when the frequencies depend on the run's length (dynamic, longrope): the runtime must
        tell every rank's model that length (`Transformer.set_rope_length`), and KV computed under one
        length is only valid for runs with the same frequencies."""
        return self.type in LENGTH_DEPENDENT_ROPE


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_hf(hf: dict[str, Any], arch: str, head_dim: int) -> tuple[float, RopeScaling, int]:
    """(rope_theta, RopeScaling, window) from a HF config, resolving defaults as transformers 5 does
    (`standardize_rope_params` and the `_compute_*_parameters` functions). `window` is the longest
    sequence the model runs: HF's max_position_embeddings, extended to factor x original for yarn and
    to factor x max_position_embeddings for dynamic (what the scaling is for; vLLM derives the same)."""
    params = dict(hf.get("rope_parameters") or {})
    src = dict(hf.get("rope_scaling") or params)  # transformers: rope_scaling wins when both are given
    theta = src.get("rope_theta", params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rtype = src.get("rope_type", src.get("type", "default")) if src else "default"
    if arch == "phi3" and rtype in ("su", "yarn"):  # Phi3Config's backward-compatible names for longrope
        rtype = "longrope"
    if rtype not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"unsupported rope scaling type {rtype!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    max_pos = int(hf.get("max_position_embeddings", 8192))
    partial = src.get("partial_rotary_factor", params.get("partial_rotary_factor", hf.get("partial_rotary_factor")))
    rs = RopeScaling(type=rtype, partial_rotary_factor=float(1.0 if partial is None else partial))
    window = max_pos
    if rtype in ("llama3", "yarn", "longrope"):
        # A top-level original_max_position_embeddings (Phi-3 keeps it there; Phi3Config defaults it to
        # 4096) takes priority over the nested one, as in transformers' standardize_rope_params.
        if "original_max_position_embeddings" in hf:
            orig = hf["original_max_position_embeddings"]
        elif arch == "phi3":
            orig = 4096
        else:
            orig = src.get("original_max_position_embeddings", max_pos)
        rs.original_max_position_embeddings = int(orig)
    if rtype in ("linear", "llama3"):
        rs.factor = float(src.get("factor", 1.0))
    elif rtype == "dynamic":
        if src.get("factor") is None:
            raise UnsupportedArchitectureError("rope scaling 'dynamic' needs a `factor` in the config")
        rs.factor = float(src["factor"])
    if rtype == "llama3":
        rs.low_freq_factor = float(src["low_freq_factor"])
        rs.high_freq_factor = float(src["high_freq_factor"])
    elif rtype == "dynamic":
        rs.original_max_position_embeddings = max_pos  # the NTK base grows past HF's max_position_embeddings
        window = max(max_pos, int(rs.factor * max_pos))
    elif rtype == "yarn":
        orig = rs.original_max_position_embeddings
        factor = src.get("factor")
        rs.factor = float(max_pos / orig if factor is None else factor)
        af, mscale, mscale_all = src.get("attention_factor"), src.get("mscale"), src.get("mscale_all_dim")
        if af is None:
            if mscale and mscale_all:
                af = _yarn_mscale(rs.factor, mscale) / _yarn_mscale(rs.factor, mscale_all)
            else:
                af = _yarn_mscale(rs.factor)
        rs.attention_factor = float(af)
        rs.beta_fast = float(src.get("beta_fast") or 32)
        rs.beta_slow = float(src.get("beta_slow") or 1)
        rs.truncate = bool(src.get("truncate", True))
        window = max(max_pos, int(rs.factor * orig))
    elif rtype == "longrope":
        orig = rs.original_max_position_embeddings
        dim = int(head_dim * rs.partial_rotary_factor)
        for key in ("short_factor", "long_factor"):
            vals = src.get(key)
            if not isinstance(vals, list) or len(vals) != (dim + 1) // 2:
                raise UnsupportedArchitectureError(
                    f"longrope needs `{key}` with {(dim + 1) // 2} numbers (one per rotated frequency), got {vals!r}")
            setattr(rs, key, [float(x) for x in vals])
        factor = src.get("factor")
        rs.factor = float(max_pos / orig if factor is None else factor)
        af = src.get("attention_factor")
        if af is None:
            af = 1.0 if rs.factor <= 1.0 else math.sqrt(1 + math.log(rs.factor) / math.log(orig))
        rs.attention_factor = float(af)
    return float(theta), rs, window


def _gemma3_rope_hf(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(a HF config whose RoPE fields are the global layers', the local layers' RoPE base) of Gemma 3.
    transformers 5 writes rope_parameters per layer type ({"full_attention": {...}, "sliding_attention":
    {...}}); older config.json files give rope_theta / rope_scaling (global) and rope_local_base_freq. The
    local layers' RoPE must be plain (default type): anything else is refused."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        out = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
        out["rope_parameters"] = full
    else:
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
        out = dict(hf)
        out.setdefault("rope_theta", 1_000_000.0)
    rtype = local.get("rope_type", local.get("type", "default"))
    if rtype != "default":
        raise UnsupportedArchitectureError(
            f"gemma3 with RoPE scaling {rtype!r} on the sliding-window layers (rope_parameters.sliding_attention) is "
            "not supported; starshard's local layers take a plain RoPE base (rope_local_base_freq)")
    return out, float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))


def _layer_types_from_hf(hf: dict[str, Any], arch: str, num_layers: int,
                         max_len: int) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers 5 runs each family: window None = every layer global.
    Mistral / Mixtral / Phi-3: `sliding_window` on every layer; Qwen2 / Qwen3: with `use_sliding_window`, the
    config's `layer_types` or else layers from `max_window_layers` on; Qwen3-MoE: every layer with
    `use_sliding_window`; Gemma 2: `layer_types` or else every other layer (the first local); Gemma 3:
    `layer_types` or else `sliding_window_pattern` (default 6: five local, then a global one); Llama: none.
    A window of at least `max_len` (the longest sequence the model runs) hides nothing and is dropped
    (Phi-3-128K's 262144), so such a model keeps every path plain attention has. Unknown layer types, or
    a list of the wrong length, are refused naming the field."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if arch == "llama":
        return None, None
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        return None, None
    if window is None:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UnsupportedArchitectureError(f"sliding_window must be a positive integer, got {window!r}")
    if window >= max_len:
        return None, None
    if arch in GEMMA_ARCHS + ("qwen2", "qwen3") and types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise UnsupportedArchitectureError(
                f"layer_types must list one type per layer ({num_layers}), got {types!r}")
        bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if bad:
            raise UnsupportedArchitectureError(
                f"unsupported layer_types {bad} ({arch}); starshard runs {', '.join(LAYER_TYPES)}")
        types = list(types)
    elif arch == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    elif arch == "gemma3":
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        if not isinstance(pattern, int) or pattern < 1:
            raise UnsupportedArchitectureError(f"sliding_window_pattern must be an integer >= 1, got {pattern!r}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif arch in ("qwen2", "qwen3"):
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    else:  # mistral, mixtral, phi3, qwen3_moe: one window on every layer
        types = ["sliding_attention"] * num_layers
    if "sliding_attention" not in types:
        return None, None
    return window, types


def _gemma_from_hf(hf: dict[str, Any], arch: str, head_dim: int) -> dict[str, Any]:
    """ModelConfig's Gemma fields (none for other families)."""
    if arch not in GEMMA_ARCHS:
        return {}
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError(
            f"{arch} with use_bidirectional_attention=True (an encoder) is not supported; starshard's attention "
            "is causal")
    if hf.get("attention_bias", False):
        raise UnsupportedArchitectureError(f"{arch} with attention_bias=True is not supported")
    attn_cap = hf.get("attn_logit_softcapping")
    if arch == "gemma3" and attn_cap is not None:  # transformers 5's Gemma 3 attention never applies it
        raise UnsupportedArchitectureError(
            f"gemma3 with attn_logit_softcapping={attn_cap} is not supported (transformers' Gemma 3 ignores it, so "
            "its meaning is unclear); set it to null")
    scalar = hf.get("query_pre_attn_scalar", 256)
    return dict(norm_unit_offset=True, sandwich_norms=True, embed_scale=float(hf["hidden_size"]) ** 0.5,
                query_pre_attn_scalar=None if scalar is None else float(scalar),
                attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
                final_logit_softcapping=(None if hf.get("final_logit_softcapping") is None
                                         else float(hf["final_logit_softcapping"])))


_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def _moe_from_hf(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's expert fields from a HF config (none for dense families). Qwen3-MoE's config.json
    names the expert count `num_experts` (transformers 5 also writes `num_local_experts`), Mixtral's
    `num_local_experts`; Mixtral's experts are `intermediate_size` wide and always renormalized."""
    if arch not in MOE_ARCHS:
        return {}
    shared = [k for k in _SHARED_EXPERT_KEYS if hf.get(k)]
    if shared:
        raise UnsupportedArchitectureError(
            f"{arch} with shared experts ({shared[0]}={hf[shared[0]]}) is not supported; starshard's MoE layer "
            f"has routed experts only")
    experts = hf.get("num_experts", hf.get("num_local_experts")) or 0
    top_k = hf.get("num_experts_per_tok") or 0
    if arch == "qwen3_moe" and experts == 0:
        return {}  # transformers: every layer dense
    if experts < 1 or not 1 <= top_k <= experts:
        raise UnsupportedArchitectureError(
            f"{arch} needs 1 <= num_experts_per_tok <= experts; config.json has num_experts_per_tok={top_k}, "
            f"experts={experts}")
    if arch == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=hf["intermediate_size"],
                    norm_topk_prob=True)
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise UnsupportedArchitectureError(f"qwen3_moe decoder_sparse_step must be an integer >= 1, got {step!r}")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), decoder_sparse_step=step,
                mlp_only_layers=sorted(int(i) for i in hf.get("mlp_only_layers") or []))


@dataclass
class ModelConfig:
    arch: str  # llama | mistral | qwen2 | qwen3 | phi3 | qwen3_moe | mixtral | gemma2 | gemma3
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
    # The longest sequence the model runs (every window check reads it): HF's max_position_embeddings,
    # extended by yarn (factor x original window) and dynamic (factor x HF's value); see _rope_from_hf.
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (head_dim weights) before RoPE
    # Sliding-window attention: on the layers `layer_types` marks "sliding_attention", a query at position
    # p sees the keys at positions (p - sliding_window, p] (transformers' convention: W keys, itself
    # included); the other layers ("full_attention") every earlier key. None / None: every layer global.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (plain); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    norm_unit_offset: bool = False  # Gemma: every RMSNorm scales by (1 + weight), weights stored as HF has them
    sandwich_norms: bool = False  # Gemma 2 / 3: RMSNorms after attention and after the MLP too
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size) (rounded to the compute dtype)
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) | gelu_pytorch_tanh (GeGLU, Gemma)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (qwen3_moe, mixtral; num_experts 0 = every layer dense). A sparse layer
    # (`is_moe_layer`) routes each token to `num_experts_per_tok` of `num_experts` SwiGLU experts of
    # width `moe_intermediate_size`; the other layers keep the dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1 (Mixtral: always)
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has the expert MLP (transformers' Qwen3-MoE / Mixtral rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of global layer `layer` (None: a global layer, every earlier key)."""
        if self.sliding_window is None or self.layer_types is None:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def attention_extras(self) -> list[str]:
        """The attention features of this model beyond plain causal softmax(q.k / sqrt(head_dim)), by their
        config field: what a path that cannot run them must refuse."""
        out = []
        if self.sliding_window is not None and self.layer_types and "sliding_attention" in self.layer_types:
            out.append("sliding_window")
        if self.attn_logit_softcapping is not None:
            out.append("attn_logit_softcapping")
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar != self.head_dim:
            out.append("query_pre_attn_scalar")
        return out

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def has_dense_layers(self) -> bool:
        return len(self.moe_layers) < self.num_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (all unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.rope_scaling.partial_rotary_factor)

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
        if arch in GEMMA_ARCHS:  # transformers' Gemma reads hidden_activation (old files also carry hidden_act)
            act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        else:
            act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        act = "silu" if act == "swish" else act
        if act not in MLP_ACTIVATIONS or (act != "silu" and arch in MOE_ARCHS):
            raise UnsupportedArchitectureError(
                f"unsupported MLP activation hidden_act={act!r} ({arch}); starshard's MLP is SwiGLU (silu) or, for "
                f"dense models, GeGLU (gelu_pytorch_tanh)")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        local_theta = None
        if arch == "gemma3":
            hf, local_theta = _gemma3_rope_hf(hf)
        theta, scaling, window = _rope_from_hf(hf, arch, head_dim)
        sw, layer_types = _layer_types_from_hf(hf, arch, hf["num_hidden_layers"], window)
        if arch in ("qwen3", "qwen3_moe") and hf.get("attention_bias", False):
            raise UnsupportedArchitectureError(
                f"{arch} with attention_bias=True (an o_proj bias) is not supported; starshard's o_proj has no bias")
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
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
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=window,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA_ARCHS)),
            qkv_bias=(arch == "qwen2") or (arch != "phi3" and bool(hf.get("attention_bias", False))),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            sliding_window=sw,
            layer_types=layer_types,
            local_rope_theta=local_theta,
            hidden_act=act,
            **_gemma_from_hf(hf, arch, head_dim),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_from_hf(hf, arch),
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
        if d.get("sliding_window") is not None and "layer_types" not in d:
            # A manifest from before per-layer windows: its window applied to every layer (which those
            # families do) or to layers it cannot say (Qwen2 / Qwen3's max_window_layers).
            if d["sliding_window"] >= d.get("max_position_embeddings", 8192):
                d["sliding_window"] = None
            elif d["arch"] in ("mistral", "mixtral", "phi3", "qwen3_moe"):
                d["layer_types"] = ["sliding_attention"] * d["num_layers"]
            else:
                raise UnsupportedArchitectureError(
                    f"this {d['arch']} checkpoint was converted before starshard ran sliding windows per layer "
                    f"(sliding_window={d['sliding_window']}, its windowed layers unrecorded); convert it again")
        return cls(**d)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_strategy: str = "dense"  # a name in starshard.strategies.STRATEGIES
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
        # The construction-time guard of the two rules a bare config can break; config sits below the
        # strategies' registry (starshard.strategies.check: the same rules, every strategy's options).
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


FP8_ITEMS = ("linear", "kv", "attention", "experts")
# The decoder projections `--fp8 linear` holds in e4m3 (module names inside a layer): quantized at load
# time (parallel/fp8.py) or stored so by the converter (checkpoints/convert.py --fp8 linear).
FP8_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


# A prefill-sized attention call over an FP8 KV cache on CUDA dequantizes the held keys this many at a
# time into a bounded compute-dtype buffer and runs the fused (cuDNN) kernel on each block, merging by
# lse (kernels/attention.py): cuDNN's speed without a copy of the whole prefix; the planner counts it.
FP8_PREFILL_KEY_BLOCK = 65536


@dataclass(frozen=True)
class Fp8Config:
    """What runs in FP8 (e4m3) on GPUs with FP8 tensor cores (compute capability >= 8.9); all off = bf16.

    linear: the decoder's projections (wqkv, wo, w13, w2) hold e4m3 weights with one scale per output
            channel; activations are scaled per row at run time (parallel/fp8.py, kernels/fp8.py).
    kv:     the KV cache stores e4m3 keys / values with one scale per (KV head, token) (engine/kv_cache.py).
    attention: 8-bit prefill scores (engine/model.py dense_attend_int8_scores, kernels/flash_fp8.py):
            q . k from int8 q (per 128 rows) and int8 keys minus their mean (per 128 keys), P . V in the
            compute dtype, for a prefill block that starts the cache on the dense path, Star's
            [anchor; block] context calls and Ulysses' whole-sequence call after its all-to-all (no sparse);
            on CUDA only calls of at least 96K keys (kernels/attention.py INT8_SCORES_MIN_LENGTH: shorter ones
            measured no faster than cuDNN and keep exact scores).
            e4m3 scores (cuDNN's FP8 kernel, e4m3 versions of ours) are faster still but ~8-10% off
            (docs/results.md, FP8) and are not offered.
    experts: an MoE model's stacked experts hold e4m3 weights with one scale per expert row, quantized at
            load time (parallel/fp8.py Fp8GroupedExperts): decode's expert GEMVs read them as stored; prefill runs
            FP8 grouped GEMMs on inputs quantized per row (engine/moe.py grouped_experts; the CPU: that rounding
            on the weights dequantized to the compute dtype, one layer at a time).
    """

    linear: bool = False
    kv: bool = False
    attention: bool = False
    experts: bool = False

    @classmethod
    def parse(cls, items: "str | list[str] | tuple[str, ...] | Fp8Config | None") -> "Fp8Config":
        """From "linear,kv", ["linear", "kv"], "none" / "" / None (bf16) or an Fp8Config."""
        if isinstance(items, Fp8Config):
            return items
        if items is None:
            return cls()
        parts = items.split(",") if isinstance(items, str) else list(items)
        names = [str(x).strip() for x in parts if str(x).strip()]
        if names == ["none"]:
            return cls()
        bad = [x for x in names if x not in FP8_ITEMS]
        if bad:
            raise ValueError(f"--fp8: unknown item(s) {', '.join(map(repr, bad))}; valid: {', '.join(FP8_ITEMS)} "
                             f"(comma separated, e.g. --fp8 linear,kv), or none for bf16")
        return cls(**{x: True for x in names})

    @property
    def any(self) -> bool:
        return self.linear or self.kv or self.attention or self.experts

    def items(self) -> list[str]:
        return [x for x in FP8_ITEMS if getattr(self, x)]

    def describe(self) -> str:
        return ",".join(self.items()) or "none"


@dataclass
class SamplingConfig:
    """How the next token is drawn, for LLM.generate and for every request the service runs (the
    HTTP layer builds one from the request's fields): invalid values are refused at construction."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    ignore_eos: bool = False  # run to max_tokens past an end-of-sequence token (benchmarks; vLLM's extension)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
