"""Driving a Scheduler from a test: submit a request and collect its token events."""
from __future__ import annotations

import threading

from starshard.config import SamplingConfig


def submit(svc, prompt, max_tokens: int, sampling: SamplingConfig | None = None):
    """svc.submit(prompt) -> (events, done): every TokenEvent in order; `done` is set at the final one."""
    events, done = [], threading.Event()

    def on_event(ev):
        events.append(ev)
        if ev.finish_reason is not None:
            done.set()

    svc.submit(prompt, max_tokens=max_tokens, sampling=sampling or SamplingConfig(), on_event=on_event)
    return events, done
