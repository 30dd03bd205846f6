"""The device's view of the service's steps: when each step's work began and ended on the compute stream,
so a benchmark can tell how long the device worked on a step and how long it sat idle between two steps
(the host late to queue the next one). CUDA: events recorded at the step's start and end, read only when
asked (no host sync in the loop); elsewhere the host clock, where idle time means the host's own gaps."""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from starshard.serving.ops import (
    Abort,
    Decode,
    Demote,
    Evict,
    Extend,
    Finish,
    JoinTail,
    Prefill,
    PrefillChunk,
    Promote,
    ReadTail,
)

_LETTERS = {Prefill: "P", PrefillChunk: "P", Extend: "E", Decode: "D", Demote: "M", Promote: "M", ReadTail: "M",
            JoinTail: "M", Evict: "F", Finish: "F", Abort: "F"}


def mark(cuda: bool):
    """Now on the current stream: a CUDA event (readable once the stream has passed it), else the host clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(a, b) -> float:
    """Seconds from mark `a` to mark `b` (CUDA: once the stream has passed `b`)."""
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3


@dataclass
class StepTime:
    kind: str  # the step's operations, one letter each (serving/ops.py): "P" a prefill or chunk, "D" a decode ...
    busy_s: float  # start to end of the step's work on the device
    idle_before_s: float | None  # the device's idle time since the previous step's end (None: the first kept)


class StepClock:
    """Marks each step's start and end; `drain()` hands back the steps marked since the last drain."""

    def __init__(self, device, keep: int = 100_000):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: deque = deque(maxlen=keep)  # (kind, start mark, end mark)
        self._open = None
        self._last_end = None  # the end mark of the last step drained: the next one's idle is measured from it

    def begin(self, kind: str) -> None:
        self._open = (kind, mark(self.cuda))

    def end(self) -> None:
        if self._open is not None:
            self._marks.append((*self._open, mark(self.cuda)))
            self._open = None

    def cancel(self) -> None:
        """Forget the open step: it queued no work (a decode with nothing left to issue)."""
        self._open = None

    def drain(self) -> list[StepTime]:
        """Every step marked since the last drain (waits for the last one to end on the device)."""
        marks = list(self._marks)
        self._marks.clear()
        if not marks:
            return []
        if self.cuda:
            marks[-1][2].synchronize()
        out, prev = [], self._last_end
        for kind, start, end in marks:
            idle = None if prev is None else max(0.0, seconds_between(prev, start))
            out.append(StepTime(kind, seconds_between(start, end), idle))
            prev = end
        self._last_end = prev
        return out


def step_kind(ops) -> str:
    """One letter per operation: P prefill (whole or a chunk), E extend, D decode, M a move between tiers,
    F finish / abort / evict; "" for an empty step."""
    return "".join(_LETTERS.get(type(op), "?") for op in ops)


def idle_summary(steps: list[StepTime], kind: str) -> dict:
    """The device's idle time before each step of `kind` that followed a step of the same kind (a chunk
    after a chunk), and their busy times: medians, the largest, the sums."""
    gaps = [s.idle_before_s for a, s in zip(steps, steps[1:]) if kind in a.kind and kind in s.kind
            and s.idle_before_s is not None]
    busy = [s.busy_s for s in steps if kind in s.kind]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"steps": len(busy), "busy_s_median": med(busy), "busy_s_sum": sum(busy),
            "idle_between_s_median": med(gaps), "idle_between_s_max": max(gaps) if gaps else None,
            "idle_between_s_sum": sum(gaps)}


def idle_while(steps: list[StepTime], kind: str) -> float:
    """The device's idle time from the first step of `kind` to the last, whatever ran between them (a request
    joining or leaving a decoding batch): the gaps before every step after the first of `kind`."""
    at = [j for j, s in enumerate(steps) if kind in s.kind]
    return sum(s.idle_before_s or 0.0 for s in steps[at[0] + 1:at[-1] + 1]) if at else 0.0


def step_timeline(steps: list[StepTime]) -> list[list]:
    """`steps` in order as [kind, count, busy ms, idle ms before each]: consecutive steps of one kind fold into
    one entry (sums), so a run of decode steps reads as one line beside the steps between them."""
    out: list[list] = []
    for s in steps:
        idle = 1e3 * (s.idle_before_s or 0.0)
        if out and out[-1][0] == s.kind:
            out[-1][1] += 1
            out[-1][2] += 1e3 * s.busy_s
            out[-1][3] += idle
        else:
            out.append([s.kind, 1, 1e3 * s.busy_s, idle])
    return [[k, n, round(b, 3), round(i, 3)] for k, n, b, i in out]
