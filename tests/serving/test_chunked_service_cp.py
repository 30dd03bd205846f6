"""Chunked prefill in the service over a cp=2 group (gloo): the service's tokens equal generate(prefill_chunk=C)
and the unchunked run, a running stream decodes between a document's chunks, and a fault in one chunk or a
cancel between chunks drops the filling entry on every rank, leaving every rank's cache usage as before.
The start-up warm-up (serving/warmup.py) over the group: a warmed service answers as generate does and leaves
nothing behind on any rank; ranks whose warm-ups differ refuse to start (in this file's spawn: one group, one
set of imports)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from starshard import LLM
from starshard.config import ParallelConfig, SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.executor import Fault
from starshard.serving.ops import PrefillChunk
from starshard.serving.scheduler import Scheduler
from starshard.serving.warmup import RanksDisagree
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import submit as submit_one

CHUNK = 16


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 500, n)]


def _ranks(rank, world, strategies):
    out = {s: _rank(rank, world, s) for s in strategies}  # one spawn: the group and the imports once
    return out | {f"warmup-{s}": _warmup_rank(rank, world, s) for s in strategies}


def _warmup_rank(rank, world, strategy):
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy=strategy))
    prompt = Prompt(_ids(7, 100), 96)
    ref = llm.generate(prompt, max_new_tokens=5, prefill_chunk=CHUNK).token_ids
    out = {}
    # ranks that would warm up differently (here: another longest document) refuse to start, every one of them
    svc = Scheduler(llm, cache_bytes=1 << 24, max_batch=3, prefill_chunk=CHUNK, warmup=True,
                    warmup_tokens=200 + CHUNK * rank)
    try:
        svc.start() if rank == 0 else svc.serve_forever()
    except RanksDisagree as e:
        out["disagree"] = str(e)
    svc = Scheduler(llm, cache_bytes=1 << 24, max_batch=3, prefill_chunk=CHUNK, warmup=True, warmup_tokens=200)
    if rank != 0:
        svc.serve_forever()
    else:
        svc.start()
        try:
            events, done = submit_one(svc, prompt, 5)
            assert done.wait(60)
        finally:
            svc.shutdown()
        out["tokens"] = [e.token_id for e in events if e.token_id is not None]
    return dict(out, ref=ref, warmup_s=svc.warmup_s, used=[svc.cache.used(r) for r in range(world)],
                entries=sorted(svc.cache.entries), rows=len(svc.executor.rows), layers=len(llm.model.layers))


def _rank(rank, world, strategy):
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy=strategy))
    a = Prompt(_ids(1, 24), 20)
    b = Prompt(_ids(2, 6 * CHUNK + 5), 6 * CHUNK)  # 7 steps
    c, d = Prompt(_ids(3, 3 * CHUNK), 3 * CHUNK - 4), Prompt(_ids(4, 5 * CHUNK), 5 * CHUNK - 4)
    e = Prompt(_ids(5, 720), 716)  # past the service's knee over cp=2 (tiny's 288 tokens x 2): tapered steps
    refs = dict(a=llm.generate(a, max_new_tokens=20).token_ids,
                b=llm.generate(b, max_new_tokens=4, prefill_chunk=CHUNK).token_ids,
                b_whole=llm.generate(b, max_new_tokens=4).token_ids,
                b_steps=len(llm.runner.prefill_bounds(len(b.ids), b.context_len, CHUNK)),
                e_whole=llm.generate(e, max_new_tokens=4).token_ids,
                e_uniform=len(llm.runner.prefill_bounds(len(e.ids), e.context_len, CHUNK)))
    svc = Scheduler(llm, cache_bytes=1 << 28, max_batch=4, prefill_chunk=CHUNK)
    refs["e_steps"] = len(llm.runner.prefill_bounds(len(e.ids), e.context_len, CHUNK, svc.prefill_knee))
    ex = svc.executor
    ex.faults = [Fault("compute", 3, RuntimeError("injected after c's first chunk"), rank=1)]
    if rank != 0:
        svc.serve_forever()
        return dict(used=[svc.cache.used(r) for r in range(world)], filling=len(ex.filling), rows=len(ex.rows))
    run, seen = ex.run, {}

    def run_and_cancel(ops):
        out = run(ops)
        if any(isinstance(op, PrefillChunk) and op.rid == 4 and op.start == CHUNK for op in ops):
            seen["ticket"].cancel()  # d is cancelled between its chunks
        return out

    ex.run = run_and_cancel
    runs = {}

    def submit(name, prompt, n):
        events, done = [], threading.Event()

        def on_event(ev):
            events.append(ev)
            if ev.finish_reason is not None:
                done.set()

        ticket = svc.submit(prompt, max_tokens=n, sampling=SamplingConfig(), on_event=on_event)
        runs[name] = (events, done)
        return ticket

    submit("a", a, 20)
    submit("b", b, 4)  # queued before the loop starts: the step order is fixed
    svc.start()
    try:
        assert runs["a"][1].wait(120) and runs["b"][1].wait(120)
        before = [svc.cache.used(r) for r in range(world)]
        submit("c", c, 4)
        assert runs["c"][1].wait(120)
        seen["ticket"] = submit("d", d, 4)
        assert runs["d"][1].wait(120)
        submit("e", e, 4)
        assert runs["e"][1].wait(120)
    finally:
        svc.shutdown()
    tokens = {k: [e.token_id for e in ev if e.token_id is not None] for k, (ev, _) in runs.items()}
    e_bytes = ex.entry_rank_bytes(len(e.ids), e.context_len, CHUNK, svc.prefill_knee)
    return dict(used=[svc.cache.used(r) for r in range(world)], before=before, e_bytes=e_bytes,
                filling=len(ex.filling),
                rows=len(ex.rows), tokens=tokens, refs=refs, log=list(svc.step_log),
                last={k: ev[-1] for k, (ev, _) in runs.items()}, health=svc.health())


@pytest.fixture(scope="module")
def cp2():
    return run_ranks(_ranks, 2, ["ring", "star"])


@pytest.mark.parametrize("strategy", ["ring", "star"])
def test_chunked_service_cp2(cp2, strategy):
    ranks = [res[strategy] for res in cp2]
    lead = ranks[0]
    tokens, refs, log = lead["tokens"], lead["refs"], lead["log"]
    assert tokens["a"] == refs["a"]
    assert tokens["b"] == refs["b"] == refs["b_whole"]  # the same prefill_step as infer; equal to the whole prefill
    b = [i for i, (k, r) in enumerate(log) if k == "P" and r == 2]
    n = refs["b_steps"]  # ring: 7 chunks; star: 6 (its question runs in the last context chunk's step)
    assert n >= 6 and len(b) == n and [k for k, _ in log[b[0]:b[-1] + 1]] == ["P", "D"] * (n - 1) + ["P"]
    c, d = lead["last"]["c"], lead["last"]["d"]
    assert c.error_code == "failed" and "rank 1" in c.error and not tokens["c"]
    assert d.finish_reason == "cancelled" and not tokens["d"]
    assert lead["health"] is None  # a and b's entries and e's, the tapered layout's shards:
    assert lead["used"] == [n + m for n, m in zip(lead["before"], lead["e_bytes"])]
    assert tokens["e"] == refs["e_whole"]  # tapered steps: the whole prefill's tokens
    assert refs["e_steps"] > refs["e_uniform"] and len([1 for k, r in log if k == "P" and r == 5]) == refs["e_steps"]
    for res in ranks:  # every rank dropped c's and d's filling entries, then took e's
        assert res["used"] == lead["used"] and res["filling"] == 0 and res["rows"] == 0


@pytest.mark.parametrize("strategy", ["ring", "star"])
def test_warmup_cp2(cp2, strategy):
    ranks = [res[f"warmup-{strategy}"] for res in cp2]
    assert ranks[0]["tokens"] == ranks[0]["ref"]
    for res in ranks:  # every rank warmed up, then held only the request's entry, as rank 0 did
        assert "warm-ups differ" in res["disagree"]
        assert res["warmup_s"] > 0 and res["rows"] == 0 and res["layers"] == 2
        assert res["used"] == ranks[0]["used"] and res["entries"] == ranks[0]["entries"] == [1]
