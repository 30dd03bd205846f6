"""Admission by what each CP rank holds (issue 36, F1-F4): the scheduler counts every rank's entry
shard from StrategySpec.rank_rows and the query rank's own-KV pool, against the per-rank budget;
submit and the step loop share one holdings function; a refusal names each rank's GiB and what fits."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from starshard import LLM
from starshard.config import ParallelConfig, SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.context_cache import CacheEntry, ContextCache, kv_bytes
from starshard.serving.scheduler import Scheduler
from starshard.strategies import get_spec
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import submit

STEPS = 5


def _doc_and_question(seed: int = 3) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, 500, 301)], [int(x) for x in rng.integers(1, 500, 7)]


def _ask(svc, prompt: Prompt, n: int):
    return submit(svc, prompt, n)


def test_issue_example_counts_the_shard_once():
    """llama-3.1-8b at cp=4 Star (131 328 KV bytes a token), a 256K document and a 64-token question:
    8.02 GiB on each rank, the question on the query rank (submit used to count 40.1 GiB)."""
    rows = get_spec("star").rank_rows(4, 262_144 + 64, 262_144, {})
    assert rows == [65_536, 65_536, 65_536, 65_536 + 64]
    assert [round(r * 131_328 / 2**30, 2) for r in rows] == [8.02, 8.02, 8.02, 8.02]


def test_plan_room_evicts_until_the_worst_rank_fits():
    cache = ContextCache(100, ranks=2)
    a = CacheEntry(cache.next_id(), np.arange(4), None, 60, rank_bytes=[20, 60])
    b = CacheEntry(cache.next_id(), np.arange(5), None, 30, rank_bytes=[30, 10])
    cache.add(a)
    cache.add(b)
    assert cache.used(0) == 50 and cache.used(1) == 70 and cache.used_bytes == 70
    assert cache.plan_room([40, 30]) == []  # rank 0: 90, rank 1: 100
    assert cache.plan_room([0, 35]) == [a.id]  # only rank 1 overflows; a is the least recently used
    cache.touch(a)
    assert cache.plan_room([0, 35]) == [b.id]  # now b is; its 10 bytes on rank 1 are enough
    assert cache.plan_room([0, 45]) == [b.id, a.id]  # b alone leaves rank 1 at 105
    assert cache.plan_room([0, 45], keep=a.id) is None


def _serve(rank, world, strategy, budget_share):
    """Every rank: a cp=2 service whose budget is `budget_share` of the whole document's KV. Rank 0 asks
    a question and checks the refusals; every rank reports its entry's bytes."""
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy=strategy))
    doc, question = _doc_and_question()
    prompt = Prompt(doc + question, len(doc))
    reference = llm.generate(prompt, max_new_tokens=STEPS).token_ids  # the same group's infer path
    probe = Scheduler(llm, cache_bytes=1 << 30)
    whole = len(prompt.ids) * probe.executor.token_bytes()
    shard = probe.executor.entry_rank_bytes(len(prompt.ids), len(doc))
    svc = Scheduler(llm, cache_bytes=int(budget_share * whole), max_batch=2)
    out = dict(whole=whole, shard=shard, reference=reference, need=svc.holdings(prompt, STEPS))
    if rank != 0:
        svc.serve_forever()
    else:
        small = Scheduler(llm, cache_bytes=max(shard) - 1)  # plans only: no step loop, no collective
        with pytest.raises(ValueError) as refused:
            _ask(small, prompt, STEPS)
        out["refusal"] = str(refused.value)
        svc.start()
        try:
            events, done = _ask(svc, prompt, STEPS)
            assert done.wait(120)
            out["tokens"] = [e.token_id for e in events if e.token_id is not None]
            out["used"] = [svc.cache.used(r) for r in range(world)]
        finally:
            svc.shutdown()
    entry = next(iter(svc.cache.entries.values()))
    out["rank_bytes"], out["kv_bytes"] = entry.rank_bytes, kv_bytes(entry.kv)
    return out


@pytest.mark.parametrize("strategy", ["ring", "star"])
def test_admission_cp2_budget_below_the_whole_document(strategy):
    ranks = run_ranks(_serve, 2, strategy, 0.7)
    lead = ranks[0]
    shard, need = lead["shard"], lead["need"]
    assert max(need) <= 0.7 * lead["whole"] < sum(shard)  # the shard fits, the whole document would not
    assert need[0] == shard[0] and need[1] > shard[1]  # the pool is the query rank's (cp - 1)
    assert lead["tokens"] == lead["reference"]
    assert lead["used"] == shard
    for r, res in enumerate(ranks):
        assert res["rank_bytes"] == shard
        assert res["kv_bytes"] == shard[r]  # each rank allocated exactly what the scheduler counts
    gib = [f"{n / 2**30:.3g}" for n in need]
    msg = lead["refusal"]
    assert f"per rank {gib[0]} | {gib[1]} GiB" in msg and "cp=2" in msg and "--cache-gib" in msg
    assert "--cp 4" in msg  # its shard over 4 ranks fits the smaller budget
    print(msg)


def test_ring_cp2_answers_like_one_process():
    """The cp=2 ring service's answer under a budget below the whole document equals one process's."""
    ranks = run_ranks(_serve, 2, "ring", 0.7)
    doc, question = _doc_and_question()
    one = LLM(random_weights="tiny", progress=False).generate(doc + question, max_new_tokens=STEPS).token_ids
    assert ranks[0]["tokens"] == one


def _pool_waits(rank, world):
    """cp=2 ring: a follow-up whose pool would overflow only the query rank (rank 1) waits for the running
    request to finish, then extends the cached document; rank 0 holds no pool but plans rank 1's (F3)."""
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy="ring"))
    doc, question = _doc_and_question()
    first, second = Prompt(doc + question, len(doc)), Prompt(doc + question[::-1], len(doc))
    long, short = 40, STEPS
    reference = llm.generate(second, max_new_tokens=short).token_ids
    ex = Scheduler(llm, cache_bytes=1 << 30).executor
    shard = max(ex.entry_rank_bytes(len(first.ids), len(doc)))
    # room for the first request (its shard and its pool) and 60 tokens more: not for both pools at once
    svc = Scheduler(llm, cache_bytes=shard + ex.pool_bytes([(0, long - 1)]) + 60 * ex.own_token_bytes(), max_batch=2)
    if rank != 0:
        svc.serve_forever()
        return None
    order, lock = [], threading.Lock()
    svc.start()
    try:
        runs = []
        for name, prompt, n in (("a", first, long), ("b", second, short)):
            events, done = [], threading.Event()

            def on_event(ev, name=name, events=events, done=done):
                with lock:
                    order.append((name, ev.finish_reason))
                events.append(ev)
                if ev.finish_reason is not None:
                    done.set()

            svc.submit(prompt, max_tokens=n, sampling=SamplingConfig(), on_event=on_event)
            runs.append((events, done))
        assert all(done.wait(120) for _, done in runs)
    finally:
        svc.shutdown()
    b = runs[1][0]
    return dict(order=order, tokens=[e.token_id for e in b if e.token_id is not None], cached=b[-1].cached_tokens,
                reference=reference)


def test_a_pool_that_overflows_only_the_query_rank_waits():
    res = run_ranks(_pool_waits, 2)[0]
    names = [n for n, _ in res["order"]]
    assert names.index("b") > names.index("a") + 39 and ("a", "length") in res["order"]
    assert res["order"].index(("a", "length")) < names.index("b")  # b started after a ended
    assert res["cached"] == len(_doc_and_question()[0]) and res["tokens"] == res["reference"]
