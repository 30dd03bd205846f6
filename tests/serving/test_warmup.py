"""The service's start-up warm-up (serving/warmup.py, issue 36 "no stall"), forced on on CPU: it runs every
prefill step of the longest admitted document with the service's chunk and taper, and decode batch sizes
1..max_batch, on the model cut to one layer of each kind; afterwards the model's layers, the cache and the
executor are as before and the service's tokens equal a cold service's; a failing warm-up is logged and the
server serves cold; a windowed Gemma 3 keeps one local and one global layer. Over cp=2 (ring, Star), and ranks
whose warm-ups differ refusing to start: tests/serving/test_chunked_service_cp.py (one spawn for both)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import transformers

from starshard import LLM
from starshard.runtime.prompt import Prompt
from starshard.serving.executor import Fault
from starshard.serving.ops import Decode, Extend, PrefillChunk
from starshard.serving.scheduler import Scheduler
from starshard.serving.warmup import cut_layers, distinct_layers, layer_kind
from tests.engine.test_gemma import FAMILIES as GEMMA
from tests.helpers.hf_models import make_hf_model
from tests.helpers.service import submit

transformers.logging.set_verbosity_error()

CHUNK, KNEE, LONGEST = 32, 64, 300  # a tapered schedule: full chunks to 64 held tokens, then shrinking


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 200, n)]


def _serve(llm, **kw) -> tuple[dict, Scheduler]:
    """A document (chunked, tapered), then three questions on it decoding together, through one Scheduler."""
    doc = _ids(0, 150)
    prompts = dict(a=Prompt(doc + _ids(1, 5), 150), b=Prompt(doc + _ids(2, 5), 150), c=Prompt(doc + _ids(3, 5), 150),
                   d=Prompt(doc + _ids(4, 6), 150))
    svc = Scheduler(llm, cache_bytes=1 << 24, max_batch=4, prefill_chunk=CHUNK, prefill_knee_tokens=KNEE, **kw)
    svc.start()
    try:
        runs = {"a": submit(svc, prompts["a"], 6)}
        assert runs["a"][1].wait(60)
        with svc._lock:  # they arrive together: one batched extend, then decode as a batch
            runs |= {k: submit(svc, prompts[k], 6) for k in "bcd"}
        assert all(done.wait(60) for _, done in runs.values())
    finally:
        svc.shutdown()
    return {k: [e.token_id for e in ev if e.token_id is not None] for k, (ev, _) in runs.items()}, svc


@pytest.fixture(scope="module")
def tiny():
    return LLM(random_weights="tiny", progress=False)


def test_warmup_runs_the_schedule_and_leaves_no_trace(tiny, monkeypatch):
    cold, cold_svc = _serve(tiny, warmup=False)
    layers, ids = list(tiny.model.layers), list(tiny.model.layer_ids)
    seen = []  # (ops, held layers, batch rows) of each warm-up step

    def spy(svc):
        run = svc.executor.run

        def recording(ops):
            seen.append((ops, len(svc.executor.model.layers), len(svc.executor.rows)))
            return run(ops)
        svc.executor.run = recording

    orig = Scheduler._warm_up

    def warm_with_spy(self):
        spy(self)
        orig(self)
        del self.executor.run  # the requests' steps run unrecorded
    monkeypatch.setattr(Scheduler, "_warm_up", warm_with_spy)
    warm, svc = _serve(tiny, warmup=True, warmup_tokens=LONGEST)
    assert warm == cold and all(len(t) == 6 for t in warm.values())
    # every step of the longest document's tapered schedule, on one of tiny's two (alike) layers
    bounds = tiny.runner.prefill_bounds(LONGEST, LONGEST - 64, CHUNK, KNEE)
    chunks = [ops[0] for ops, _, _ in seen if isinstance(ops[0], PrefillChunk)]
    assert [(c.start, c.end) for c in chunks] == bounds and len({e - s for s, e in bounds}) > 1
    assert {n for _, n, _ in seen} == {1} and list(tiny.model.layers) == layers and tiny.model.layer_ids == ids
    decodes = [rows for ops, _, rows in seen if isinstance(ops[0], Decode)]
    # each batch size eager, then (on CUDA) captured; then k = 2, 3 follow-ups joining in one forward beside the
    # document's row
    assert decodes == [b for b in range(1, 5) for _ in range(2)] + [3, 4]
    extends = [len(ops) for ops, _, _ in seen if isinstance(ops[0], Extend)]
    assert extends == [1, 1, 1, 2, 3] and all(isinstance(op, Extend) for ops, _, _ in seen
                                              if isinstance(ops[0], Extend) for op in ops)
    # nothing of it is left: the cache, the executor, the counters are a cold service's
    stats, cold_stats = svc.stats(), cold_svc.stats()
    assert stats["warmup_s"] > 0 and cold_stats["warmup_s"] is None and cold_stats["warmup_phases_s"] is None
    phases = stats["warmup_phases_s"]  # its seconds by phase, for a JSON to say where a slow warm-up went
    assert set(phases) == {"prefill", "batches", "decode_graphs"} and min(phases.values()) >= 0
    assert phases["prefill"] > 0 and phases["batches"] > 0 and sum(phases.values()) == pytest.approx(stats["warmup_s"])
    for key in ("cache_bytes", "cache_entries", "cache_hits", "cache_lookups", "prefill_chunks_total",
                "prefill_tokens_total", "decode_tokens_total", "requests_total"):
        assert stats[key] == cold_stats[key], key
    assert list(svc.step_log) == list(cold_svc.step_log)
    assert sorted(e.id for e in svc.cache.entries.values()) == sorted(e.id for e in cold_svc.cache.entries.values())


def test_a_failing_warmup_is_logged_and_the_server_serves_cold(tiny, caplog, monkeypatch):
    orig = Scheduler.__init__

    def with_fault(self, *a, **kw):  # the warm-up's request (rid -1) fails after its first chunk
        orig(self, *a, **kw)
        self.executor.faults = [Fault("compute", -1, RuntimeError("injected into the warm-up's prefill"))]
    monkeypatch.setattr(Scheduler, "__init__", with_fault)
    with caplog.at_level(logging.ERROR, logger="starshard.serve"):
        warm, svc = _serve(tiny, warmup=True, warmup_tokens=LONGEST)
    monkeypatch.undo()
    cold, _ = _serve(tiny, warmup=False)
    assert warm == cold and svc.health() is None and svc.stats()["warmup_s"] is None
    assert "warm-up failed, serving cold" in caplog.text and "injected into the warm-up" in caplog.text
    assert svc.stats()["errors_by_code"] == {} and len(tiny.model.layers) == 2


def test_windowed_model_keeps_a_local_and_a_global_layer(tmp_path):
    arch, kw = GEMMA["gemma3"]  # 4 layers, every third global
    _, path = make_hf_model(arch, tmp_path / "gemma3", eos_token_id=None, initializer_range=0.1, **kw)
    llm = LLM(path, progress=False)
    model = llm.model
    keep = distinct_layers(model)
    windows = [layer_kind(model.layers[i])[0] for i in keep]
    assert len(keep) == 2 and windows[0] == 16 and windows[1] is None  # the first local layer, the first global
    before = list(model.layers)
    with cut_layers(model, keep):
        assert model.layer_ids == keep and len(model.layers) == 2
    assert list(model.layers) == before and model.layer_ids == list(range(4))
    doc = _ids(5, 60)
    prompt = Prompt(doc + _ids(6, 4), 60)
    svc = Scheduler(llm, cache_bytes=1 << 24, max_batch=2, prefill_chunk=16, warmup=True, warmup_tokens=120)
    svc.start()
    try:
        events, done = submit(svc, prompt, 5)
        assert done.wait(60)
    finally:
        svc.shutdown()
    assert svc.stats()["warmup_s"] > 0 and list(model.layers) == before
    assert [e.token_id for e in events if e.token_id is not None] == llm.generate(prompt, max_new_tokens=5).token_ids
