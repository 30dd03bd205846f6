"""Hugging Face -> starshard tensor names, and how each tensor splits over tensor-parallel ranks.

Llama, Mistral, Qwen2 and Qwen3 share one HF naming scheme; Qwen2 adds q/k/v biases, Qwen3 a q/k
RMSNorm per head (`self_attn.q_norm` / `k_norm`, head_dim weights, the same on every TP rank).
Gemma 2 / 3: four norms per layer (`input_layernorm`, `post_attention_layernorm` after attention,
`pre_feedforward_layernorm`, `post_feedforward_layernorm`), Gemma 3 q/k norms too; their weights are kept
as HF stores them (the engine's OffsetRMSNorm scales by 1 + weight; GGUF files, which store 1 + weight,
come through transformers' reader, which subtracts the 1).
Phi-3 fuses `self_attn.qkv_proj` ([q; k; v] rows) and `mlp.gate_up_proj` ([gate; up] rows):
`FusedHFView` reads them under the unfused names, so they are split and re-fused per TP rank like
every other family. Our fused tensors: `wqkv` = [q heads; k heads; v heads] of this TP rank,
`w13` = [gate rows; up rows] of this rank. Qwen3-MoE / Mixtral: `moe_layer` stacks each MoE layer's
experts into `experts.w13` [E, 2f, H] / `experts.w2` [E, H, f], this rank's f columns of every expert.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from starshard.config import ModelConfig
from starshard.partition import TPShard


class TensorSource(Protocol):
    def get(self, name: str) -> torch.Tensor: ...
    def has(self, name: str) -> bool: ...


class SafetensorsSource:
    """Lazily reads tensors from a HF model dir (one or many *.safetensors files, memory-mapped)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            bins = sorted(model_dir.glob("*.bin"))
            hint = " (found PyTorch .bin files: re-save the model with safetensors)" if bins else ""
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}{hint}")
        self._where: dict[str, object] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for key in handle.keys():
                self._where[key] = handle

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} missing from the checkpoint")
        return self._where[name].get_tensor(name)


class StateDictSource:
    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.sd = state_dict

    def has(self, name: str) -> bool:
        return name in self.sd

    def get(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise KeyError(f"tensor {name!r} missing from the checkpoint")
        return self.sd[name]


class FusedHFView:
    """A source with Phi-3's fused `qkv_proj` / `gate_up_proj` read under the unfused HF names
    (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`), each the fused tensor's row range.
    Names the source has as they are pass through (random weights, Llama-layout checkpoints). The last
    fused tensor read is kept, so q, k and v (or gate and up) cost one read of it."""

    def __init__(self, cfg: ModelConfig, src: TensorSource):
        q, kv, f = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.src = src
        # unfused part -> (fused tensor, its rows in the fused one, the fused tensor's row count)
        self.parts = {
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q), q + 2 * kv),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv), q + 2 * kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv), q + 2 * kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, f), 2 * f),
            "mlp.up_proj": ("mlp.gate_up_proj", slice(f, 2 * f), 2 * f),
        }
        self._last: tuple[str, torch.Tensor] | None = None

    def _fused(self, name: str) -> tuple[str, slice, int] | None:
        head, _, kind = name.rpartition(".")
        for part, (fused, rows, total) in self.parts.items():
            if head.endswith("." + part):
                return f"{head[: -len(part)]}{fused}.{kind}", rows, total
        return None

    def has(self, name: str) -> bool:
        if self.src.has(name):
            return True
        where = self._fused(name)
        return where is not None and self.src.has(where[0])

    def get(self, name: str) -> torch.Tensor:
        where = None if self.src.has(name) else self._fused(name)
        if where is None:
            return self.src.get(name)
        fused, rows, total = where
        if self._last is None or self._last[0] != fused:
            self._last = (fused, self.src.get(fused))
        t = self._last[1]
        if t.shape[0] != total:
            raise ValueError(f"{fused} has {t.shape[0]} rows, but the config's heads and MLP width give {total}")
        return t[rows]


def _rows(t: torch.Tensor, s: slice) -> torch.Tensor:
    return t[s]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


