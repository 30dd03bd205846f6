"""Small random Hugging Face models for parity tests (saved as safetensors dirs)."""
from __future__ import annotations

import torch

SMALL = dict(vocab_size=211, hidden_size=48, intermediate_size=72, num_hidden_layers=3, max_position_embeddings=512)


def make_hf_model(arch: str, tmp_path, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    kw = dict(SMALL, num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0)
    if arch == "llama":
        kw.update(tie_word_embeddings=False)
        kw.update(overrides)
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        kw.update(tie_word_embeddings=True)
        kw.update(overrides)
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        kw.update(overrides)
        cfg, cls = transformers.MistralConfig(**kw), transformers.MistralForCausalLM
    elif arch == "qwen3":  # q/k RMSNorm per head; Qwen3Config's head_dim defaults to 128, not hidden / heads
        kw.update(tie_word_embeddings=True)
        kw.update(overrides)
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
        cfg, cls = transformers.Qwen3Config(**kw), transformers.Qwen3ForCausalLM
    elif arch == "phi3":  # fused qkv_proj / gate_up_proj; Phi3Config's token ids default past this vocabulary
        kw.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)
        kw.update(overrides)
        cfg, cls = transformers.Phi3Config(**kw), transformers.Phi3ForCausalLM
    elif arch in ("gemma2", "gemma3"):  # head_dim defaults to 256 there; tied embeddings, GeGLU, (1 + w) norms
        kw.update(head_dim=kw["hidden_size"] // kw["num_attention_heads"], bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
        kw.update(overrides)
        if arch == "gemma2":
            cfg, cls = transformers.Gemma2Config(**kw), transformers.Gemma2ForCausalLM
        else:
            cfg, cls = transformers.Gemma3TextConfig(**kw), transformers.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).eval()
    # Random init leaves biases/norms at 0/1; perturb them so they are actually tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / f"hf-{arch}"
    model.save_pretrained(out, safe_serialization=True)
    return model, out
