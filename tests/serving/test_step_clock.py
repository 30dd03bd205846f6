"""StepClock: each step's busy time and the idle time before it, drained in order (host clock off CUDA)."""
from __future__ import annotations

import time

import pytest

from starshard.serving.ops import Decode, PrefillChunk
from starshard.serving.step_clock import StepClock, StepTime, idle_summary, idle_while, step_kind, step_timeline


def test_busy_and_idle_between_steps():
    clock = StepClock("cpu")
    for kind, work, idle in (("P", 0.02, 0.0), ("P", 0.02, 0.03), ("D", 0.01, 0.0)):
        time.sleep(idle)
        clock.begin(kind)
        time.sleep(work)
        clock.end()
    steps = clock.drain()
    assert [s.kind for s in steps] == ["P", "P", "D"] and steps[0].idle_before_s is None
    assert steps[1].idle_before_s >= 0.03 and steps[1].busy_s >= 0.02
    p = idle_summary(steps, "P")
    assert p["steps"] == 2 and p["idle_between_s_median"] >= 0.03 and p["busy_s_sum"] >= 0.04
    assert clock.drain() == []
    clock.begin("D")
    clock.end()
    assert clock.drain()[0].idle_before_s is not None  # measured from the last drained step's end
    clock.begin("D")
    clock.cancel()  # a step that queued no work
    assert clock.drain() == []


def test_step_kind():
    chunk = PrefillChunk(rid=1, entry=1, start=0, end=4, prompt_len=8, context_len=8, chunk=4, knee=None,
                         ids=[1] * 8, max_tokens=2, sampling=None, head_len=0)
    assert step_kind([chunk, Decode()]) == "PD" and step_kind([]) == ""


def test_timeline_folds_runs_of_one_kind():
    steps = [StepTime("E", 0.004, None), StepTime("D", 0.002, 0.001), StepTime("D", 0.003, 0.0005),
             StepTime("F", 0.0001, 0.0), StepTime("D", 0.002, 0.0)]
    assert step_timeline(steps) == [["E", 1, 4.0, 0.0], ["D", 2, 5.0, 1.5], ["F", 1, 0.1, 0.0], ["D", 1, 2.0, 0.0]]


def test_idle_while_counts_the_gaps_around_a_leave():
    steps = [StepTime("E", 0.004, 0.5), StepTime("D", 0.002, 0.001), StepTime("F", 0.0001, 0.010),
             StepTime("D", 0.002, 0.008), StepTime("F", 0.0001, 0.3)]
    assert idle_while(steps, "D") == pytest.approx(0.018)  # not the 0.5 before the first decode, nor the end's 0.3
    assert idle_summary(steps, "D")["idle_between_s_sum"] == 0  # decode after decode only: blind to the leave
    assert idle_while(steps, "P") == 0.0
