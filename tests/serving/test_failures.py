"""A failing request fails alone (issue 36 step 3): a fault in one request's prefill, extend or decode
frees what it held on every rank and ends it with an error code and sizes; the other requests answer
as they would alone, and the next request is served. The memory pre-check refuses before allocating."""
from __future__ import annotations

import numpy as np
import torch

from starshard import LLM
from starshard.config import ParallelConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.executor import Fault
from starshard.serving.scheduler import Scheduler
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import submit

STEPS = 4
GIB = 2**30


def _prompts():
    rng = np.random.default_rng(5)
    docs = [[int(x) for x in rng.integers(1, 500, n)] for n in (97, 131)]
    qs = [[int(x) for x in rng.integers(1, 500, 5)] for _ in range(3)]
    return docs, qs


def _submit(svc, prompt, n=STEPS):
    return submit(svc, prompt, n)


def _tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def _cp2_faults(rank, world):
    """cp=2 ring. Request 2 (a new document) runs out of memory in prepare on rank 1 only; request 5 (an
    extend) fails after its forward on rank 0 only. Requests 1, 3, 4 answer as alone."""
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy="ring"))
    (d1, d2), (q1, q2, q3) = _prompts()
    a, b, c = Prompt(d1 + q1, len(d1)), Prompt(d2 + q1, len(d2)), Prompt(d1 + q2, len(d1))
    e = Prompt(d1 + q3, len(d1))
    refs = {k: llm.generate(p, max_new_tokens=STEPS).token_ids for k, p in (("a", a), ("b", b), ("c", c))}
    svc = Scheduler(llm, cache_bytes=1 << 30, max_batch=4)
    ex = svc.executor
    ex.free_bytes = lambda: 3 * GIB  # a card with 3 GiB free: the pre-check passes, the message names it
    ex.faults = [Fault("prepare", 2, torch.OutOfMemoryError("CUDA out of memory (injected)"), rank=1),
                 Fault("compute", 5, RuntimeError("injected after the forward"), rank=0)]
    if rank != 0:
        svc.serve_forever()
        return dict(used=[svc.cache.used(r) for r in range(world)], rows=len(ex.rows), entries=sorted(svc.cache.entries))
    svc.start()
    try:
        runs = [_submit(svc, p) for p in (a, b, c)]
        assert all(done.wait(120) for _, done in runs)
        d_run = _submit(svc, b)
        assert d_run[1].wait(120)
        e_run = _submit(svc, e)
        assert e_run[1].wait(120)
        f_run = _submit(svc, c)  # served after the failures
        assert f_run[1].wait(120)
        out = dict(runs=[ev for ev, _ in runs], d=d_run[0], e=e_run[0], f=f_run[0], refs=refs,
                   health=svc.health(), stats=svc.stats())
    finally:
        svc.shutdown()
    out.update(used=[svc.cache.used(r) for r in range(world)], rows=len(ex.rows), entries=sorted(svc.cache.entries))
    return out


def test_a_fault_in_one_request_at_cp2_fails_it_alone():
    ranks = run_ranks(_cp2_faults, 2)
    lead = ranks[0]
    (a, b, c), refs = lead["runs"], lead["refs"]
    assert _tokens(a) == refs["a"] and _tokens(c) == refs["c"]  # the others answer as alone
    assert b[-1].finish_reason == "error" and b[-1].error_code == "insufficient_memory" and not _tokens(b)
    msg = b[-1].error
    assert "on rank 1" in msg and "3.00 GiB are free" in msg and "--cache-gib" in msg, msg
    assert _tokens(lead["d"]) == refs["b"] and lead["d"][-1].cached_tokens == 0  # the failed document, served now
    e = lead["e"][-1]
    assert e.finish_reason == "error" and e.error_code == "failed" and "rank 0" in e.error and "injected" in e.error
    assert _tokens(lead["f"]) == refs["c"] and lead["f"][-1].cached_tokens > 0
    assert lead["health"] is None and lead["stats"]["errors_by_code"] == {"insufficient_memory": 1, "failed": 1}
    for res in ranks:  # every rank rolled back alike: two documents' entries, no row, the same bytes
        assert res["rows"] == 0 and res["entries"] == lead["entries"] and len(res["entries"]) == 2
        assert res["used"] == lead["used"]


def test_memory_precheck_refuses_before_allocating():
    llm = LLM(random_weights="tiny", progress=False)
    svc = Scheduler(llm, cache_bytes=1 << 30, max_batch=2)
    ex, calls = svc.executor, []
    new_cache = ex.runner.new_cache
    ex.runner.new_cache = lambda *a, **k: calls.append(a) or new_cache(*a, **k)
    ex.free_bytes = lambda: 1000  # 1000 bytes free: no step fits
    (d1, _), (q1, _, _) = _prompts()
    prompt = Prompt(d1 + q1, len(d1))
    svc.start()
    try:
        events, done = _submit(svc, prompt)
        assert done.wait(60)
        ev = events[-1]
        assert ev.finish_reason == "error" and ev.error_code == "insufficient_memory"
        assert "on rank 0" in ev.error and "0.00 MiB are free" in ev.error
        assert not calls and not svc.cache.entries and not ex.rows  # refused before the entry was allocated
        ex.free_bytes = lambda: None
        events, done = _submit(svc, prompt)
        assert done.wait(60) and _tokens(events) == llm.generate(prompt, max_new_tokens=STEPS).token_ids
        assert svc.health() is None
    finally:
        svc.shutdown()


def test_a_decode_fault_in_one_process_ends_that_row_only():
    llm = LLM(random_weights="tiny", progress=False)
    svc = Scheduler(llm, cache_bytes=1 << 30, max_batch=2)
    (d1, d2), (q1, _, _) = _prompts()
    a, b = Prompt(d1 + q1, len(d1)), Prompt(d2 + q1, len(d2))
    svc.executor.faults = [Fault("decode", 1, torch.OutOfMemoryError("CUDA out of memory (injected)"))]
    svc.start()
    try:
        (ea, da), (eb, db) = _submit(svc, a, 8), _submit(svc, b, 8)
        assert da.wait(60) and db.wait(60)
    finally:
        svc.shutdown()
    assert ea[-1].error_code == "insufficient_memory" and len(_tokens(ea)) == 1  # its first token, then the fault
    assert _tokens(eb) == llm.generate(b, max_new_tokens=8).token_ids
    assert not svc.executor.rows and all(e.users == 0 for e in svc.cache.entries.values())
