"""LLM: tokenizer + model + KV cache; prefill(context, query) then a decode loop with sampling."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from starshard.config import ParallelConfig, SamplingConfig
from starshard.engine.kv_cache import KVCache
from starshard.engine.sampling import sample


class PromptTooLongError(ValueError):
    pass


@dataclass
class Prompt:
    """Token ids of one request; ids[:context_len] is the context, the rest is the query.
    ids[:head_len] is the chat template's head (system / user header) at the context's front."""

    ids: list[int]
    context_len: int
    head_len: int = 0


@dataclass
class Output:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "length"
    metrics: dict[str, float] = field(default_factory=dict)


def load_tokenizer(path: Path):
    """The model's tokenizer, or None if the checkpoint has none (then prompts must be token ids)."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        if path.is_file():  # .gguf
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def build_prompt(tokenizer, *, prompt=None, context=None, question=None, raw=False) -> Prompt:
    """Token ids for a plain prompt or a context + question pair, chat template applied unless raw.

    The context/query split is found in the rendered text and the two sides are tokenized
    separately, so the split is exact and every strategy sees the same ids.
    """
    if prompt is not None and (context is not None or question is not None):
        raise ValueError("give either prompt or context + question, not both")
    if prompt is None and context is None:
        raise ValueError("give a prompt, or a context and a question")
    if isinstance(prompt, (list, tuple)):  # token ids pass through untouched
        return Prompt(list(prompt), len(prompt))
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer files: pass token ids instead of text")
    context_text = prompt if prompt is not None else context
    query_text = "" if prompt is not None else ("\n\n" + question if question else "")
    content = context_text + query_text
    use_template = not raw and getattr(tokenizer, "chat_template", None)
    text = (
        tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        if use_template
        else content
    )
    start = text.find(content)
    split = start + len(context_text)
    head = tokenizer.encode(text[:split], add_special_tokens=not use_template)
    tail = tokenizer.encode(text[split:], add_special_tokens=False) if split < len(text) else []
    return Prompt(head + tail, len(head), _head_len(tokenizer, text[:start], head, use_template) if use_template else 0)


def _head_len(tokenizer, head_text: str, ids: list[int], use_template) -> int:
    """Tokens of the template head: those of the head text alone that the prompt's ids start with
    (a token merging across the head / context boundary counts as context)."""
    alone = tokenizer.encode(head_text, add_special_tokens=not use_template) if head_text else []
    n = 0
    while n < min(len(alone), len(ids)) and alone[n] == ids[n]:
        n += 1
    return n


class LocalRunner:
    """Runs a whole model in this process. Parallel runners (starshard.parallel) offer the same two
    methods, so the generation loop below is written once for every layout."""

    def __init__(self, model, cuda_graphs: bool = True):
        self.model = model
        self.cuda_graphs = cuda_graphs  # replay single-token decode steps from a CUDA graph (cuda_graph.py)
        self._graph = None

    def new_cache(self, capacity: int) -> KVCache:
        m = self.model
        return KVCache(m.layer_ids, 1, m.layers[0].attention.n_kv_heads, m.config.head_dim, capacity,
                       m.layers[0].attention.wo.weight.dtype, m.layers[0].attention.wo.weight.device)

    def prefill(self, prompt: Prompt, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None):
        """Run the whole prompt -> first new token."""
        ids = torch.tensor([prompt.ids], device=cache.device)
        return self.next_token(ids, cache, sampling, gen, chunk)

    def _graphs_apply(self, ids, cache: KVCache) -> bool:
        """Graphs are on, the cache is on the GPU and this step is one token."""
        return self.cuda_graphs and cache.device.type == "cuda" and ids.shape == (1, 1)

    def _graph_decoder(self, ids, cache: KVCache):
        """The CUDA-graph decoder for this step, or None where a step must run eagerly."""
        m = self.model
        if not self._graphs_apply(ids, cache):
            return None
        if not self.decode_is_local():
            return None
        if self._graph is None or self._graph.cache is not cache:
            from starshard.engine.cuda_graph import GraphDecoder

            self._graph = GraphDecoder(m, cache)  # a new generation: the old graph is released
        return self._graph if self._graph.fits() else None

    def end_generation(self) -> None:
        """Release what a generation held (the CUDA graph keeps its KV cache alive)."""
        self._graph = None

    def decode_is_local(self) -> bool:
        """A decode step is plain attention over this process's whole cache (what GraphDecoder
        captures), not a strategy's hook."""
        from starshard.engine.model import dense_attend

        return all(layer.attention.attend is dense_attend for layer in self.model.layers)

    def next_token(self, ids, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None):
        """Run `ids` (appending their KV to `cache`, `chunk` tokens at a time) -> next token [B]."""
        graph = self._graph_decoder(ids, cache)
        if graph is not None:
            return sample(graph.step(ids)[:, -1], sampling, gen)
        chunk = chunk or ids.shape[1]
        for s in range(0, ids.shape[1], chunk):
            logits = self.model(ids[:, s : s + chunk], cache=cache, last_only=True)
        return sample(logits[:, -1], sampling, gen)


