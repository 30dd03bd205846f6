"""Model shapes for benchmarks with random weights (`--random-weights NAME` or a config.json path)."""
from __future__ import annotations

import json
from pathlib import Path

from starshard.config import ModelConfig

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=1048576,  # benchmarks run past the 128K window
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=128001,
    ),
    "tiny": dict(  # CPU smoke runs of the benchmark code paths
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20,
    ),
}


def preset_config(name_or_path: str) -> ModelConfig:
    if name_or_path in PRESETS:
        return ModelConfig.from_hf(PRESETS[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--random-weights {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a config.json file")
    return ModelConfig.from_hf(json.loads(path.read_text()))
