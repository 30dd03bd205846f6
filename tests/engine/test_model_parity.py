"""Logits of our decoder equal transformers' on small random Llama / Qwen2 / Mistral models."""
import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from starshard.checkpoints.load import load_model

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)
CASES = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias-tied": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama3.1-rope-scaling": ("llama", dict(rope_scaling=LLAMA3_SCALING)),
    "linear-rope-scaling": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "odd-heads-no-gqa": ("llama", dict(num_attention_heads=3, num_key_value_heads=3, head_dim=16)),
    "odd-heads-gqa": ("qwen2", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72, tie_word_embeddings=False)),
}


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    arch, overrides = CASES[case]
    hf, path = make_hf_model(arch, tmp_path, **overrides)
    model = load_model(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 67), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-4


def test_cached_steps_match_full_forward(tmp_path):
    """Prefill in chunks plus single-token steps through the KV cache = one full forward."""
    from starshard.runtime.local import LocalRunner

    _, path = make_hf_model("llama", tmp_path)
    model = load_model(path)
    ids = torch.randint(0, 211, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = LocalRunner(model).new_cache(8)  # small capacity: exercises growth
        parts = [model(ids[:, :13], cache=cache), model(ids[:, 13:30], cache=cache)]
        parts += [model(ids[:, i : i + 1], cache=cache) for i in range(30, 40)]
    assert rel_err(torch.cat(parts, dim=1), full) <= 1e-5
    assert cache.length == 40 and cache.next_position == 40