@dataclass
class TensorSpec:
    name: str  # starshard name
    shape: tuple[int, ...]
    build: Callable[[], torch.Tensor]  # reads the source and returns this rank's slice
    dtype: torch.dtype | None = None  # as stored; None: the checkpoint's dtype (FP8 weights and scales set theirs)


def plan_shard(
    cfg: ModelConfig, src: TensorSource, shard: TPShard, layers: list[int], first: bool, last: bool
) -> list[TensorSpec]:
    """Every tensor one (tp rank, pipeline stage) holds, in write order, built lazily from `src`."""
    d, H = cfg.head_dim, cfg.hidden_size
    lo = shard
    if cfg.arch == "phi3":
        src = FusedHFView(cfg, src)
    q_rows = slice(lo.rank * lo.heads * d, (lo.rank + 1) * lo.heads * d)
    kv_rows = slice(lo.kv_head_start * d, (lo.kv_head_start + lo.kv_heads) * d)
    specs: list[TensorSpec] = []

    def add(name, shape, build):
        specs.append(TensorSpec(name, tuple(shape), build))

    def vocab_part(hf_name):
        return lambda: _pad_rows(src.get(hf_name), lo.padded_vocab)[lo.vocab_slice]

    vocab_rows = lo.padded_vocab // lo.tp
    if first:
        add("tok_embeddings.weight", (vocab_rows, H), vocab_part("model.embed_tokens.weight"))
    qkv_rows = (lo.heads + 2 * lo.kv_heads) * d
    ffn = cfg.intermediate_size // lo.tp
    for i in layers:
        p, o = f"model.layers.{i}.", f"layers.{i}."

        def qkv(kind, p=p):
            return lambda: torch.cat(
                [
                    _rows(src.get(f"{p}self_attn.q_proj.{kind}"), q_rows),
                    _rows(src.get(f"{p}self_attn.k_proj.{kind}"), kv_rows),
                    _rows(src.get(f"{p}self_attn.v_proj.{kind}"), kv_rows),
                ]
            )

        add(o + "attention_norm.weight", (H,), lambda p=p: src.get(p + "input_layernorm.weight"))
        add(o + "attention.wqkv.weight", (qkv_rows, H), qkv("weight"))
        if cfg.qkv_bias:
            add(o + "attention.wqkv.bias", (qkv_rows,), qkv("bias"))
        if cfg.qk_norm:
            add(o + "attention.q_norm.weight", (d,), lambda p=p: src.get(p + "self_attn.q_norm.weight"))
            add(o + "attention.k_norm.weight", (d,), lambda p=p: src.get(p + "self_attn.k_norm.weight"))
        add(o + "attention.wo.weight", (H, lo.heads * d), lambda p=p: src.get(p + "self_attn.o_proj.weight")[:, q_rows])
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm follows attention; the MLP's own norm before it
            add(o + "post_attention_norm.weight", (H,), lambda p=p: src.get(p + "post_attention_layernorm.weight"))
            add(o + "ffn_norm.weight", (H,), lambda p=p: src.get(p + "pre_feedforward_layernorm.weight"))
            add(o + "post_ffn_norm.weight", (H,), lambda p=p: src.get(p + "post_feedforward_layernorm.weight"))
        else:
            add(o + "ffn_norm.weight", (H,), lambda p=p: src.get(p + "post_attention_layernorm.weight"))
        if cfg.is_moe_layer(i):
            for name, shape, build in moe_layer(cfg, src, lo, p):
                add(o + name, shape, build)
            continue
        add(
            o + "feed_forward.w13.weight",
            (2 * ffn, H),
            lambda p=p: torch.cat(
                [src.get(p + "mlp.gate_proj.weight")[lo.ffn_slice], src.get(p + "mlp.up_proj.weight")[lo.ffn_slice]]
            ),
        )
        add(o + "feed_forward.w2.weight", (H, ffn), lambda p=p: src.get(p + "mlp.down_proj.weight")[:, lo.ffn_slice])
    if last:
        add("norm.weight", (H,), lambda: src.get("model.norm.weight"))
        # Tied models share the embedding; a last stage without the embedding stores its own copy.
        tied_here = cfg.tie_word_embeddings and first
        if not tied_here:
            head = "model.embed_tokens.weight" if cfg.tie_word_embeddings or not src.has("lm_head.weight") else "lm_head.weight"
            add("output.weight", (vocab_rows, H), vocab_part(head))
    return specs


