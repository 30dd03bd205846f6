"""Tensor x pipeline parallel runs: each rank runs its part of the model in lockstep with the others.

    model = build_rank_model(...)          # runtime/build.py: this rank's stage and tensor-parallel slices
    runner = ParallelRunner(model, topo)    # LocalRunner's new_cache / prefill / next_token, every rank alike
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from starshard.config import SamplingConfig
from starshard.engine.kv_cache import KVCache
from starshard.engine.model import Transformer
from starshard.engine.sampling import sample
from starshard.partition import TPShard
from starshard.parallel.pipeline import StageLink, run_stage
from starshard.parallel.tensor import VocabShard, gather_logits, vocab_parallel_sample
from starshard.parallel.topology import Topology
from starshard.runtime.local import LocalRunner
from starshard.runtime.prompt import Prompt


class VocabSampler:
    """Next token from this rank's vocab shard of the last-row logits: plain sampling on one rank,
    vocab-parallel argmax / sampling over the TP group (no full logits gathered), the same token on
    every TP rank."""

    def __init__(self, model: Transformer, topo: Topology):
        self.tp = topo.tp
        self.vocab = VocabShard.of(TPShard(model.config, topo.tp, topo.tp_rank), topo.tp_group)
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

    def __init__(self, model: Transformer, topo: Topology, *, min_chunk: int = 512, cuda_graphs: bool = True,
                 kv_fp8: bool = False):
        super().__init__(model, cuda_graphs, kv_fp8)
        self.topo = topo
        self.min_chunk = min_chunk
        self.link = StageLink(topo.pp_group, topo.pp_ranks, topo.pp_rank) if topo.pp > 1 else None
        self.is_last = topo.is_last_stage
        self.sampler = VocabSampler(model, topo)
        self.vocab = self.sampler.vocab

    def trims_local(self) -> bool:
        # tp alone runs LocalRunner's prefill chunks and decode on each rank's heads; a pipeline cuts its own
        # prefill chunks (default_chunk), which new_cache does not size for: every key kept there.
        return self.topo.pp == 1 and super().trims_local()

    def default_chunk(self, length: int) -> int | None:
        if self.topo.pp == 1:
            return None
        # ~4 chunks per stage: the pipeline fill/drain bubble is then about 1/5 of the prefill.
        return max(self.min_chunk, -(-length // (4 * self.topo.pp)))

    def _run(self, ids: torch.Tensor, cache: KVCache, chunk: int | None, last_only: bool):
        return run_stage(self.model, ids, cache, self.link, chunk, last_only)

    def prefill(self, prompt: Prompt, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None):
        ids = prompt.device_ids(cache.device)[None]
        return self.next_token(ids, cache, sampling, gen, chunk or self.default_chunk(ids.shape[1]), graph=False)

    def prefill_step(self, prompt: Prompt, cache: KVCache, start: int, end: int, sampling: SamplingConfig, gen):
        """Run prompt tokens [start, end) through the pipeline -> the first new token on every rank at the
        prompt's end, else None (`prefill` pipelines a whole prompt's chunks in one call instead)."""
        ids = prompt.device_ids(cache.device)[None, start:end]  # uploaded once, not at every step
        out = self._run(ids, cache, None, last_only=True)
        if end < len(prompt.ids):
            return None
        tok = self.sampler(out[:, -1], sampling, gen) if self.is_last else torch.zeros(1, dtype=torch.long,
                                                                                       device=ids.device)
        return self.link.broadcast_from_last(tok) if self.link is not None else tok

    def next_token(self, ids, cache: KVCache, sampling: SamplingConfig, gen, chunk: int | None = None, *,
                   graph: bool = True):
        """Run `ids` [B, L] through the pipeline -> next token [B], the same on every rank.
        Without pipeline stages a one-token step replays a CUDA graph (the tensor-parallel
        all-reduces captured inside; every tp rank's cache grows alike, so they agree on when)."""
        graph = self._graph_decoder(ids, cache) if graph and self.link is None else None
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
