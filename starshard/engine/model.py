"""The decoder, written once for one device: Llama / Mistral / Qwen2.

Parallelism is applied to this model from outside (runtime/build.py and the runners, using
parallel/: tensor-parallel linears swapped in, layers split into pipeline stages, a context
strategy's hook handed to each attention layer); nothing here knows about process groups. Layout kept Megatron-friendly: fused QKV (`wqkv`: q heads, then k
heads, then v heads) and fused gate/up (`w13`: gate rows, then up rows) so that a column-parallel
split of each is one contiguous slice per part.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from starshard.config import ModelConfig
from starshard.engine.kv_cache import KVCache, LayerKV
from starshard.kernels.attention import attention
from starshard.kernels.sparse import pattern_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # fused kernel (float32 accumulation) instead of five elementwise passes
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with linear or Llama-3.1 ("llama3") scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs.type == "linear":
        inv = inv / rs.factor
    elif rs.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, L, D]; cos/sin: [L, D/2] (or [B, L, D/2]) in x's dtype (angles are computed in
    float32 first). Rotate-half convention (HF layout)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class AttendFn(Protocol):
    """The attention a layer runs, provided by a context strategy (dense_attend by default).

    q: [B, Hq, L, D] after RoPE; k, v: this step's new keys / values [B, Hkv, L, D]; pos: their global
    positions; cache: the layer's KV (None when the hook holds its own); sparse: the layer's
    LayerSparse (kernels/sparse.py) or None. The hook decides which keys each query sees and what
    enters the cache; it returns out [B, Hq, L, D].
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 cache: LayerKV | None, sparse=None) -> torch.Tensor: ...


def dense_attend(q, k, v, pos, cache: LayerKV | None, sparse=None):
    """Single-device causal attention over the cache (if any) plus this step's keys; `sparse`: the
    layer's LayerSparse (kernels/sparse.py), used for prefill-sized blocks."""
    if cache is not None:
        k, v, k_pos = cache.append(k, v, pos)
    else:
        k_pos = pos
    # One new token follows everything cached: no mask (saves the mask check in every decode step).
    out, _ = attention(q, k, v, q_pos=pos, k_pos=k_pos, causal=q.shape[2] > 1, sparse=pattern_for(sparse, q))
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Local head counts: tensor parallelism divides them (parallel/tensor.py).
        self.n_heads = cfg.num_heads
        self.n_kv_heads = cfg.num_kv_heads
        self.wqkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.attend: AttendFn = dense_attend
        self.sparse = None  # LayerSparse when a sparse prefill method is on (kernels/sparse.py)

    def forward(self, x, cos, sin, pos, cache: LayerKV | None):
        B, L, _ = x.shape
        d = self.head_dim
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1)
        q = q.view(B, L, self.n_heads, d).transpose(1, 2)
        k = k.view(B, L, self.n_kv_heads, d).transpose(1, 2)
        v = v.view(B, L, self.n_kv_heads, d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, pos, cache, sparse=self.sparse)
        return self.wo(out.transpose(1, 2).reshape(B, L, self.n_heads * d))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, pos, cache: LayerKV | None):
        h = x + self.attention(self.attention_norm(x), cos, sin, pos, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder stack. `layers` may hold a contiguous slice of the model (a pipeline stage):
    `tok_embeddings` is None except on the first stage, `norm`/`output` None except on the last."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.layer_ids = list(range(cfg.num_layers))  # global index of each held layer
        self.norm: nn.Module | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, pos: torch.Tensor):
        freqs = pos.to(self.inv_freq.device).float()[..., None] * self.inv_freq
        return freqs.cos(), freqs.sin()

    def forward(
        self,
        tokens_or_hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        output_row: int | None = None,
    ) -> torch.Tensor:
        """tokens [B, L] (first stage) or hidden [B, L, H] -> logits [B, L, V] (last stage) or hidden.

        positions: global positions [L] of these tokens; default continues the cache (or 0..L-1).
        last_only: the last stage computes logits for the final token only (prefill needs no more);
        output_row: likewise for this one row (a CP shard whose final token is not its last row).
        """
        x = tokens_or_hidden
        L = x.shape[1]
        end = None
        if positions is None:
            start = cache.next_position if cache is not None else 0
            positions = torch.arange(start, start + L, device=x.device)
            end = start + L
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        cos, sin = self.rope(positions)
        cos, sin = cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)
        for i, layer in zip(self.layer_ids, self.layers):
            x = layer(x, cos, sin, positions, cache.layer(i) if cache is not None else None)
        if cache is not None:
            cache.advance(positions, end)
        if (last_only or output_row is not None) and self.output is not None:
            x = x.narrow(1, (-1 if output_row is None else output_row) % L, 1)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x).float()
        return x