# One MoE layer under HF names: per family, the block's prefix and each expert's (gate, up, down)
# projections, as transformers 5's save_pretrained writes them (one tensor per expert, the original
# names: `mlp.experts.{e}.gate_proj` / `block_sparse_moe.experts.{e}.w1`, ...). Also read: the stacked
# tensors of transformers 5's in-memory modules, `mlp.experts.gate_up_proj` [E, 2F, H] (gate rows,
# then up rows) and `mlp.experts.down_proj` [E, H, F] (a state dict, e.g. a GGUF dequantized by
# transformers; random weights).
EXPERT_NAMES = {
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
}


def moe_layer(cfg: ModelConfig, src: TensorSource, lo: TPShard, p: str) -> list[tuple[str, tuple, Callable]]:
    """(starshard name, shape, build) of one MoE layer's router and this rank's part of its experts:
    every expert, the rank's `expert_slice` of each one's width (gate and up rows, down columns)."""
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    cols = lo.expert_slice
    up_cols = slice(F + cols.start, F + cols.stop)
    block, (gate, up, down) = EXPERT_NAMES[cfg.arch]
    router = next((n for n in (f"{p}{block}gate.weight", f"{p}mlp.gate.weight") if src.has(n)),
                  f"{p}{block}gate.weight")
    stacked_up, stacked_down = f"{p}mlp.experts.gate_up_proj", f"{p}mlp.experts.down_proj"

    def checked(name, shape):
        t = src.get(name)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, but the config's experts give {shape}")
        return t

    def expert(e, proj):
        return src.get(f"{p}{block}experts.{e}.{proj}.weight")

    if src.has(stacked_up):
        def w13():
            t = checked(stacked_up, (E, 2 * F, H))
            return torch.cat([t[:, cols], t[:, up_cols]], dim=1)

        def w2():
            return checked(stacked_down, (E, H, F))[:, :, cols]
    else:
        def w13():
            return torch.stack([torch.cat([expert(e, gate)[cols], expert(e, up)[cols]]) for e in range(E)])

        def w2():
            return torch.stack([expert(e, down)[:, cols] for e in range(E)])
    n = cols.stop - cols.start
    return [("feed_forward.router.weight", (E, H), lambda: src.get(router)),
            ("feed_forward.experts.w13", (E, 2 * n, H), w13),
            ("feed_forward.experts.w2", (E, H, n), w2)]


def merge_tp_shards(cfg: ModelConfig, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of the TP split: full (tp=1) tensors from the shards of every TP rank, in rank order."""
    tp = len(shards)
    lays = [TPShard(cfg, tp, r) for r in range(tp)]
    d = cfg.head_dim
    merged: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if name.endswith(("norm.weight", "router.weight")):  # whole on every rank
            merged[name] = parts[0]
        elif name.endswith("experts.w13"):  # [E, 2f, H] per rank: its gate columns, then its up columns
            gates, ups = zip(*(t.chunk(2, dim=1) for t in parts))
            merged[name] = torch.cat(list(gates) + list(ups), dim=1)
        elif name.endswith("experts.w2"):
            merged[name] = torch.cat(parts, dim=2)
        elif name in ("tok_embeddings.weight", "output.weight"):
            merged[name] = torch.cat(parts)[: cfg.vocab_size]
        elif "wqkv" in name:
            qs, ks, vs, seen = [], [], [], set()
            for lo, t in zip(lays, parts):
                q, k, v = t.split([lo.heads * d, lo.kv_heads * d, lo.kv_heads * d])
                qs.append(q)
                if lo.kv_head_start not in seen:  # replicated KV heads appear once
                    seen.add(lo.kv_head_start)
                    ks.append(k)
                    vs.append(v)
            merged[name] = torch.cat(qs + ks + vs)
        elif name.endswith("wo.weight") or name.endswith("w2.weight"):
            merged[name] = torch.cat(parts, dim=1)
        elif name.endswith("w13.weight"):
            gates, ups = zip(*(t.chunk(2) for t in parts))
            merged[name] = torch.cat(list(gates) + list(ups))
        else:
            raise KeyError(f"don't know how tensor {name!r} is split over tensor-parallel ranks")
    return merged


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    return json.loads(path.read_text())
