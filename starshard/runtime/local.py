"""The runner for a whole model in one process (no process group): prefill, then one token a step,
single-token steps replayed from a CUDA graph on a GPU."""
from __future__ import annotations

import torch

from starshard.config import SamplingConfig
from starshard.engine.kv_cache import KVCache
from starshard.engine.sampling import sample
from starshard.parallel.pipeline import chunk_bounds
from starshard.planner import trimmed_step
from starshard.runtime.cuda_graph import GraphDecoder
from starshard.runtime.prompt import Prompt


class LocalRunner:
    """Runs a whole model in this process. The model-parallel and context-parallel runners (this package)
    offer the same methods, so the generation loop (runtime/generate.py) is written once for every layout."""

    def __init__(self, model, cuda_graphs: bool = True, kv_fp8: bool = False):
        self.model = model
        self.cuda_graphs = cuda_graphs  # replay single-token decode steps from a CUDA graph (cuda_graph.py)
        self.kv_fp8 = kv_fp8  # new caches store e4m3 keys / values with per-(head, token) scales (--fp8 kv)
        model.smooth_keys(kv_fp8)  # e4m3 keys lose a k bias's constant part first (engine/model.py key_offset)
        self._graph = None

    def cache_rows(self, tokens: int, prompt_len: int | None = None, context_len: int | None = None,
                   chunk: int | None = None, knee: int | None = None) -> int:
        """KV rows this process allocates for a sequence of `tokens` (all of them, on one process);
        `prompt_len` / `context_len`: the prompt it starts with, where known (a CP rank's shard);
        `chunk` / `knee`: its prefill's steps (prefill_bounds), which lay out a CP rank's shard."""
        return tokens

    def new_cache(self, capacity: int, prompt_len: int | None = None, context_len: int | None = None,
                  chunk: int | None = None, knee: int | None = None, trim_local: bool = False) -> KVCache:
        """A cache for `capacity` tokens; given the prompt (its length and document part), a CP rank
        allocates exactly its shard plus, on the query rank, the rest of `capacity` for decode.
        trim_local: each local layer keeps only its last window - 1 keys plus one forward's rows
        (engine/kv_cache.py), sized by the prefill's steps (the prompt and `chunk` / `knee`; without the
        prompt, for one-token steps after a first block: a larger later block grows the layer); for a
        caller that reads the cache only through this runner's prefill and decode (generate_tokens).
        Where trims_local() is False the cache keeps every key."""
        m = self.model
        norm = m.layers[0].attention_norm.weight  # the compute dtype and device (wo may hold FP8 weights)
        rows = self.cache_rows(capacity, prompt_len, context_len, chunk, knee)
        windows, step = {}, 1
        if trim_local and self.trims_local():
            # the attention's own window now (run_without_windows drops it: such a layer keeps every key)
            windows = {i: layer.attention.extras["window"] for i, layer in zip(m.layer_ids, m.layers)
                       if "window" in layer.attention.extras}
            if prompt_len is not None:
                step = trimmed_step(self.prefill_bounds(prompt_len, prompt_len, chunk, knee))
        return KVCache(m.layer_ids, 1, m.layers[0].attention.n_kv_heads, m.config.head_dim, rows,
                       norm.dtype, norm.device, fp8=self.kv_fp8, windows=windows, step=step)

    def trims_local(self) -> bool:
        """This runner's prefill and decode can run on a trimmed cache: the model's own attention
        (dense_attend and the graph decoder) over this process's cache. The context-parallel runner and a
        pipeline say no (ContextParallelRunner / ParallelRunner.trims_local)."""
        return not self.model.hooked

    def prefill(self, prompt: Prompt, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None,
                knee: int | None = None):
        """Run the whole prompt, `chunk` tokens a step (None or 0: one step; tapered after `knee`) -> first
        new token."""
        tok = None
        for start, end in self.prefill_bounds(len(prompt.ids), prompt.context_len, chunk, knee):
            tok = self.prefill_step(prompt, cache, start, end, sampling, gen)
        return tok

    def prefill_bounds(self, prompt_len: int, context_len: int, chunk: int | None,
                       knee: int | None = None) -> list[tuple[int, int]]:
        """The prompt positions [start, end) of each prefill step, in order: `chunk` tokens each,
        counted over the whole prompt (None or 0: the whole prompt in one step), later ones tapered
        after `knee` held tokens (partition.prefill_steps; None: uniform). The service runs them one at
        a time between decode steps; `prefill` runs them back to back."""
        if chunk is not None and chunk < 0:
            raise ValueError(f"--prefill-chunk must be >= 0 tokens (0: the whole prompt), got {chunk}")
        return chunk_bounds(prompt_len, chunk or None, knee)

    def prefill_step(self, prompt: Prompt, cache: KVCache, start: int, end: int, sampling: SamplingConfig, gen):
        """Run prompt tokens [start, end) on a cache that holds [0, start) -> the first new token [1]
        (the same on every rank) when `end` is the prompt's end, else None."""
        ids = prompt.device_ids(cache.device)[None, start:end]
        logits = self.model(ids, cache=cache, last_only=True)
        return sample(logits[:, -1], sampling, gen) if end == len(prompt.ids) else None

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
            self._graph = GraphDecoder(m, cache)  # a new generation: the old graph is released
        return self._graph if self._graph.fits() else None

    def end_generation(self) -> None:
        """Release what a generation held (the CUDA graph keeps its KV cache alive)."""
        self._graph = None

    def decode_is_local(self) -> bool:
        """A decode step is plain attention over this process's whole cache (what GraphDecoder
        captures): the model's own attention, no caller's hooks installed."""
        return not self.model.hooked

    def next_token(self, ids, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None, *,
                   graph: bool = True):
        """Run `ids` (appending their KV to `cache`, `chunk` tokens at a time) -> next token [B]; `graph`:
        a one-token decode step may replay the CUDA graph (a prefill never does)."""
        graph = self._graph_decoder(ids, cache) if graph else None
        if graph is not None:
            return sample(graph.step(ids)[:, -1], sampling, gen)
        chunk = chunk or ids.shape[1]
        for s in range(0, ids.shape[1], chunk):
            logits = self.model(ids[:, s : s + chunk], cache=cache, last_only=True)
        return sample(logits[:, -1], sampling, gen)
