"""A step that runs past SLOW_STEP_S is logged with what it ran, and stats() keeps the last few."""
from __future__ import annotations

import logging
import threading

from starshard import LLM
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt
from starshard.serving import scheduler as scheduler_mod
from starshard.serving.scheduler import Scheduler


def test_slow_steps_are_logged_and_kept(monkeypatch, caplog):
    monkeypatch.setattr(scheduler_mod, "SLOW_STEP_S", 0.0)  # every step counts as slow
    llm = LLM(random_weights="tiny", progress=False)
    svc = Scheduler(llm, cache_bytes=1 << 30, prefill_chunk=16)
    done = threading.Event()
    svc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="starshard.serve"):
            svc.submit(Prompt(list(range(1, 41)), 40), max_tokens=3, sampling=SamplingConfig(),
                       on_event=lambda ev: ev.finish_reason is not None and done.set())
            assert done.wait(60)
    finally:
        svc.shutdown()
    kept = svc.stats()["slow_steps"]
    assert [what for _, what in kept[:3]] == ["PrefillChunk 0:16", "PrefillChunk 16:32", "PrefillChunk 32:40"]
    assert any(what == "Decode" for _, what in kept) and all(s >= 0 for s, _ in kept)
    assert "slow step:" in caplog.text and "PrefillChunk 16:32" in caplog.text
