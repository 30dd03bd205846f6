"""The service's decode graphs that serve any entry on CUDA (cascade.TableCascade, Executor._table_graph): the
warm-up keeps one graph per batch size at the smallest own-KV capacity, and later batches on one entry, of
other documents and compositions, replay them (bound, not captured) with the tokens the model gives alone."""
import numpy as np
import pytest
import torch

from starshard import LLM
from starshard.runtime.prompt import Prompt
from starshard.serving import executor as executor_mod
from starshard.serving.cascade import CascadeAttention
from starshard.serving.scheduler import Scheduler
from tests.helpers.service import submit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: `python -m pytest tests/gpu`")
STEPS = 6


def test_batches_on_one_entry_replay_the_kept_graphs_and_answer_as_the_model(monkeypatch):
    captured = []  # per-batch captures (CascadeAttention graphs) after the warm-up

    class Counting(executor_mod.CascadeGraph):
        def __init__(self, model, cascade, *a, **k):
            super().__init__(model, cascade, *a, **k)
            if isinstance(cascade, CascadeAttention):
                captured.append(cascade)

    monkeypatch.setattr(executor_mod, "CascadeGraph", Counting)
    tiny = LLM(random_weights="tiny", progress=False, device="cuda", dtype=torch.float32)
    svc = Scheduler(tiny, cache_bytes=1 << 28, max_batch=4, warmup=True)
    svc.start()
    answers = []  # (prompt, tokens): compared once the service is down (it hooks the shared model)
    try:
        ex = svc.executor
        kept = ex._tables[executor_mod.TABLE_MIN_CAPACITY].graphs
        assert sorted(kept) == [1, 2, 3, 4] and all(g.graph is not None for g in kept.values())
        captured.clear()
        rng = np.random.default_rng(5)
        for doc_len, n in ((301, 3), (77, 2), (1024, 4), (77, 1)):
            doc = [int(x) for x in rng.integers(1, 500, doc_len)]
            questions = [[int(x) for x in rng.integers(1, 500, 5 + j)] for j in range(n)]
            first = submit(svc, Prompt(doc + questions[0], doc_len), STEPS)  # the document's prefill
            assert first[1].wait(120)
            asks = [submit(svc, Prompt(doc + q, doc_len), STEPS) for q in questions]  # follow-ups: one batch
            for (events, done), q in zip(asks, questions):
                assert done.wait(120)
                answers.append((doc + q, [e.token_id for e in events if e.token_id is not None]))
                assert events[-1].cached_tokens >= doc_len
        assert captured == []  # every batch was on one entry with a short question: bound, never captured
        assert sorted(ex._tables) == [executor_mod.TABLE_MIN_CAPACITY]
    finally:
        svc.shutdown()
    for prompt, got in answers:
        assert got == tiny.generate(prompt, max_new_tokens=STEPS).token_ids
