"""A step that runs past SLOW_STEP_S is kept in stats() with what it ran, and logged when other requests
waited on it (a lone document's chunks are no stall, and a decode step after which nothing runs is not
logged)."""
from __future__ import annotations

import logging
import threading

from starshard import LLM
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving import scheduler as scheduler_mod
from starshard.serving.scheduler import Scheduler


def _ask(svc, ids, max_tokens):
    done = threading.Event()
    svc.submit(Prompt(ids, len(ids)), max_tokens=max_tokens, sampling=SamplingConfig(),
               on_event=lambda ev: ev.finish_reason is not None and done.set())
    return done


def test_slow_steps_are_kept_and_logged_when_others_wait(monkeypatch, caplog):
    monkeypatch.setattr(scheduler_mod, "SLOW_STEP_S", 0.0)  # every step counts as slow
    llm = LLM(random_weights="tiny", progress=False)
    svc = Scheduler(llm, cache_bytes=1 << 30, prefill_chunk=16)
    svc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="starshard.serve"):
            assert _ask(svc, list(range(1, 41)), 3).wait(60)
            alone = caplog.text
            caplog.clear()
            first = _ask(svc, list(range(101, 141)), 40)  # decodes while the second prefills
            second = _ask(svc, list(range(201, 241)), 3)
            assert first.wait(60) and second.wait(60)
            together = caplog.text
    finally:
        svc.shutdown()
    kept = svc.stats()["slow_steps"]
    assert all(s >= 0 for s, _ in kept)
    assert "PrefillChunk" not in alone  # nothing waited on the lone document's chunks
    decode_lines = [line for line in alone.splitlines() if "slow step:" in line]
    assert decode_lines and all("Decode" in line and "0 requests" not in line for line in decode_lines)
    assert "slow step:" in together and "PrefillChunk 16:32" in together and "requests waited" in together


def test_slow_steps_keep_what_ran(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "SLOW_STEP_S", 0.0)
    llm = LLM(random_weights="tiny", progress=False)
    svc = Scheduler(llm, cache_bytes=1 << 30, prefill_chunk=16)
    svc.start()
    try:
        assert _ask(svc, list(range(1, 41)), 3).wait(60)
    finally:
        svc.shutdown()
    kept = svc.stats()["slow_steps"]
    assert [what for _, what in kept[:3]] == ["PrefillChunk 0:16", "PrefillChunk 16:32", "PrefillChunk 32:40"]
    assert any(what == "Decode" for _, what in kept)