class LLM:
    """One model over this process's ranks. Under torchrun / srun every rank builds an LLM with the
    same arguments and runs generate() in lockstep (rank 0 reports).

    path: starshard checkpoint dir, Hugging Face model dir, .gguf file, or None for the embedded
    default (SmolLM2-135M-Instruct, converted once to the cache dir).
    parallel: the layout. tp / pp > 1 (or a multi-process launch) runs the tensor x pipeline
    parallel runner, each rank holding only its own weights; cp > 1 a context strategy.
    random_weights: a preset name (starshard.presets) or a config.json path: random weights of
    that shape, no checkpoint (benchmarks); prompts must then be token ids. The weights depend only
    on (shape, weights_seed), not on the layout: a tp=2 run and a one-process run agree.
    """

    def __init__(self, path: str | Path | None = None, *, dtype=torch.float32, device="cpu",
                 parallel: ParallelConfig | None = None, progress=True, random_weights: str | None = None,
                 weights_seed: int = 0, sparse=None):
        from starshard.checkpoints.default import default_checkpoint
        from starshard.checkpoints.load import load_model
        from starshard.parallel.context import make_strategy
        from starshard.parallel.topology import init_topology, read_launch_env

        self.parallel = p = parallel or ParallelConfig()
        launch = read_launch_env()
        if random_weights is not None and path is not None:
            raise ValueError("give either a model path or random_weights, not both")
        if sparse is not None and p.cp_strategy in ("ring", "usp"):
            from starshard.kernels.sparse import refuse_sparse
            from starshard.parallel.topology import LayoutError

            try:
                refuse_sparse(sparse, p.cp_strategy)
            except ValueError as e:
                raise LayoutError(str(e)) from None
        tp_pp = p.tp > 1 or p.pp > 1 or (launch.world_size > 1 and p.cp == 1)
        random_cfg = None
        if random_weights is not None:
            from starshard.presets import preset_config

            random_cfg = preset_config(random_weights)
            self.path = None
        else:
            self.path = Path(path) if path is not None else default_checkpoint(progress=progress and launch.rank == 0)
        if tp_pp or random_weights is not None or p.cp > 1:
            from starshard.parallel.runner import (ParallelPlan, check_context_heads, plan_parallel, read_config,
                                                   weight_source)

            src = weight_source(self.path, is_default=path is None,
                                random_seed=weights_seed if random_weights is not None else None)
            cfg = read_config(src, random_cfg)
            # Layout checks need only the config: a bad layout fails here, before any collective.
            if tp_pp:
                plan = plan_parallel(cfg, p, src)
            else:
                check_context_heads(cfg, p)
                plan = ParallelPlan(cfg, 1, 1, [list(range(cfg.num_layers))])
        self.topology = init_topology(p, str(device))
        self.device = self.topology.device
        topo = self.topology
        if tp_pp or random_weights is not None:
            from starshard.parallel.runner import build_rank_model

            model = build_rank_model(cfg, src, plan, topo.tp_rank, topo.pp_rank, topo.tp_group, dtype, self.device)
        else:
            model = load_model(self.path, dtype=dtype, device=self.device)
        heads, kv_heads = model.layers[0].attention.n_heads, model.layers[0].attention.n_kv_heads  # this rank's
        if sparse is not None:  # a kernels.sparse.SparseConfig
            from starshard.kernels.sparse import install_sparse, load_sparse_method

            install_sparse(model, load_sparse_method(sparse), head_offset=topo.tp_rank * heads)
        if p.cp > 1 or p.cp_strategy != "dense":
            from starshard.parallel.context.runner import ContextParallelRunner
            from starshard.parallel.runner import VocabSampler

            from starshard.parallel.context import apb_options

            strategy = make_strategy(p.cp_strategy, topo.cp_group if p.cp > 1 else None,
                                     block_size=p.block_size, anchor_size=p.anchor_size, query_rank=p.query_rank,
                                     ulysses_degree=p.ulysses_degree, cp_groups=topo.group_ranks("cp"),
                                     num_blocks=p.num_blocks, tp_group=topo.tp_group if p.tp > 1 else None,
                                     **apb_options(p))
            if hasattr(strategy, "check_heads"):  # before any prefill collective: every rank raises alike
                from starshard.parallel.topology import LayoutError

                try:
                    strategy.check_heads(heads, kv_heads)
                except ValueError as e:
                    raise LayoutError(str(e)) from None
            link = None
            if p.pp > 1:
                from starshard.parallel.pipeline import StageLink

                link = StageLink(topo.pp_group, topo.pp_ranks, topo.pp_rank)
            self.runner = ContextParallelRunner(model, strategy, VocabSampler(model, topo) if p.tp > 1 else None, link)
        elif tp_pp:
            from starshard.parallel.runner import ParallelRunner

            self.runner = ParallelRunner(model, topo)
        else:
            self.runner = LocalRunner(model)
        self.config = self.runner.model.config
        self.tokenizer = load_tokenizer(self.path) if self.path is not None else None
        eos = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos

    @property
    def model(self):
        return self.runner.model

    def encode(self, prompt=None, *, context=None, question=None, raw=False) -> Prompt:
        return build_prompt(self.tokenizer, prompt=prompt, context=context, question=question, raw=raw)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        window = self.config.max_position_embeddings
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len + max_new_tokens > window:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds the model window of "
                f"{window} tokens; shorten the prompt to at most {window - max_new_tokens} tokens or lower max_new_tokens"
            )
        sw = self.config.sliding_window
        if sw is not None and prompt_len + max_new_tokens > sw:
            raise PromptTooLongError(
                f"sequence of {prompt_len + max_new_tokens} tokens exceeds the model's sliding window of {sw}; "
                "sliding-window attention is not supported, keep prompt + new tokens within the window"
            )

    @torch.inference_mode()
    def generate(
        self,
        prompt: str | list[int] | None = None,
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
    ) -> Output:
        sampling = SamplingConfig(temperature, top_p, top_k, seed)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        p = self.encode(prompt, context=context, question=question, raw=raw)
        self.check_length(len(p.ids), max_new_tokens)
        cache = self.runner.new_cache(len(p.ids) + max_new_tokens)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(seed)

        t0 = time.perf_counter()
        tok = self.runner.prefill(p, cache, sampling, gen, prefill_chunk)
        self._sync()
        t1 = time.perf_counter()
        out: list[int] = []
        finish = "length"
        while len(out) < max_new_tokens:
            t = int(tok)
            out.append(t)
            if t in self.eos_ids:
                finish = "eos"
                break
            if len(out) == max_new_tokens:
                break
            tok = self.runner.next_token(tok.view(1, 1), cache, sampling, gen)
        self._sync()
        t2 = time.perf_counter()
        self.runner.end_generation()  # the cache goes with this call, not with the next one
        decode_steps = max(len(out) - 1, 0)  # the first token comes from the prefill
        kept = [t for t in out if t not in self.eos_ids]
        text = self.tokenizer.decode(kept, skip_special_tokens=True) if self.tokenizer is not None else ""
        metrics = {
            "prompt_tokens": len(p.ids),
            "context_tokens": p.context_len,
            "generated_tokens": len(out),
            "prefill_seconds": t1 - t0,
            "decode_seconds": t2 - t1,
            "decode_tokens_per_second": decode_steps / (t2 - t1) if t2 > t1 and decode_steps else 0.0,
        }
        return Output(text, out, len(p.ids), finish, metrics)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
