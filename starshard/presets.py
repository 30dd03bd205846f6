"""Model shapes for runs with random weights (`--random-weights NAME` or a config.json path).

Shapes are Hugging Face config dicts, so a preset and a real model's config.json go through the
same `ModelConfig.from_hf`. Random weights need no download: benchmarks of any size run anywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

from starshard.config import ModelConfig

_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)

_GEMMA3 = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, head_dim=256,
    query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0), max_position_embeddings=131072,
    rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
    attn_logit_softcapping=None, tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
)

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=1048576,  # benchmarks run past the 128K window
        rope_scaling=_LLAMA31_ROPE, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=1048576,
        rope_scaling=_LLAMA31_ROPE, bos_token_id=128000, eos_token_id=128001,
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=1048576, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-8b": dict(  # Qwen3-8B with the YaRN x4 scaling Qwen documents for contexts past 32K (window 128K+)
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=1048576, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-30b-a3b": dict(  # Qwen3-30B-A3B: 128 experts of width 768, 8 per token, every layer sparse
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=1048576, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    "mixtral-8x7b": dict(  # Mixtral-8x7B: 8 experts of width 14336, 2 per token
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=1048576,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # Gemma 3 text decoders as google/gemma-3-{4b,12b} publish them (Gemma3TextConfig): window 1024 on five
    # layers of six (sliding_window_pattern 6: every sixth layer global), local RoPE base 10000, global 1e6
    # with linear x8 scaling, 128K positions.
    "gemma-3-4b": dict(_GEMMA3, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                       num_attention_heads=8, num_key_value_heads=4),
    "gemma-3-12b": dict(_GEMMA3, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8),
    "smollm2-135m": dict(  # the embedded default's shape (9 heads, 3 KV heads: tp 1 or 3)
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=1048576, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "tiny": dict(  # CPU smoke runs of the benchmark code paths (tp 1, 2 or 4; pp up to 2)
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20,
    ),
    "tiny-gemma3": dict(  # CPU smoke runs of windows (Gemma 3 layout, window 16, layers 2 and 5 global)
        _GEMMA3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        sliding_window_pattern=3, max_position_embeddings=1 << 20,
    ),
    "tiny-moe": dict(  # CPU smoke runs of the MoE benchmark (Qwen3-MoE layout; tp 1 or 2)
        architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1 << 20,
    ),
}


# The context each real model is published for (its own config's window; Qwen3-8B with the YaRN x4 above). The
# presets allow 1M positions so that benchmarks and plans run past it; answers past it are not the model's.
REAL_CONTEXT: dict[str, int] = {
    "llama-3.1-8b": 131072, "llama-3.1-70b": 131072, "qwen2.5-7b": 32768, "qwen3-8b": 131072,
    "qwen3-30b-a3b": 40960, "mixtral-8x7b": 32768, "smollm2-135m": 8192,
}


def past_real_context(name: str, tokens: int) -> str | None:
    """A warning when `tokens` (prompt + new tokens) run past preset `name`'s real model's context (None: within
    it, or not a preset that has one): the plan and the timings hold, the answers would not be the model's."""
    real = REAL_CONTEXT.get(name)
    if real is None or tokens <= real:
        return None
    return (f"{tokens} tokens (prompt + new tokens) run past {name}'s real context of {real} tokens (the preset allows "
            f"{PRESETS[name]['max_position_embeddings']} for benchmarks and plans): memory and speed hold, "
            "a real model's answers past its context would not")


def preset_config(name_or_path: str) -> ModelConfig:
    """A preset by name, or the shape in a Hugging Face config.json."""
    if name_or_path in PRESETS:
        return ModelConfig.from_hf(PRESETS[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--random-weights {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a config.json file")
    return ModelConfig.from_hf(json.loads(path.read_text()))
