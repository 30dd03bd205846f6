"""Tensor x pipeline parallel runs: each rank builds only its own part of the model and runs it.

    plan = plan_parallel(cfg, parallel, source)      # layout checks, before any collective
    topo = init_topology(parallel, device)
    model = build_rank_model(cfg, source, plan, topo, dtype)
    runner = ParallelRunner(model, topo)             # same new_cache / prefill / next_token as LocalRunner

A rank's weights come from the converter's shard for its (tp, pp) coordinates, or are sliced in
memory from a Hugging Face dir, a .gguf, the embedded default, or random weights (`plan_shard`).
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from starshard.checkpoints.hf import TPLayout, check_tp, plan_shard
from starshard.config import ModelConfig, ParallelConfig, SamplingConfig
from starshard.engine.generate import LocalRunner, Prompt
from starshard.engine.kv_cache import KVCache
from starshard.engine.model import Transformer
from starshard.engine.sampling import sample
from starshard.parallel.pipeline import StageLink, partition_layers, run_stage
from starshard.parallel.tensor import VocabShard, apply_tensor_parallel, gather_logits, vocab_parallel_sample
from starshard.parallel.topology import LayoutError, Topology


# ---------------------------------------------------------------------------- weight sources
@dataclass(frozen=True)
class WeightSource:
    """Where the weights come from. kind: starshard | default | hf | gguf | random."""

    kind: str
    path: Path | None = None
    seed: int = 0  # random weights only


def weight_source(path: str | Path | None, *, is_default: bool = False, random_seed: int | None = None) -> WeightSource:
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
    from starshard.checkpoints.convert import MANIFEST

    if (path / MANIFEST).is_file():
        return WeightSource("default" if is_default else "starshard", path)
    return WeightSource("hf", path)


def read_config(src: WeightSource, random_config: ModelConfig | None = None) -> ModelConfig:
    """The model config alone (cheap), so the layout can be checked before any weights or collectives."""
    if src.kind == "random":
        return random_config
    if src.kind in ("starshard", "default"):
        from starshard.checkpoints.load import read_manifest

        return ModelConfig.from_dict(read_manifest(src.path)["model_config"])
    if src.kind == "hf":
        from starshard.checkpoints.hf import read_hf_config

        return ModelConfig.from_hf(read_hf_config(src.path))
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(src.path.parent, gguf_file=src.path.name).to_dict())


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
        if name.endswith("norm.weight"):
            return (c.hidden_size,)
        proj, kind = tail[-2], tail[-1]
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
        if name.endswith("norm.weight"):
            return t.fill_(1.0)
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}:{name}".encode()).digest()[:7], "little")
        return t.normal_(0.0, 0.02, generator=torch.Generator(device=self.device).manual_seed(seed))


class StarshardAsHF:
    """A tp=1 starshard checkpoint read under HF tensor names, rows read lazily (safetensors slices):
    lets a parallel run slice the embedded default in memory instead of needing a new conversion."""

    def __init__(self, ckpt: Path, manifest: dict):
        from safetensors import safe_open

        if manifest["tp"] != 1:
            raise LayoutError(f"{ckpt} is split for tp={manifest['tp']}; only tp=1 checkpoints can be re-sliced "
                              "in memory")
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
        q, kv, f = c.q_size, c.kv_size, c.intermediate_size
        table = {
            "input_layernorm": ("attention_norm", None), "post_attention_layernorm": ("ffn_norm", None),
            "self_attn.q_proj": ("attention.wqkv", slice(0, q)),
            "self_attn.k_proj": ("attention.wqkv", slice(q, q + kv)),
            "self_attn.v_proj": ("attention.wqkv", slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj": ("attention.wo", None),
            "mlp.gate_proj": ("feed_forward.w13", slice(0, f)), "mlp.up_proj": ("feed_forward.w13", slice(f, 2 * f)),
            "mlp.down_proj": ("feed_forward.w2", None),
        }
        ours, rows = table[part]
        return f"{o}{ours}.{kind}", rows, 0

    def has(self, name: str) -> bool:
        return self._where(name)[0] in self.handles

    def get(self, name: str) -> torch.Tensor:
        key, rows, _ = self._where(name)
        if key not in self.handles:
            raise KeyError(f"tensor {name!r} ({key}) missing from the checkpoint")
        if rows is None:
            return self.handles[key].get_tensor(key)
        return self.handles[key].get_slice(key)[rows.start : rows.stop]


# ---------------------------------------------------------------------------- layout plan
@dataclass(frozen=True)
class ParallelPlan:
    cfg: ModelConfig
    tp: int
    pp: int
    stages: list[list[int]]  # global layer ids per pipeline stage


def plan_parallel(cfg: ModelConfig, parallel: ParallelConfig, src: WeightSource) -> ParallelPlan:
    """Every check that needs only the config and the manifest: run before any collective."""
    try:
        check_tp(cfg, parallel.tp)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    try:
        stages = partition_layers(cfg.num_layers, parallel.pp, parallel.pp_layers)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    if src.kind == "starshard":
        from starshard.checkpoints.load import check_layout, read_manifest

        manifest = read_manifest(src.path)
        check_layout(manifest, src.path, parallel.tp, parallel.pp)
        held = manifest.get("pp_layers")
        if held is not None and held != [len(s) for s in stages]:
            from starshard.checkpoints.load import CheckpointError

            raise CheckpointError(
                f"checkpoint {src.path} splits the layers over stages as {held}, this run as {[len(s) for s in stages]}; "
                f"run with --pp-layers {','.join(map(str, held))} or convert again with the wanted --pp-layers"
            )
    check_context_heads(cfg, parallel)
    return ParallelPlan(cfg, parallel.tp, parallel.pp, stages)


def check_context_heads(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """Ulysses / USP split each tensor-parallel rank's heads over their all-to-all group: refuse a
    head count that does not split, from the config alone (before any collective)."""
    degree = {"ulysses": parallel.cp, "usp": parallel.ulysses_degree or parallel.cp}.get(parallel.cp_strategy)
    if degree is None or degree == 1:
        return
    from starshard.parallel.context.ulysses import check_ulysses_heads

    layout = TPLayout(cfg, parallel.tp, 0)
    try:
        check_ulysses_heads(layout.heads, layout.kv_heads, degree)
    except ValueError as e:
        raise LayoutError(str(e)) from None


# ---------------------------------------------------------------------------- this rank's model
def rank_state(src: WeightSource, cfg: ModelConfig, layout: TPLayout, layers: list[int], first: bool, last: bool,
               pp_rank: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The tensors of one (tp rank, stage) under starshard names (global layer ids)."""
    if src.kind == "starshard":
        from starshard.checkpoints.load import load_shard, read_manifest

        return load_shard(src.path, read_manifest(src.path), layout.rank, pp_rank)
    if src.kind == "random":
        tsrc = RandomSource(cfg, src.seed, dtype, device)
    elif src.kind == "default":
        from starshard.checkpoints.load import read_manifest

        tsrc = StarshardAsHF(src.path, read_manifest(src.path))
    elif src.kind == "hf":
        from starshard.checkpoints.hf import SafetensorsSource

        tsrc = SafetensorsSource(src.path)
    else:  # gguf: transformers dequantizes the whole file; each rank keeps only its slices
        from starshard.checkpoints.convert import _gguf_to_hf
        from starshard.checkpoints.hf import StateDictSource

        tsrc = StateDictSource(_gguf_to_hf(src.path)[1])
    # Each tensor is read (or generated) and sliced one at a time: peak memory is one full tensor.
    specs = plan_shard(cfg, tsrc, layout, layers, first, last)
    return {s.name: s.build().to(device=device, dtype=dtype) for s in specs}


