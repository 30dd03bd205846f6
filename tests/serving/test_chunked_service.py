"""Chunked prefill in the service (issue 36 step 5): a new document runs one chunk a step and the running
streams take a decode step between its chunks (asserted on Scheduler.step_log, not wall time); follow-ups
are not starved behind documents, documents start in arrival order, a request for a document still filling
waits for it and extends; cancel and timeout mid-prefill free the filling entry. The tokens equal
generate(prefill_chunk=C) and the unchunked run."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from starshard import LLM
from starshard.commands.serve import parse_args
from starshard.serving.scheduler import default_prefill_chunk
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.ops import PrefillChunk
from starshard.serving.scheduler import Scheduler
from starshard.strategies.flops import prefill_knee

CHUNK = 32


@pytest.fixture(scope="module")
def tiny():
    return LLM(random_weights="tiny", progress=False)


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 500, n)]


class Run:
    def __init__(self, svc, prompt: Prompt, n: int):
        self.events, self.done = [], threading.Event()
        self.ticket = svc.submit(prompt, max_tokens=n, sampling=SamplingConfig(), on_event=self._on)
        self.rid = self.ticket.rid

    def _on(self, ev):
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self):
        return [e.token_id for e in self.events if e.token_id is not None]


def _steps(svc, rid):
    """Indices in the step log of request rid's prefill steps."""
    return [i for i, (kind, r) in enumerate(svc.step_log) if kind == "P" and r == rid]


def test_stream_tokens_arrive_during_a_long_prefill(tiny):
    a = Prompt(_ids(1, 20), 15)
    b = Prompt(_ids(2, 10 * CHUNK - 3), 10 * CHUNK - 8)  # 10 chunks, the last one short
    svc = Scheduler(tiny, cache_bytes=1 << 26, max_batch=4, prefill_chunk=CHUNK)
    ra, rb = Run(svc, a, 16), Run(svc, b, 5)  # both queued before the loop starts: the order is fixed
    svc.start()
    try:
        assert ra.done.wait(60) and rb.done.wait(60)
    finally:
        svc.shutdown()
    chunks = _steps(svc, rb.rid)
    assert len(chunks) == 10 and svc.stats()["prefill_chunks_total"] == 11
    log = list(svc.step_log)
    # between b's first and last chunk, every prefill step is followed by a decode of the running stream
    assert [k for k, _ in log[chunks[0]:chunks[-1] + 1]] == ["P", "D"] * 9 + ["P"]
    assert ra.tokens == tiny.generate(a, max_new_tokens=16).token_ids
    chunked = tiny.generate(b, max_new_tokens=5, prefill_chunk=CHUNK).token_ids
    assert rb.tokens == chunked == tiny.generate(b, max_new_tokens=5).token_ids
    assert svc.stats()["prefilling_tokens_left"] == 0


def test_follow_up_not_starved_and_arrival_order(tiny):
    doc0, doc1, doc2 = _ids(3, 40), _ids(4, 6 * CHUNK), _ids(5, 4 * CHUNK)
    q = [_ids(10 + i, 4) for i in range(4)]
    svc = Scheduler(tiny, cache_bytes=1 << 26, max_batch=4, prefill_chunk=CHUNK)
    svc.start()
    try:
        r0 = Run(svc, Prompt(doc0 + q[0], len(doc0)), 3)
        assert r0.done.wait(60)
        prompts = dict(d1=Prompt(doc1 + q[1], len(doc1)), d2=Prompt(doc2 + q[2], len(doc2)),
                       f=Prompt(doc0 + q[3], len(doc0)), p=Prompt(doc1 + q[3], len(doc1)))
        with svc._lock:  # all four arrive before the loop plans again
            runs = {k: Run(svc, p, 4) for k, p in prompts.items()}
        assert all(r.done.wait(60) for r in runs.values())
    finally:
        svc.shutdown()
    log = list(svc.step_log)
    d1, d2 = _steps(svc, runs["d1"].rid), _steps(svc, runs["d2"].rid)
    ext = {k: log.index(("E", runs[k].rid)) for k in ("f", "p")}
    assert len(d1) == 7 and len(d2) == 5  # each document prefilled once (6 and 4 chunks and their questions' rest)
    assert ext["f"] < d1[-1]  # the follow-up was not starved behind the new document
    assert d1[-1] < d2[0]  # documents start in arrival order, one at a time
    assert d1[-1] < ext["p"] < d2[-1]  # parked while doc1 filled, then it extended doc1
    assert runs["p"].events[-1].cached_tokens == len(doc1) and runs["f"].events[-1].cached_tokens == len(doc0)
    for k, p in prompts.items():
        assert runs[k].tokens == tiny.generate(p, max_new_tokens=4).token_ids, k


