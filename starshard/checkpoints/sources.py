"""Where a model's weights come from, read one tensor at a time under Hugging Face names.

    src = weight_source(path)                 # starshard checkpoint, HF dir, .gguf, or random weights
    cfg = read_config(src)                    # the config alone: layouts are checked before any weights load
    state = rank_state(src, cfg, shard, layers, first, last, pp_rank, dtype, device)

`rank_state` gives the tensors one (tensor-parallel rank, pipeline stage) holds, sliced as they are
read (peak memory about one full tensor). Random weights are one model for every layout: each tensor
is a function of (name, seed) only, so a tp=2 run, a one-process run and a benchmark agree.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from starshard.checkpoints.convert import MANIFEST, gguf_hf_config, gguf_to_hf
from starshard.checkpoints.hf import SafetensorsSource, StateDictSource, plan_shard, read_hf_config
from starshard.checkpoints.load import (
    CheckpointError,
    check_fp8_request,
    load_shard,
    materialize,
    read_manifest,
    stored_fp8,
)
from starshard.config import ModelConfig
from starshard.engine.model import Transformer
from starshard.partition import TPShard


# ---------------------------------------------------------------------------- weight sources
@dataclass(frozen=True)
class WeightSource:
    """Where the weights come from. kind: starshard | default | hf | gguf | random. default: a tp=1
    checkpoint of the cache dir (the embedded model, a converted GGUF), re-sliced in memory for any layout."""

    kind: str
    path: Path | None = None
    seed: int = 0  # random weights only


def weight_source(path: str | Path | None, *, cached: bool = False, random_seed: int | None = None) -> WeightSource:
    if random_seed is not None:
        return WeightSource("random", None, random_seed)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not .gguf; pass a .gguf file, a HF model dir or a starshard "
                             "checkpoint dir")
        return WeightSource("gguf", path)
    if (path / MANIFEST).is_file():
        return WeightSource("default" if cached else "starshard", path)
    return WeightSource("hf", path)


def read_config(src: WeightSource, random_config: ModelConfig | None = None) -> ModelConfig:
    """The model config alone (cheap), so the layout can be checked before any weights or collectives."""
    if src.kind == "random":
        return random_config
    if src.kind in ("starshard", "default"):
        return ModelConfig.from_dict(read_manifest(src.path)["model_config"])
    if src.kind == "hf":
        return ModelConfig.from_hf(read_hf_config(src.path))
    return ModelConfig.from_hf(gguf_hf_config(src.path))  # with the MoE fields transformers' reader leaves out


def check_source_fp8(src: WeightSource, fp8_linear: bool) -> bool:
    """Whether the source stores FP8 projections (a checkpoint converted with --fp8 linear); such a source
    without --fp8 linear is a CheckpointError naming the fix (from the manifest alone: before any collective)."""
    if src.kind not in ("starshard", "default"):
        return False
    manifest = read_manifest(src.path)
    check_fp8_request(manifest, src.path, fp8_linear)
    return "linear" in stored_fp8(manifest)


class RandomSource:
    """Random weights under HF names, each tensor a function of (name, seed) only: every layout
    (tp, pp) slices the same model, so random-weight runs of different layouts agree."""

    def __init__(self, cfg: ModelConfig, seed: int, dtype: torch.dtype, device):
        self.cfg, self.seed, self.dtype, self.device = cfg, seed, dtype, torch.device(device)

    def _shape(self, name: str) -> tuple[int, ...]:
        c = self.cfg
        tail = name.split(".")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, c.hidden_size)
        if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3: per head
            return (c.head_dim,)
        if name.endswith("norm.weight"):
            return (c.hidden_size,)
        # MoE layers: the stacked experts of transformers 5's modules (hf.moe_layer reads these when a
        # source has them) and the router
        if name.endswith("experts.gate_up_proj"):
            return (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size)
        if name.endswith("experts.down_proj"):
            return (c.num_experts, c.hidden_size, c.moe_intermediate_size)
        proj, kind = tail[-2], tail[-1]
        if proj == "gate":
            return (c.num_experts, c.hidden_size)
        out = {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size, "o_proj": c.hidden_size,
               "gate_proj": c.intermediate_size, "up_proj": c.intermediate_size, "down_proj": c.hidden_size}[proj]
        if kind == "bias":
            return (out,)
        inp = {"o_proj": c.q_size, "down_proj": c.intermediate_size}.get(proj, c.hidden_size)
        return (out, inp)

    def has(self, name: str) -> bool:
        return not (name == "lm_head.weight" and self.cfg.tie_word_embeddings)

    def get(self, name: str) -> torch.Tensor:
        t = torch.empty(self._shape(name), dtype=self.dtype, device=self.device)
        if name.endswith("norm.weight"):  # the identity norm: Gemma's scale by 1 + weight
            return t.fill_(0.0 if self.cfg.norm_unit_offset else 1.0)
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{name}".encode()).digest()[:7], "little")
        return t.normal_(0.0, 0.02, generator=torch.Generator(device=self.device).manual_seed(seed))


class StarshardAsHF:
    """A tp=1 starshard checkpoint read under HF tensor names, rows read lazily (safetensors slices):
    lets a parallel run slice the embedded default in memory instead of needing a new conversion."""

    def __init__(self, ckpt: Path, manifest: dict):
        from safetensors import safe_open

        if manifest["tp"] != 1:
            raise CheckpointError(f"{ckpt} is split for tp={manifest['tp']}; only tp=1 checkpoints can be re-sliced "
                              "in memory")
        if stored_fp8(manifest):
            raise CheckpointError(f"{ckpt} stores FP8 projections, which cannot be re-sliced in memory; convert the "
                                  "model for this run's --tp / --pp")
        self.cfg = ModelConfig.from_dict(manifest["model_config"])
        self.handles = {}
        for p in range(manifest["pp"]):
            h = safe_open(str(Path(ckpt) / manifest["shards"][f"tp0-pp{p}"]["file"]), framework="pt")
            for key in h.keys():
                self.handles[key] = h

    def _where(self, name: str) -> tuple[str, slice | None, int]:
        """HF name -> (starshard name, row range or None, dim)."""
        c = self.cfg
        if name == "model.embed_tokens.weight":
            return "tok_embeddings.weight", None, 0
        if name == "lm_head.weight":
            return "output.weight", None, 0
        if name == "model.norm.weight":
            return "norm.weight", None, 0
        _, _, i, *rest = name.split(".")
        part, kind = ".".join(rest[:-1]), rest[-1]
        o = f"layers.{i}."
        # an MoE layer, as hf.moe_layer asks for it: the router, and the experts stacked as starshard stores them
        # (w13 [E, 2F, H] gate rows then up rows, w2 [E, H, F]: transformers' gate_up_proj / down_proj)
        stacked = {"experts.gate_up_proj": "feed_forward.experts.w13", "experts.down_proj": "feed_forward.experts.w2"}
        if ".".join(rest[-2:]) in stacked:
            return o + stacked[".".join(rest[-2:])], None, 0
        if part in ("mlp.gate", "block_sparse_moe.gate"):
            return f"{o}feed_forward.router.{kind}", None, 0
        q, kv, f = c.q_size, c.kv_size, c.intermediate_size
        table = {
            "input_layernorm": ("attention_norm", None), "post_attention_layernorm": ("ffn_norm", None),
            "pre_feedforward_layernorm": ("ffn_norm", None), "post_feedforward_layernorm": ("post_ffn_norm", None),
            "self_attn.q_proj": ("attention.wqkv", slice(0, q)),
            "self_attn.k_proj": ("attention.wqkv", slice(q, q + kv)),
            "self_attn.v_proj": ("attention.wqkv", slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj": ("attention.wo", None),
            "self_attn.q_norm": ("attention.q_norm", None), "self_attn.k_norm": ("attention.k_norm", None),
            "mlp.gate_proj": ("feed_forward.w13", slice(0, f)), "mlp.up_proj": ("feed_forward.w13", slice(f, 2 * f)),
            "mlp.down_proj": ("feed_forward.w2", None),
        }
        if c.sandwich_norms:  # Gemma: post_attention_layernorm follows attention (hf.py plan_shard)
            table["post_attention_layernorm"] = ("post_attention_norm", None)
        ours, rows = table[part]
        return f"{o}{ours}.{kind}", rows, 0

    def has(self, name: str) -> bool:
        try:
            return self._where(name)[0] in self.handles
        except KeyError:  # a name with no starshard counterpart (another family's MoE layout)
            return False

    def get(self, name: str) -> torch.Tensor:
        key, rows, _ = self._where(name)
        if key not in self.handles:
            raise KeyError(f"tensor {name!r} ({key}) missing from the checkpoint")
        if rows is None:
            return self.handles[key].get_tensor(key)
        return self.handles[key].get_slice(key)[rows.start : rows.stop]



# ---------------------------------------------------------------------------- one rank's tensors
def rank_state(src: WeightSource, cfg: ModelConfig, shard: TPShard, layers: list[int], first: bool, last: bool,
               pp_rank: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The tensors of one (tp rank, stage) under starshard names (global layer ids)."""
    if src.kind == "starshard":
        return load_shard(src.path, read_manifest(src.path), shard.rank, pp_rank)
    if src.kind == "random":
        tsrc = RandomSource(cfg, src.seed, dtype, device)
    elif src.kind == "default":
        tsrc = StarshardAsHF(src.path, read_manifest(src.path))
    elif src.kind == "hf":
        tsrc = SafetensorsSource(src.path)
    else:  # gguf: transformers dequantizes the whole file; each rank keeps only its slices
        tsrc = StateDictSource(gguf_to_hf(src.path, tokenizer=False)[1])
    # Each tensor is read (or generated) and sliced one at a time: peak memory is one full tensor.
    specs = plan_shard(cfg, tsrc, shard, layers, first, last)
    return {s.name: s.build().to(device=device, dtype=dtype) for s in specs}


def random_model(cfg: ModelConfig, *, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> Transformer:
    """The whole model with random weights (std 0.02, norms 1; the same tensors as every layout's
    `rank_state` of random weights), for benchmarks and tests: no checkpoint needed."""
    with torch.device("meta"):
        model = Transformer(cfg)
    state = rank_state(WeightSource("random", None, seed), cfg, TPShard(cfg, 1, 0), list(range(cfg.num_layers)),
                       True, True, 0, dtype, device)
    return materialize(model, state, dtype, device)
