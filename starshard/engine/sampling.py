"""Next-token choice from logits: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import torch

from starshard.config import SamplingConfig
from starshard.kernels.argmax import argmax_rows, use_argmax_kernel


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] float -> token ids [B]."""
    if cfg.temperature == 0:
        return argmax_rows(logits) if use_argmax_kernel(logits) else logits.argmax(-1)
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = sorted_p.cumsum(-1) - sorted_p >= cfg.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
