"""The host one step ahead (Executor.lookahead): a decode step's tokens stay on the device and are read at the
end of the next step, once its work is queued. From the executor's trace, step k + 1 is issued before step
k's tokens are read, and no decode runs past max_tokens; EOS, max_tokens, cancel and timeout stream no token past their end; the tokens equal the
serialized loop's (lookahead off), in one process and over cp=2 ring and Star (gloo), with batches that change
and seeded sampling."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from starshard import LLM
from starshard.config import ParallelConfig, SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving.executor import Executor
from starshard.serving.scheduler import Scheduler
from starshard.serving.step_clock import StepClock
from tests.helpers.mp_harness import run_ranks
from tests.helpers.service import submit


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 500, n)]


def _service(llm, lookahead: bool, **kw) -> Scheduler:
    svc = Scheduler(llm, cache_bytes=1 << 28, max_batch=4, **kw)
    svc.executor.lookahead = lookahead
    return svc


def _streams(llm, lookahead: bool):
    """Four requests that join and leave a running batch (greedy and seeded sampling) -> their token lists."""
    svc = _service(llm, lookahead)
    svc.start()
    try:
        hot = SamplingConfig(temperature=0.9, top_p=0.95, seed=5)
        runs = [submit(svc, Prompt(_ids(1, 30), 26), 12),
                submit(svc, Prompt(_ids(2, 41), 37), 5, hot)]
        assert runs[0][1].wait(60)  # the batch changes: one leaves, two join
        runs += [submit(svc, Prompt(_ids(3, 19), 15), 9, hot), submit(svc, Prompt(_ids(1, 30) + [7, 8], 26), 7)]
        assert all(done.wait(60) for _, done in runs)
    finally:
        svc.shutdown()
    return [[e.token_id for e in events if e.token_id is not None] for events, _ in runs]


def test_issue_before_read_and_same_tokens_as_serialized():
    llm = LLM(random_weights="tiny", progress=False)
    serialized = _streams(llm, lookahead=False)
    svc = _service(llm, True)
    svc.executor.trace = trace = []
    svc.executor.clock = clock = StepClock("cpu")
    svc.start()
    try:
        events, done = submit(svc, Prompt(_ids(9, 33), 29), 10)
        assert done.wait(60)
    finally:
        svc.shutdown()
    issued = {k: i for i, (what, k) in enumerate(trace) if what == "issue"}
    read = {k: i for i, (what, k) in enumerate(trace) if what == "read"}
    assert all(issued[k + 1] < read[k] for k in read if k + 1 in issued)
    assert len(issued) == 9  # the prefill's token, then 9 decodes: none past max_tokens
    assert sum("D" in st.kind for st in clock.drain()) == 9  # and no empty decode step on the clock
    assert [e.token_id for e in events if e.token_id is not None] == llm.generate(Prompt(_ids(9, 33), 29),
                                                                                    max_new_tokens=10).token_ids
    assert _streams(llm, lookahead=True) == serialized
    assert [len(t) for t in serialized] == [12, 5, 9, 7]  # max_tokens: not one token more


def test_room_past_the_end_only_beside_another_row(monkeypatch):
    """A row alone is never decoded past its last token, so its own KV gets no lookahead slot (the longest
    document a cache admits is the serialized loop's); beside another row, whose decodes may run one step past
    this row's end before the host reads it, the pool keeps one more. Both batches run to max_tokens (an append
    past a pool's capacity raises on the CPU)."""
    from starshard.serving.cascade import OwnKV
    gathered, gather = [], OwnKV.gather

    def spy(parts, extra, *a, **kw):
        gathered.append((len(parts), extra))
        return gather(parts, extra, *a, **kw)

    monkeypatch.setattr(OwnKV, "gather", staticmethod(spy))
    llm = LLM(random_weights="tiny", progress=False)
    svc = _service(llm, True)
    svc.start()
    try:
        events, done = submit(svc, Prompt(_ids(6, 27), 23), 8)
        assert done.wait(60)
        alone = list(gathered)
        runs = [submit(svc, Prompt(_ids(7, 31), 27), 9), submit(svc, Prompt(_ids(8, 22), 18), 3)]
        assert all(d.wait(60) for _, d in runs)
    finally:
        svc.shutdown()
    assert alone == [(1, 7)]  # max_tokens 8: the prefill's token, then 7 decodes
    assert len([e for e in events if e.token_id is not None]) == 8
    assert 2 in [n for n, _ in gathered]
    assert [len([e for e in ev if e.token_id is not None]) for ev, _ in runs] == [9, 3]
    # the admission's count of the pool: (own, remaining) per row
    assert Executor.pool_extra([7]) == 7 and Executor.pool_extra([7, 2]) == 8
    assert Executor.pool_capacity([(0, 7)]) == 7 and Executor.pool_capacity([(0, 7), (5, 2)]) == 13


@pytest.mark.parametrize("end", ["eos", "cancel", "timeout"])
def test_no_token_past_the_end(end, monkeypatch):
    llm = LLM(random_weights="tiny", progress=False)
    prompt = Prompt(_ids(4, 25), 21)
    ref = llm.generate(prompt, max_new_tokens=12).token_ids
    svc = _service(llm, True)
    if end == "eos":
        monkeypatch.setattr(llm, "eos_ids", {ref[4]})
    events, done = [], threading.Event()
    tickets = []

    def on_event(ev):
        events.append(ev)
        got = sum(e.token_id is not None for e in events)
        if end == "cancel" and got == 3 and ev.finish_reason is None:
            tickets[0].cancel()
        if end == "timeout" and got == 3 and ev.finish_reason is None:
            svc.request_timeout = 0.0  # every running request is past it from now on
        if ev.finish_reason is not None:
            done.set()

    svc.start()
    try:
        tickets.append(svc.submit(prompt, max_tokens=12, sampling=SamplingConfig(), on_event=on_event))
        assert done.wait(60)
    finally:
        svc.shutdown()
    toks = [e.token_id for e in events if e.token_id is not None]
    want = {"eos": ref[: ref.index(ref[4]) + 1], "cancel": ref[:3], "timeout": ref[:3]}[end]
    assert toks == want and events[-1].finish_reason == {"eos": "stop", "cancel": "cancelled",
                                                         "timeout": "error"}[end]
    assert sum(e.finish_reason is not None for e in events) == 1


def _cp_rank(rank, world, strategy, lookahead):
    llm = LLM(random_weights="tiny", progress=False, parallel=ParallelConfig(cp=world, cp_strategy=strategy))
    svc = _service(llm, lookahead, prefill_chunk=16)
    if rank != 0:
        svc.serve_forever()
        return None
    svc.start()
    try:
        hot = SamplingConfig(temperature=0.8, seed=3)
        runs = [submit(svc, Prompt(_ids(1, 40), 36), 9), submit(svc, Prompt(_ids(2, 50), 46), 6, hot)]
        assert runs[1][1].wait(60)
        runs.append(submit(svc, Prompt(_ids(1, 40) + [5, 6, 7], 36), 5))
        assert all(done.wait(60) for _, done in runs)
    finally:
        svc.shutdown()
    return [[e.token_id for e in events if e.token_id is not None] for events, _ in runs]


def _cp_both(rank, world, strategy):
    return {look: _cp_rank(rank, world, strategy, look) for look in (False, True)}


@pytest.mark.parametrize("strategy", ["ring", "star"])
def test_cp2_tokens_equal_the_serialized_loop(strategy):
    out = run_ranks(_cp_both, 2, strategy)[0]
    assert out[True] == out[False] and [len(t) for t in out[True]] == [9, 6, 5]
