"""Follow-up questions waiting together start together: the scheduler admits every waiting extend that
fits in one step, and the executor runs those of one entry with one shape in one forward. Each answer
equals the request run alone; a fault in one of them fails it alone (the batch is retried one by one)."""
from __future__ import annotations

import numpy as np
import torch

from starshard import LLM
from starshard.runtime.prompt import Prompt
from starshard.serving.executor import Fault
from starshard.serving.scheduler import Scheduler
from tests.helpers.service import submit

STEPS = 5


def _submit(svc, prompt):
    return submit(svc, prompt, STEPS)


def _tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def _run(fault_rid=None):
    torch.manual_seed(0)
    llm = LLM(random_weights="tiny", progress=False)
    rng = np.random.default_rng(3)
    doc = [int(x) for x in rng.integers(1, 500, 83)]
    questions = [[int(x) for x in rng.integers(1, 500, 6)] for _ in range(4)]
    prompts = [Prompt(doc + q, len(doc)) for q in questions]
    solo = [llm.generate(p, max_new_tokens=STEPS).token_ids for p in prompts]
    svc = Scheduler(llm, cache_bytes=1 << 30, max_batch=8)
    ex = svc.executor
    if fault_rid is not None:
        ex.faults = [Fault("prepare", fault_rid, torch.OutOfMemoryError("CUDA out of memory (injected)"))]
    batches = []
    together = ex._extend_together
    ex._extend_together = lambda ops, tokens, failures: (batches.append(len(ops)), together(ops, tokens, failures))
    svc.start()
    try:
        first = _submit(svc, Prompt(doc + [7, 8, 9], len(doc)))  # prefills the document
        assert first[1].wait(60)
        with svc._lock:  # the four questions wait together before the next step plans
            runs = [_submit(svc, p) for p in prompts]
        assert all(done.wait(60) for _, done in runs)
    finally:
        svc.shutdown()
    return solo, [ev for ev, _ in runs], batches, svc


def test_waiting_questions_start_in_one_forward_and_answer_as_alone():
    solo, runs, batches, svc = _run()
    assert batches == [4]
    for ref, events in zip(solo, runs):
        assert _tokens(events) == ref
        assert events[-1].finish_reason == "length" and events[-1].cached_tokens == 83
    assert svc.cache.hits == 4 and not svc.executor.rows


def test_a_fault_in_one_batched_question_fails_it_alone():
    solo, runs, batches, svc = _run(fault_rid=3)  # rid 1 is the document; 2..5 the questions
    assert batches == [4]
    failed = runs[1]
    assert failed[-1].finish_reason == "error" and failed[-1].error_code == "insufficient_memory"
    for i in (0, 2, 3):
        assert _tokens(runs[i]) == solo[i]
    assert svc.health() is None and not svc.executor.rows
