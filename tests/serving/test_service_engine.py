"""The service engine below the HTTP layer: cascade attention against a float64 reference, the own-KV
pool, the context cache's budget and LRU order, and whole requests through Scheduler (cached follow-ups
and batched questions give the tokens an uncached one-request run gives)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from starshard import LLM
from starshard.config import SamplingConfig
from starshard.engine.kv_cache import KVCache
from starshard.serving.cascade import CascadeAttention, CascadeGraph, OwnKV, SharedGroup, run_cascade
from starshard.serving.context_cache import CacheEntry, ContextCache
from starshard.serving.scheduler import QueueFull, Scheduler
from tests.helpers.service import pool_with_history, submit


def reference(q, keys, vals, kpos, qpos):
    """float64 attention of each row over keys with kpos <= its qpos; q [B, H, L, D], keys [B, Hkv, N, D]."""
    g = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(g, 1)
    v = vals.double().repeat_interleave(g, 1)
    s = torch.einsum("bhld,bhnd->bhln", q.double(), k) * q.shape[-1] ** -0.5
    s = s.masked_fill(kpos[:, None, None, :] > qpos[:, None, :, None], float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("L", [1, 5])
def test_cascade_equals_attention_over_the_shared_prefix_and_own_keys(L):
    torch.manual_seed(L)
    B, Hq, Hkv, D, N = 3, 4, 2, 8, 37
    # A cache entry holding positions 0..N-1 in a shuffled order (as a CP shard would), two layers.
    perm = torch.randperm(N)
    entry = KVCache([0, 1], 1, Hkv, D, N, torch.float32, "cpu")
    ek, ev = torch.randn(1, Hkv, N, D), torch.randn(1, Hkv, N, D)
    entry.layer(0).append(ek[:, :, perm], ev[:, :, perm], perm)
    prefix = [N, 20, 11]  # row 0 shares the whole entry, the others a prefix of it
    own, old_k, old_v, old_pos = pool_with_history(prefix, Hkv, D, L)  # 3 own tokens after each prefix
    q, k, v = torch.randn(B, Hq, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    pos = torch.stack([torch.arange(p + 3, p + 3 + L) for p in prefix])
    cascade = CascadeAttention([SharedGroup(entry, [0, 1, 2], prefix, N)], own)
    out = cascade.attend(0, q, k, v, pos)
    for b, p in enumerate(prefix):
        keys = torch.cat([ek[:, :, :p], old_k[b : b + 1], k[b : b + 1]], 2)
        vals = torch.cat([ev[:, :, :p], old_v[b : b + 1], v[b : b + 1]], 2)
        kpos = torch.cat([torch.arange(p), old_pos[b], pos[b]])[None]
        ref = reference(q[b : b + 1], keys, vals, kpos, pos[b : b + 1])
        assert (out[b : b + 1].double() - ref).abs().max() < 1e-5, (b, p)


def test_own_pool_gather_keeps_rows_and_appends_per_row():
    a = OwnKV([0], 2, 1, 4, 6, torch.float32, "cpu")
    k = torch.randn(2, 1, 2, 4)
    a.append(0, k, k + 1, torch.tensor([[5, 6], [9, 10]]))
    a.advance(2)
    b = OwnKV.gather([(a, 1), (a, 0)], 3, [0], 1, 4, torch.float32, "cpu")
    assert b.lengths == [2, 2] and b.capacity == 5
    assert torch.equal(b.k[0][0, :, :2], k[1]) and torch.equal(b.pos[0][1, :2], torch.tensor([5, 6]))
    new = torch.randn(2, 1, 1, 4)
    b.append(0, new, new, torch.tensor([[11], [7]]))
    assert torch.equal(b.k[0][:, :, 2], new[:, :, 0]) and b.pos[0][0, 2] == 11


def _entry(cache: ContextCache, n: int, nbytes: int) -> CacheEntry:
    e = CacheEntry(cache.next_id(), np.arange(n), None, nbytes)
    cache.add(e)
    return e


def test_context_cache_lookup_budget_and_lru():
    cache = ContextCache(100)
    a, b = _entry(cache, 10, 40), _entry(cache, 20, 40)
    ids = np.concatenate([np.arange(15), [99, 98]])
    e, m = cache.lookup(ids)
    assert e is b and m == 15  # the longest shared prefix
    e, m = cache.lookup(np.arange(10))
    assert e in (a, b) and m == 9  # one prompt token is always left to run
    cache.acquire(a)
    assert cache.plan_room(50) == [b.id]  # a is in use: only b can go
    assert cache.plan_room(61) is None  # even without b there is no room beside a
    cache.release(a)
    cache.touch(b)
    assert cache.plan_room(50) == [a.id]  # least recently used first
    assert cache.plan_room(50, keep=a.id) == [b.id]  # never the entry about to be reused
    cache.acquire(b)
    with pytest.raises(RuntimeError, match="while requests use them"):
        cache.evict([a.id, b.id])
    assert set(cache.entries) == {a.id, b.id}  # refused whole: nothing was removed


@pytest.fixture(scope="module")
def tiny():
    return LLM(random_weights="tiny", progress=False)


def _ask(svc, ids, n):
    return submit(svc, svc.text_prompt(ids), n)


def _tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def test_service_cached_and_batched_requests_match_one_uncached_run(tiny):
    rng = np.random.default_rng(0)
    doc = [int(x) for x in rng.integers(1, 500, 300)]
    questions = [[int(x) for x in rng.integers(1, 500, 7)] for _ in range(4)]
    svc = Scheduler(tiny, cache_bytes=2**26, max_batch=4)
    svc.start()
    try:
        first, done = _ask(svc, doc + questions[0], 6)
        assert done.wait(60)
        assert first[-1].cached_tokens == 0 and first[-1].finish_reason == "length"
        runs = [_ask(svc, doc + q, 6) for q in questions[1:]]  # concurrent, all on the cached document
        for _, done in runs:
            assert done.wait(60)
        for (events, _), q in zip(runs, questions[1:]):
            assert events[-1].cached_tokens == len(doc)
            assert _tokens(events) == tiny.generate(doc + q, max_new_tokens=6).token_ids
        assert _tokens(first) == tiny.generate(doc + questions[0], max_new_tokens=6).token_ids
        stats = svc.stats()
        assert stats["cache_hits"] == 3 and stats["cache_entries"] == 1 and stats["cached_tokens_total"] == 3 * len(doc)
    finally:
        svc.shutdown()


def test_service_refuses_what_never_fits_and_a_full_queue(tiny):
    svc = Scheduler(tiny, cache_bytes=2**16, max_batch=1, max_queue=1)  # no engine thread: nothing is taken
    with pytest.raises(ValueError, match="--cache-gib"):
        svc.submit(svc.text_prompt(list(range(1, 400))), max_tokens=4, sampling=SamplingConfig(), on_event=print)
    svc.submit(svc.text_prompt([1, 2, 3]), max_tokens=2, sampling=SamplingConfig(), on_event=lambda e: None)
    with pytest.raises(QueueFull):
        svc.submit(svc.text_prompt([1, 2, 3]), max_tokens=2, sampling=SamplingConfig(), on_event=lambda e: None)


def test_cascade_graph_buffers_step_like_the_eager_forward(tiny):
    """The CUDA-graph step's eager twin (capture=False): same logits and own-KV writes as run_cascade."""
    model = tiny.model
    entry = tiny.runner.new_cache(40)
    with torch.inference_mode():
        model(torch.randint(1, 500, (1, 40)), cache=entry, last_only=True)
        pools = [OwnKV(model.layer_ids, 2, 2, 16, 4, torch.float32, "cpu") for _ in range(2)]
        tok, pos = torch.tensor([[3], [4]]), torch.tensor([[40], [30]])
        outs = []
        for pool, graph in zip(pools, (False, True)):
            cascade = CascadeAttention([SharedGroup(entry, [0, 1], [40, 30], 40)], pool)
            if graph:
                step = CascadeGraph(model, cascade, 2, "cpu", capture=False)
                outs.append(torch.stack([step.step(tok, pos), step.step(tok + 1, pos + 1)]))
            else:
                outs.append(torch.stack([run_cascade(model, tok, pos, cascade), run_cascade(model, tok + 1, pos + 1, cascade)]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert pools[0].lengths == pools[1].lengths == [2, 2]
    assert torch.equal(pools[0].k[0], pools[1].k[0])


def test_a_new_document_behind_a_shared_header_is_prefilled_and_cached(tiny):
    """Chat prompts share the template's header: a new document after it must become its own entry
    (not run as a long 'rest' on the first document), so its next question finds it."""
    rng = np.random.default_rng(1)
    header = [7, 8, 9, 10, 11]
    doc_a, doc_b = ([int(x) for x in rng.integers(20, 500, 200)] for _ in range(2))
    svc = Scheduler(tiny, cache_bytes=2**26, max_batch=2)
    svc.start()
    try:
        for ids, cached in [(header + doc_a + [1, 2], 0), (header + doc_b + [3, 4], 0),
                            (header + doc_b + [5, 6], len(header) + len(doc_b))]:
            events, done = _ask(svc, ids, 3)
            assert done.wait(60)
            assert events[-1].cached_tokens == cached, ids[-2:]
            assert _tokens(events) == tiny.generate(ids, max_new_tokens=3).token_ids
        assert svc.stats()["cache_entries"] == 2
    finally:
        svc.shutdown()
