"""Runs a model's prefill and decode under a context strategy, on every rank of a CP group.

With pipeline parallelism each rank holds one stage: every forward (a strategy's prefill segment,
the query phase, a decode step) enters at the first stage and its hidden states go stage to stage
(pipeline.StageLink); the strategy's hooks run inside each stage's layers, over that stage's CP
group. The last stage samples; the token is broadcast over its CP group, then down the pipeline.

A chunked prefill (--prefill-chunk, prefill_bounds / prefill_step) runs its first step as the
strategy's own prefill of prompt[0:end] and every later one through parallel/context/chunked.py;
the shards it leaves are laid out step by step, which decode (masking by stored position) ignores."""
from __future__ import annotations

import torch
import torch.distributed as dist

from starshard.config import SamplingConfig
from starshard.engine.kv_cache import KVCache
from starshard.engine.sampling import sample
from starshard.kernels.common import mark_arange, upload
from starshard.parallel.context.base import ContextStrategy
from starshard.parallel.context.chunked import chunk_attend, chunk_owner, chunk_positions, chunk_segment, hidden_rows
from starshard.runtime.cuda_graph import GraphDecoder
from starshard.runtime.local import LocalRunner
from starshard.runtime.prompt import Prompt


class ContextParallelRunner(LocalRunner):
    """`sampler(last_row_logits, sampling, gen) -> token`: plain sampling by default; a
    runtime.model_parallel.VocabSampler when the model is tensor parallel (vocab-sharded logits)."""

    def __init__(self, model, strategy: ContextStrategy, sampler=None, link=None, *, cuda_graphs: bool = True,
                 kv_fp8: bool = False):
        super().__init__(model, cuda_graphs, kv_fp8)
        self.strategy = strategy
        self.sample = sampler or sample
        self.link = link  # pipeline.StageLink when pp > 1
        self.is_last = link is None or link.is_last
        self._eager_rest = False  # the query rank's cache filled up: no graphs until the generation ends
        strategy.bind(model)  # strategies that need the model's RoPE / layer ids (APB)

    def _strategy_attention(self, fn):
        """Every layer of this stage attends through the strategy's `fn` for the forwards inside the block."""
        return self.model.attention_hooks(fn)

    def _broadcast_token(self, tok: torch.Tensor, src_cp_rank: int) -> torch.Tensor:
        """The owner's token on every rank: over the last stage's CP group, then down the pipeline.

A chunked prefill (--prefill-chunk, prefill_bounds / prefill_step) runs its first step as the
strategy's own prefill of prompt[0:end] and every later one through parallel/context/chunked.py;
the shards it leaves are laid out step by step, which decode (masking by stored position) ignores."""
        s = self.strategy
        if s.cp > 1 and self.is_last:
            tok = tok.contiguous()
            dist.broadcast(tok, src=dist.get_global_rank(s.group, src_cp_rank), group=s.group)
        return self.link.broadcast_from_last(tok) if self.link is not None else tok

    def _forward(self, ids: torch.Tensor, **kw):
        """One forward of `ids` [1, n] through this stage (hidden states from / to the neighbours)."""
        m, link = self.model, self.link
        if link is not None and not link.is_first:
            dtype = m.layers[0].attention_norm.weight.dtype
            ids = link.recv_prev((1, ids.shape[1], m.config.hidden_size), dtype, ids.device)
        out = m(ids, **kw)
        if link is not None and not link.is_last:
            link.send_next(out)
            return None
        return out

    def prefill_logits(self, ids: torch.Tensor, context_len: int, cache: KVCache):
        """Run prompt ids [L] sharded over the CP group -> (last-token logits or None, owner CP rank).

        Only the owner's logits are meaningful; for query-phase strategies every rank holds them.
        """
        s = self.strategy
        L = ids.shape[0]
        logits = None
        for seg in s.segments(L, context_len if s.query_phase else L):
            seg = seg.to(ids.device)
            with self._strategy_attention(s.prefill_attend(seg)):
                logits = self._forward(ids[seg.index][None], positions=seg.positions, cache=cache,
                                       output_row=seg.last_row)
        owner = s.last_token_rank(L, context_len)
        if s.query_phase:
            with self._strategy_attention(s.decode_attend):
                logits = self._forward(ids[None, context_len:], cache=cache, last_only=True,
                                       positions=mark_arange(torch.arange(context_len, L, device=ids.device),
                                                             context_len))
            owner = s.query_rank
        if self.link is not None:
            self.link.flush()
        cache.next_position = L  # padding rows may carry positions past the prompt
        return logits, owner

    def prefill_bounds(self, prompt_len: int, context_len: int, chunk: int | None,
                       knee: int | None = None) -> list[tuple[int, int]]:
        """The strategy's steps (StrategySpec.prefill_bounds: Star also cuts at its block ends, APB
        refuses a chunk)."""
        s = self.strategy
        bounds = s.prefill_bounds(prompt_len, context_len, chunk, knee)
        if len(bounds) > 1:
            self._refuse_pipeline()
            if any(getattr(layer.attention, "sparse", None) is not None for layer in self.model.layers):
                raise ValueError(f"--sparse does not compose with --prefill-chunk under --cp-strategy {s.name} (a "
                                 "later chunk's queries attend each rank's stored keys apart, not a row's whole key "
                                 "range); drop one of them")
        return bounds

    def _refuse_pipeline(self) -> None:
        if self.link is not None:
            raise ValueError(f"--prefill-chunk under --cp-strategy {self.strategy.name} does not run with --pp > 1 "
                             "yet (its later chunks are not pipelined over the stages); drop --prefill-chunk or run "
                             "--pp 1")

    def prefill_step(self, prompt: Prompt, cache: KVCache, start: int, end: int, sampling: SamplingConfig,
                     gen) -> torch.Tensor | None:
        """Run prompt tokens [start, end) sharded over the CP group on caches holding [0, start): the
        whole prompt as the strategy prefills it, or one step of prefill_bounds (the first: the
        strategy's own prefill of prompt[0:end], Star's block 0 excepted; later ones:
        parallel/context/chunked.py). Returns the first new token on every rank after the last step."""
        s = self.strategy
        L = len(prompt.ids)
        if not 0 <= start < end <= L:
            raise ValueError(f"a prefill step needs 0 <= start < end <= {L}, got [{start}, {end})")
        ids = prompt.device_ids(cache.device)  # uploaded once, not at every step
        s.use_prompt_head(prompt.head_len)  # APB embeds the query after the chat template's head
        # Approximate strategies need >= 1 query token after the context: borrow the last token.
        context_len = min(prompt.context_len, L - 1)
        if (start, end) == (0, L):
            logits, owner = self.prefill_logits(ids, context_len, cache)
        else:
            self._refuse_pipeline()
            logits, owner = self._prefill_chunk(ids, context_len, cache, start, end)
        if end < L:
            return None
        sampler = self.is_last and self.strategy.rank == owner
        tok = self.sample(logits[:, -1], sampling, gen) if sampler else torch.zeros(1, dtype=torch.long, device=ids.device)
        return self._broadcast_token(tok, owner)

    def _prefill_chunk(self, ids: torch.Tensor, context_len: int, cache: KVCache, start: int, end: int):
        """One step of a chunked prefill -> (logits after the last step, else None; owner CP rank)."""
        s = self.strategy
        L = ids.shape[0]
        logits, owner = None, None
        if s.query_phase:  # Star: the step's context part, then (last step) the question as the query phase
            if context_len < 1:
                raise ValueError(f"--cp-strategy {s.name} needs a non-empty context before the question")
            ctx_end = min(end, context_len)
            if ctx_end > start:
                self._later_step(ids, cache, start, ctx_end, s.chunk_hidden(start, ctx_end, context_len))
            if end == L:
                with self._strategy_attention(s.decode_attend):
                    logits = self._forward(ids[None, context_len:], cache=cache, last_only=True,
                                           positions=mark_arange(torch.arange(context_len, L, device=ids.device),
                                                                 context_len))
                owner = s.query_rank
        elif start == 0:  # the strategy's own prefill of prompt[0:end]
            (seg,) = s.segments(end, end)
            seg = seg.to(ids.device)
            with self._strategy_attention(s.prefill_attend(seg)):
                logits = self._forward(ids[seg.index][None], positions=seg.positions, cache=cache,
                                       output_row=seg.last_row)
            owner = s.last_token_rank(end, end)
        else:
            logits = self._later_step(ids, cache, start, end, None)
            owner = chunk_owner(start, end, s.cp)
        cache.next_position = end  # padding rows carry positions past the step
        return logits, owner

    def _later_step(self, ids: torch.Tensor, cache: KVCache, start: int, end: int, hidden):
        """Prompt positions [start, end) through the generic chunked path (parallel/context/chunked.py)."""
        s = self.strategy
        seg = chunk_segment(start, end, s.cp, s.rank).to(ids.device)
        attend = chunk_attend(seg, s.group if s.cp > 1 else None, upload(chunk_positions(start, end, s.cp), ids.device),
                              hidden_rows(cache, hidden))
        with self._strategy_attention(attend):
            return self._forward(ids[seg.index][None], positions=seg.positions, cache=cache, output_row=seg.last_row)

    def cache_rows(self, tokens: int, prompt_len: int | None = None, context_len: int | None = None,
                   chunk: int | None = None, knee: int | None = None) -> int:
        """Each rank holds its shard, not the sequence. Given the prompt: exactly the rows this rank's
        prefill keeps (StrategySpec.rank_rows), plus the decode tokens (`tokens - prompt_len`) on the
        query rank, the only one that stores them. Without it: 1/cp of the tokens plus room for decode
        (a LayerKV grows, doubling, if a shard needs more)."""
        s = self.strategy
        if prompt_len is None:
            return tokens if s.cp == 1 else -(-tokens // s.cp) + 256
        rows = s.rank_rows(prompt_len, prompt_len if context_len is None else context_len, chunk, knee)[s.rank]
        return max(1, rows + (tokens - prompt_len if s.is_query_rank else 0))

    def trims_local(self) -> bool:
        # A context strategy reads whole shards (the sharded decode, Star / APB's query phase): every key kept.
        return False

    def decode_is_local(self) -> bool:
        # One rank: the sharded decode is plain attention over the whole local cache (Star / APB
        # studied on one device run their query phase and decode like this).
        return self.strategy.cp == 1 and self.link is None

    def _graph_decoder(self, ids, cache: KVCache):
        """cp = 1: the local graph decoder. cp > 1 (no pipeline): a GraphDecoder that merges over the
        CP group, appending on the query rank only. Every rank must take the same path each step (the
        graph's collectives pair with the peers'), so the ranks agree on it with one tiny all-reduce
        per step; once the query rank's cache is full, the rest of the generation runs eagerly."""
        s = self.strategy
        if self.link is not None:
            return None
        if s.cp == 1:
            return super()._graph_decoder(ids, cache)
        if self._eager_rest or not self._graphs_apply(ids, cache):
            return None
        if self._graph is None or self._graph.cache is not cache:
            self._graph = GraphDecoder(self.model, cache, group=s.group, appends=s.is_query_rank)
        fits = torch.tensor([int(self._graph.fits())], device=cache.device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=s.group)
        if not fits.item():
            self._graph, self._eager_rest = None, True
            return None
        return self._graph

    def end_generation(self) -> None:
        super().end_generation()
        self._eager_rest = False

    def next_token(self, ids, cache: KVCache, sampling: SamplingConfig, gen, chunk=None) -> torch.Tensor:
        graph = self._graph_decoder(ids, cache)
        if graph is not None and self.strategy.cp == 1:
            return self.sample(graph.step(ids)[:, -1], sampling, gen)
        if graph is not None:  # sharded KV: every rank replays its graph, the query rank samples
            logits = graph.step(ids)
        else:
            with self._strategy_attention(self.strategy.decode_attend):
                logits = self._forward(ids, cache=cache, last_only=True)
            if self.link is not None:
                self.link.flush()
        s = self.strategy
        sampler = self.is_last and s.is_query_rank
        tok = self.sample(logits[:, -1], sampling, gen) if sampler else torch.zeros(1, dtype=torch.long, device=ids.device)
        return self._broadcast_token(tok, s.query_rank)