def build_rank_model(cfg: ModelConfig, src: WeightSource, plan: ParallelPlan, tp_rank: int, pp_rank: int,
                     tp_group, dtype: torch.dtype, device) -> Transformer:
    """This rank's stage of the model with this rank's tensor-parallel part of each weight."""
    from starshard.checkpoints.load import materialize

    layers = plan.stages[pp_rank]
    first, last = pp_rank == 0, pp_rank == plan.pp - 1
    layout = TPLayout(cfg, plan.tp, tp_rank)
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg, num_layers=len(layers))).to(dtype)
    model.config = cfg  # the whole model's config: eos ids, window, vocab
    model.layer_ids = list(layers)
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm, model.output = None, None
    if plan.tp > 1:
        with torch.device("meta"):
            apply_tensor_parallel(model, layout, tp_group)
    local = {g: i for i, g in enumerate(layers)}
    state = {}
    for name, t in rank_state(src, cfg, layout, layers, first, last, pp_rank, dtype, device).items():
        if name.startswith("layers."):
            _, g, rest = name.split(".", 2)
            name = f"layers.{local[int(g)]}.{rest}"
        state[name] = t
    return materialize(model, state, dtype, device)


# ---------------------------------------------------------------------------- runner
class VocabSampler:
    """Next token from this rank's vocab shard of the last-row logits: plain sampling on one rank,
    vocab-parallel argmax / sampling over the TP group (no full logits gathered), the same token on
    every TP rank."""

    def __init__(self, model: Transformer, topo: Topology):
        self.tp = topo.tp
        self.vocab = VocabShard.of(TPLayout(model.config, topo.tp, topo.tp_rank), topo.tp_group)
        self._gen = None
        if topo.tp > 1:  # unseeded sampling still needs one noise stream shared by the TP group
            seed = torch.randint(0, 2**62, (1,), device=topo.device)
            dist.broadcast(seed, src=topo.tp_ranks[0], group=topo.tp_group)
            self._gen = torch.Generator(device=topo.device).manual_seed(int(seed))

    def __call__(self, local: torch.Tensor, sampling: SamplingConfig, gen) -> torch.Tensor:
        if self.tp == 1:
            return sample(local, sampling, gen)  # same draws as one process
        return vocab_parallel_sample(local, self.vocab, sampling, gen if gen is not None else self._gen)


