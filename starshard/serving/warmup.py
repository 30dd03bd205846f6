"""The service's start-up warm-up: every kernel shape its steps will use runs once before the first request.

On a GPU the first use of a shape costs seconds that land in some stream's inter-token gap: a decode batch
size's Triton compilation and CUDA-graph capture (~2.5 s), the CP chunk path's first compilation (~1.2 s),
a cuDNN SDPA plan per (query rows, held keys) shape of the tapered prefill schedule (~60 ms each, 61 shapes
at 128K). These costs are per kernel shape, not per layer, so the warm-up runs with the model cut to one
layer of each distinct kind (`cut_layers`): a synthetic workload through the executor's own operations
(serving/ops.py, Executor.run), the same code paths the service runs:

    prefill  one document of the longest length the server admits (the model's window and the device-cache
             budget, by the scheduler's own sizing), with the service's chunk, taper and cp: every step shape
             of partition.prefill_steps runs once (a later document's steps are a prefix of these, but for its
             last, truncated one)
    batch    the document's request decodes, then follow-up extends join one at a time, up to max_batch rows;
             each batch size captures its CUDA graph and replays it (up to DECODE_MAX_ROWS); then k follow-ups
             join in one forward beside the document's row, for k = 2..max_batch - 1. A follow-up shares the
             document but not its question, as a service's follow-ups do (rows that see part of an entry)

Then everything is freed and the model, cache and executor are as they were, but for the decode graphs that
serve any entry (Executor.prepare_tables: one per batch size at the smallest own-KV capacity, captured on the
whole model, ~30 ms each, kept once one of them matches the per-batch path). Every rank of the group runs the
identical sequence (the operations' collectives inside); the ranks first compare what they will run, and
refuse to start when they disagree. A warm-up that fails is logged; the server then serves cold.

cuDNN keeps its SDPA plans per thread: the warm-up runs on the thread that runs the service's steps
(Scheduler._loop on rank 0, serve_forever elsewhere).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.ops import Decode, Extend, Finish, Prefill, PrefillChunk

log = logging.getLogger("starshard.serve")

QUESTION = 64  # tokens of each follow-up question (the extends that grow the batch)
_RID, _ENTRY = -1, -1  # the warm-up's requests and entry: negative, never a real one's


class WarmupFailed(RuntimeError):
    """The warm-up could not run (identically on every rank); the server serves cold."""


class RanksDisagree(RuntimeError):
    """The ranks would run different warm-ups: their settings differ, so the server must not start."""


def layer_kind(layer) -> tuple:
    """What makes a layer's kernels differ: its attention window (as it runs now), its RoPE, its sparse
    pattern's presence and its feed-forward's type (dense or MoE)."""
    attn = layer.attention
    return (attn.extras.get("window"), attn.local_rope, getattr(attn, "sparse", None) is not None,
            type(layer.feed_forward).__name__)


def distinct_layers(model) -> list[int]:
    """Indices into model.layers of the first layer of each kind (layer_kind), in order."""
    seen, keep = set(), []
    for i, layer in enumerate(model.layers):
        kind = layer_kind(layer)
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    return keep


@contextlib.contextmanager
def cut_layers(model, keep: list[int]):
    """Inside the block the model holds only its layers `keep` (indices into model.layers), with their
    global layer ids, so KV caches and pools built meanwhile hold those layers only; on exit, also on
    error, the very same layer list and ids are back."""
    layers, ids = model.layers, model.layer_ids
    model.layers = nn.ModuleList([layers[i] for i in keep])
    model.layer_ids = [ids[i] for i in keep]
    try:
        yield
    finally:
        model.layers, model.layer_ids = layers, ids


def longest_document(svc, max_tokens: int, limit: int | None = None) -> int:
    """The longest prompt the service admits (its window, and the device-cache budget by Scheduler.holdings
    on an empty cache), less one follow-up question; at most `limit`."""
    def fits(n: int) -> bool:
        try:
            svc.llm.check_length(n + QUESTION, max_tokens)
        except ValueError:
            return False
        prompt = Prompt([0] * n, max(1, n - QUESTION))
        return max(svc.holdings(prompt, max_tokens)) <= svc.cache.budget

    lo, hi = 0, svc.max_model_len if limit is None else min(limit, svc.max_model_len)
    while lo < hi:  # the largest n that fits (holdings grow with n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


class Plan:
    """The warm-up's operations, one step each, decided alike on every rank from the scheduler's settings."""

    def __init__(self, svc, max_len: int | None = None):
        ex = svc.executor
        self.batch = svc.max_batch
        self.max_tokens = 2 * self.batch + 2  # every row decodes at most two steps per batch size
        self.length = longest_document(svc, self.max_tokens, max_len)
        if self.length < 2:
            raise WarmupFailed(f"the context cache budget ({svc.cache.budget} bytes per rank) admits no document")
        L, vocab = self.length, svc.config.vocab_size
        self.ids = [(7 * i + 11) % vocab for i in range(L)]
        context = max(1, L - QUESTION)  # a document and its question (Star's query phase needs one)
        self.steps: list[list] = []
        sampling = SamplingConfig()
        if svc.prefill_chunk:
            bounds = ex.runner.prefill_bounds(L, context, svc.prefill_chunk, svc.prefill_knee)
            self.steps += [[PrefillChunk(rid=_RID, entry=_ENTRY, start=s, end=e, chunk=svc.prefill_chunk,
                                         knee=svc.prefill_knee, prompt_len=L, ids=self.ids if s == 0 else None,
                                         max_tokens=self.max_tokens, sampling=sampling, context_len=context,
                                         head_len=0)] for s, e in bounds]
        else:
            self.steps.append([Prefill(rid=_RID, ids=self.ids, max_tokens=self.max_tokens, sampling=sampling,
                                       entry=_ENTRY, context_len=context, head_len=0, pinned=not svc.reuse)])
        self.prefill_steps = len(self.steps)
        # APB's entries are never reused: its batch grows only by prefills; the warm-up decodes one row there.
        self.batch = self.batch if svc.reuse else 1
        self.rids = [_RID]
        for b in range(1, self.batch + 1):
            if b > 1:
                rid = _RID - b + 1
                question = [(13 * b + 5 * j) % vocab for j in range(QUESTION)]
                self.steps.append([Extend(rid=rid, ids=self.ids[:context] + question, max_tokens=self.max_tokens,
                                          sampling=sampling, entry=_ENTRY, prefix=context)])
                self.rids.append(rid)
            self.steps += [[Decode()], [Decode()]]  # captured, then replayed
        # Follow-ups that wait together join in one forward (Executor._extend_together): each such group size
        # compiles its own kernels, seconds in a stream's gap on first use (4 x H200: 2.5-3.1 s for three).
        # Beside the document's row, k extends join at once for k = 2..batch - 1, decode a step and leave.
        if self.batch > 2:
            self.steps.append([Finish(self.rids[1:])])
            self.rids = [_RID]
            for k in range(2, self.batch):
                rids = [_RID - self.batch - k * self.batch - j for j in range(k)]
                question = [(17 * k + 3 * j) % vocab for j in range(QUESTION)]
                self.steps.append([Extend(rid=rid, ids=self.ids[:context] + question, max_tokens=self.max_tokens,
                                          sampling=sampling, entry=_ENTRY, prefix=context) for rid in rids])
                self.steps += [[Decode()], [Finish(rids)]]

    def fingerprint(self, keep_ids: list[int]) -> list[int]:
        """What every rank must agree on before running it."""
        return [self.length, self.prefill_steps, self.batch, len(self.steps), hash(tuple(keep_ids)) % 2**62]


def warm_up(svc, max_len: int | None = None) -> dict[str, float]:
    """Run the warm-up on this rank (every rank of the group at once) -> its seconds by phase: "prefill" (the
    plan and the cut model's prefill steps), "batches" (the cut model's batch sizes and joins), "decode_graphs"
    (the whole model's kept graphs, captured and checked); host time, where first-use compilation shows.
    WarmupFailed (or another error): it did not complete; everything it built is freed either way.
    RanksDisagree: the ranks' plans differ."""
    ex, cache, model = svc.executor, svc.cache, svc.executor.model
    if ex.rows or ex.filling or cache.entries:
        raise WarmupFailed("the warm-up runs before the first request, on an empty cache and batch")
    t0 = t_prefill = time.perf_counter()
    plan = Plan(svc, max_len)
    keep = distinct_layers(model)
    _agree(svc, plan.fingerprint([model.layer_ids[i] for i in keep]))
    log.info("warm-up: a %d-token document in %d prefill steps, then batch sizes 1..%d, on layers %s of %d",
             plan.length, plan.prefill_steps, plan.batch, [model.layer_ids[i] for i in keep], len(model.layers))
    clock, on_timing = next(cache._clock), ex.on_timing
    ex.on_timing = None  # cut-model prefills would mislead the disk reload policy's rates
    failure = None
    try:
        with cut_layers(model, keep):
            for j, step in enumerate(plan.steps):
                if j == plan.prefill_steps:
                    t_prefill = time.perf_counter()  # host time: what compiles shows here, the device being idle
                _, failures = ex.run(step)
                if failures:  # voted: the same on every rank
                    failure = next(iter(failures.values()))
                    break
            if failure is None:
                ex.run([Finish(list(plan.rids))])
    finally:
        _restore(svc, clock)
        ex.on_timing = on_timing
    if failure is not None:
        raise WarmupFailed(f"{failure.code}: {failure.message}")
    t1 = time.perf_counter()
    tables = ex.prepare_tables(plan.batch)  # the whole model's, kept: the first batch of each size replays
    if tables and ex.device.type == "cuda":
        torch.cuda.synchronize(ex.device)
    phases = {"prefill": t_prefill - t0, "batches": t1 - t_prefill, "decode_graphs": time.perf_counter() - t1}
    log.info("warm-up: %d prefill steps, batch sizes 1..%d on the cut model %.1f s (%.1f s to the first batch); "
             "%d decode graphs kept (captured and checked) %.1f s; %.1f s in all", plan.prefill_steps, plan.batch,
             t1 - t0, phases["prefill"], tables, phases["decode_graphs"], sum(phases.values()))
    return phases


def _agree(svc, mine: list[int]) -> None:
    """Every rank's plan must be rank 0's (one gloo all-gather over the control group)."""
    if svc.control is None:
        return
    t = torch.tensor(mine, dtype=torch.long)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size(svc.control))]
    dist.all_gather(out, t, group=svc.control)
    bad = [r for r, o in enumerate(out) if not torch.equal(o, out[0])]
    if bad:
        raise RanksDisagree(f"the ranks' warm-ups differ (ranks {bad} vs rank 0: document length, prefill steps, "
                            f"batch, steps, layers = {[o.tolist() for o in out]}): start every rank with the same "
                            "flags")


def _restore(svc, clock: int) -> None:
    """Drop what the warm-up built on this rank (no collectives: also after a failure on some ranks)."""
    ex, cache = svc.executor, svc.cache
    ex.rows, ex.pool, ex.filling = [], None, {}
    ex._graph, ex._issued = None, None
    ex._tables.clear()  # the cut model's
    ex.lost.discard(_ENTRY)
    for e in [e for e in cache.entries.values() if e.id < 0]:
        cache.entries.pop(e.id)
    cache._clock = itertools.count(clock)
    ex.runner.end_generation()
    if ex.device.type == "cuda":
        torch.cuda.synchronize(ex.device)
        torch.cuda.empty_cache()
