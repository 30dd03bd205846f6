"""Watching a run from outside the model: progress messages, a heartbeat watchdog and the
fault-injection test hook, attached through `RunCallbacks` (which the generation loop calls) and
forward hooks on the model; nothing is patched.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("starshard.run")


class RunCallbacks:
    """What the generation loop (runtime/generate.py) reports; the defaults do nothing."""

    def prefill_start(self, prompt_tokens: int) -> None: ...

    def prefill_end(self) -> None: ...

    def decode_step(self, step: int) -> None:
        """Before decode step `step` (1 = the first token after the prefill's)."""


FAULT_ENV = "STARSHARD_FAULT_INJECT"


@dataclass(frozen=True)
class FaultInjection:
    """Test hook: STARSHARD_FAULT_INJECT=RANK:STEP[:MODE] makes global rank RANK die (MODE exit, the
    default: os._exit(43), no clean-up, like a crash) or hang (MODE hang: sleeps forever) when it
    reaches STEP: 0 is the start of the prefill, k the k-th decode step. RunMonitor calls
    `maybe_fire` at those points; nothing else reads the variable."""

    rank: int
    step: int
    mode: str = "exit"

    @classmethod
    def from_env(cls, env=None) -> "FaultInjection | None":
        raw = (os.environ if env is None else env).get(FAULT_ENV, "").strip()
        if not raw:
            return None
        parts = raw.split(":")
        try:
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("exit", "hang")):
                raise ValueError
            return cls(int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "exit")
        except ValueError:
            raise ValueError(f"{FAULT_ENV}={raw!r}: expected RANK:STEP or RANK:STEP:exit|hang (a test hook; "
                             f"unset it for normal runs)") from None

    def maybe_fire(self, rank: int, step: int) -> None:
        if (rank, step) != (self.rank, self.step):
            return
        sys.stderr.write(f"rank {rank}: {FAULT_ENV} fault injected at step {step}: {self.mode}\n")
        sys.stderr.flush()
        if self.mode == "exit":
            os._exit(43)
        while True:  # hang: the others must notice through their collective timeout
            time.sleep(3600)


class Watchdog(threading.Thread):
    """Ends this rank when it makes no progress (no layer forward, no decode step) for `limit_s`.

    Collectives give up after --dist-timeout, so a rank waiting on a dead peer fails by itself; a rank
    stuck outside a collective (or whose peers all left) would not, and across nodes no launcher ends
    it. The limit is 2 x --dist-timeout + 10 s: well past any single layer's legitimate time."""

    def __init__(self, limit_s: float, rank: int):
        super().__init__(daemon=True, name="starshard-watchdog")
        self.limit_s, self.rank = limit_s, rank
        self.last = time.monotonic()
        self.done = threading.Event()

    def beat(self, *_) -> None:
        self.last = time.monotonic()

    def run(self) -> None:
        while not self.done.wait(min(5.0, self.limit_s / 4)):
            idle = time.monotonic() - self.last
            if idle > self.limit_s:
                sys.stderr.write(f"error: rank {self.rank}: no progress for {idle:.0f} s (over 2 x --dist-timeout + "
                                 "10 s): this rank is stuck or its peers are gone; ending it\n")
                sys.stderr.flush()
                os._exit(1)


class RunMonitor(RunCallbacks):
    """Rank 0's progress messages (prefill forwards / CP segments / chunks, decode rate), the
    watchdog's heartbeat (each layer's forward and each decode step) and the fault-injection hook."""

    def __init__(self, model, max_new: int, rank: int, watchdog: Watchdog | None = None):
        self.watchdog = watchdog
        self.fault = FaultInjection.from_env()
        self.rank, self.max_new = rank, max_new
        self.total, self.in_prefill, self.forwards, self.rows = 0, False, 0, 0
        self.every = max(1, max_new // 10)
        self.t_decode = None
        model.register_forward_pre_hook(self._on_forward)
        if watchdog is not None:
            for layer in model.layers:
                layer.register_forward_pre_hook(watchdog.beat)

    def prefill_start(self, prompt_tokens: int) -> None:
        self._fire(0)
        self.total, self.in_prefill, self.forwards, self.rows = prompt_tokens, True, 0, 0

    def prefill_end(self) -> None:
        self.in_prefill = False
        log.info("prefill: done, %d forward(s), %d rows on this rank (prompt %d tokens)", self.forwards, self.rows,
                 self.total)
        self.t_decode = time.perf_counter()

    def decode_step(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()
        self._fire(step)
        if step % self.every == 0:
            dt = time.perf_counter() - self.t_decode
            log.info("decode: %d/%d tokens, %.1f tok/s", step, self.max_new, (step - 1) / dt if dt else 0.0)

    def _on_forward(self, module, args):
        if self.in_prefill and args:
            self.forwards += 1
            n = args[0].shape[1]
            self.rows += n
            log.info("prefill: forward %d, %d rows (%d rows so far on this rank; prompt %d tokens)",
                     self.forwards, n, self.rows, self.total)

    def _fire(self, step: int) -> None:
        if self.fault is not None:
            self.fault.maybe_fire(self.rank, step)