def _stop_mid_prefill(tiny, how: str):
    a, b = Prompt(_ids(6, 30), 25), Prompt(_ids(7, 8 * CHUNK), 8 * CHUNK - 5)
    svc = Scheduler(tiny, cache_bytes=1 << 26, max_batch=4, prefill_chunk=CHUNK, request_timeout=600)
    ex = svc.executor
    run, seen = ex.run, {}

    def run_and_stop(ops):
        out = run(ops)
        for op in ops:
            if isinstance(op, PrefillChunk) and op.rid == seen.get("b") and op.start == 3 * CHUNK:
                seen["filling"] = (dict(ex.filling), [svc.cache.used(r) for r in range(svc.cache.ranks)])
                if how == "cancel":
                    seen["ticket"].cancel()
                else:
                    svc._prefilling.arrived -= 1000  # past its deadline
        return out

    ex.run = run_and_stop
    ra = Run(svc, a, 24)
    svc.start()
    try:
        while not ra.tokens:
            ra.done.wait(0.01)
        before = [svc.cache.used(r) for r in range(svc.cache.ranks)]
        rb = Run(svc, b, 4)
        seen["b"], seen["ticket"] = rb.rid, rb.ticket
        assert ra.done.wait(60) and rb.done.wait(60)
    finally:
        svc.shutdown()
    filling, mid = seen["filling"]
    assert list(filling) and mid[0] > before[0]  # it stopped while b's entry was filling
    assert [svc.cache.used(r) for r in range(svc.cache.ranks)] == before and not ex.filling
    assert len(svc.cache.entries) == 1 and not ex.rows
    assert ra.tokens == tiny.generate(a, max_new_tokens=24).token_ids
    assert len(_steps(svc, rb.rid)) == 4 and not rb.tokens
    return rb.events[-1], svc.stats()


def test_cancel_mid_prefill_frees_the_filling_entry(tiny):
    ev, stats = _stop_mid_prefill(tiny, "cancel")
    assert ev.finish_reason == "cancelled" and stats["cancelled_total"] == 1


def test_timeout_mid_prefill_frees_the_filling_entry(tiny):
    ev, stats = _stop_mid_prefill(tiny, "timeout")
    assert ev.finish_reason == "error" and ev.error_code == "timeout" and "--request-timeout 600 s" in ev.error
    assert stats["timeouts_total"] == 1 and stats["errors_by_code"] == {"timeout": 1}


def test_serve_flags():
    args = parse_args([])
    assert args.prefill_chunk is None  # the service's default, shared with bench serve:
    assert default_prefill_chunk(torch.device("cuda"), 4) == 4 * 4096  # 4096 rows per CP rank (docs/results.md)
    assert default_prefill_chunk(torch.device("cpu"), 2) == 0 and args.request_timeout is None
    assert args.prefill_taper
    args = parse_args(["--prefill-chunk", "0", "--request-timeout", "30", "--no-prefill-taper"])
    assert args.prefill_chunk == 0 and args.request_timeout == 30
    assert not args.prefill_taper
    for bad in (["--prefill-chunk", "-1"], ["--request-timeout", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_tapered_prefill(tiny):
    """Past the model's knee (288 tokens for tiny) a document's chunks shrink; its tokens stay the whole
    prefill's. --no-prefill-taper keeps every chunk whole."""
    doc = Prompt(_ids(7, 600), 596)
    assert Scheduler(tiny, cache_bytes=1 << 26, prefill_chunk=CHUNK, prefill_taper=False).prefill_knee is None
    svc = Scheduler(tiny, cache_bytes=1 << 26, max_batch=4, prefill_chunk=CHUNK)
    assert svc.prefill_knee == prefill_knee(tiny.config) == 288
    bounds = tiny.runner.prefill_bounds(600, 596, CHUNK, svc.prefill_knee)
    assert len(bounds) > len(tiny.runner.prefill_bounds(600, 596, CHUNK)) and bounds[-2][1] - bounds[-2][0] < CHUNK
    run = Run(svc, doc, 6)
    svc.start()
    try:
        assert run.done.wait(60)
    finally:
        svc.shutdown()
    assert len(_steps(svc, run.rid)) == len(bounds)
    assert run.tokens == tiny.generate(doc, max_new_tokens=6).token_ids