class ParallelRunner(LocalRunner):
    """Runs this rank's part of a tp x pp model; every rank calls the same methods in lockstep and
    gets the same tokens back (LocalRunner's interface, so LLM's generation loop is unchanged).

    Prefill with pp > 1 is cut into chunks (default: about four per stage, at least
    `min_chunk` tokens) so the stages overlap; `chunk` overrides it.
    """

    def __init__(self, model: Transformer, topo: Topology, *, min_chunk: int = 512):
        super().__init__(model)
        self.topo = topo
        self.min_chunk = min_chunk
        self.link = StageLink(topo.pp_group, topo.pp_ranks, topo.pp_rank) if topo.pp > 1 else None
        self.is_last = topo.is_last_stage
        self.sampler = VocabSampler(model, topo)
        self.vocab = self.sampler.vocab

    def default_chunk(self, length: int) -> int | None:
        if self.topo.pp == 1:
            return None
        # ~4 chunks per stage: the pipeline fill/drain bubble is then about 1/5 of the prefill.
        return max(self.min_chunk, -(-length // (4 * self.topo.pp)))

    def _run(self, ids: torch.Tensor, cache: KVCache, chunk: int | None, last_only: bool):
        return run_stage(self.model, ids, cache, self.link, chunk, last_only)

    def prefill(self, prompt: Prompt, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None):
        ids = torch.tensor([prompt.ids], device=cache.device)
        return self.next_token(ids, cache, sampling, gen, chunk or self.default_chunk(ids.shape[1]))

    def next_token(self, ids, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None):
        """Run `ids` [B, L] through the pipeline -> next token [B], the same on every rank.
        Without pipeline stages a one-token step replays a CUDA graph (the tensor-parallel
        all-reduces captured inside; every tp rank's cache grows alike, so they agree on when)."""
        graph = self._graph_decoder(ids, cache) if self.link is None else None
        out = graph.step(ids) if graph is not None else self._run(ids, cache, chunk, last_only=True)
        if self.is_last:
            tok = self.sampler(out[:, -1], sampling, gen)
        else:
            tok = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
        return self.link.broadcast_from_last(tok) if self.link is not None else tok

    def logits(self, ids: torch.Tensor, cache: KVCache, chunk: int | None = None, last_only: bool = True):
        """Full logits [B, L or 1, V] on the last stage (None elsewhere): gathers the vocab shards,
        for tests and debugging; generation never does."""
        out = self._run(ids, cache, chunk, last_only)
        if not self.is_last:
            return None
        return gather_logits(out, self.vocab)
