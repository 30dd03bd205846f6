"""Driving a Scheduler from a test: submit a request and collect its token events; the cascade tests' own-KV
pool with a few tokens already held."""
from __future__ import annotations

import threading
import time

import torch

from starshard.config import SamplingConfig
from starshard.serving.cascade import OwnKV


def submit(svc, prompt, max_tokens: int, sampling: SamplingConfig | None = None):
    """svc.submit(prompt) -> (events, done): every TokenEvent in order; `done` is set at the final one."""
    events, done = [], threading.Event()

    def on_event(ev):
        events.append(ev)
        if ev.finish_reason is not None:
            done.set()

    svc.submit(prompt, max_tokens=max_tokens, sampling=sampling or SamplingConfig(), on_event=on_event)
    return events, done


def settle_writes(svc, timeout: float = 30.0) -> None:
    """Wait until every background disk write the service started is committed or given up on every rank."""
    deadline = time.monotonic() + timeout
    while svc.executor.writes:
        assert time.monotonic() < deadline, f"disk writes still open: {list(svc.executor.writes)}"
        time.sleep(0.01)


def pool_with_history(prefix: list[int], hkv: int, d: int, new: int, held: int = 3):
    """An OwnKV (layer 0) whose row b already holds `held` random tokens right after its shared prefix
    prefix[b], room for `new` more; -> (pool, their k, v [B, hkv, held, d], positions [B, held])."""
    pool = OwnKV([0], len(prefix), hkv, d, held + 1 + new, torch.float32, "cpu")
    k, v = torch.randn(len(prefix), hkv, held, d), torch.randn(len(prefix), hkv, held, d)
    pos = torch.stack([torch.arange(p, p + held) for p in prefix])
    pool.append(0, k, v, pos)
    pool.advance(held)
    return pool, k, v, pos
