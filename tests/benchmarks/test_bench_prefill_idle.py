"""The GPU's idle time within a prefill (`bench prefill --idle`, bench/profile_prefill.py --gaps): the device's
activity read from a torch.profiler trace, busy time as the union of its spans, idle time as what they leave
uncovered between the first and the last. The profiler's CUDA trace needs a GPU: here a trace file stands in
for it, and --idle is refused on the CPU before anything loads."""
import argparse
import json

import pytest

from starshard.benchmarks import prefill
from starshard.benchmarks.common import device_spans, kernel_gaps


class _Trace:
    """What device_spans reads of a profiler: its chrome trace."""

    def __init__(self, events):
        self.events = events

    def export_chrome_trace(self, path):
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events}, f)


def test_device_spans_keeps_the_devices_kernels_copies_and_sets_in_time_order():
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 30.0, "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 50.0},  # the host's: not the device
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 5.0, "dur": 2.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 6.0, "dur": 1.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 12.0, "dur": 1.0},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 30.0},
    ]
    assert device_spans(_Trace(events)) == [(5.0, 7.0, "Memcpy HtoD"), (12.0, 13.0, "Memset"), (30.0, 40.0, "gemm")]


def test_kernel_gaps_counts_overlaps_once_and_names_the_longest_gap():
    spans = [(0.0, 100.0, "a"), (20.0, 60.0, "inside a"), (90.0, 150.0, "overlaps a"),  # busy 0..150
             (400.0, 450.0, "b"),  # 250 us idle before it
             (460.0, 470.0, "c"), (470.0, 500.0, "d")]  # 10 us idle, then back to back
    got = kernel_gaps(spans, longest=1)
    assert got["gaps"] == 2
    assert got["span_s"] == pytest.approx(500e-6)
    assert got["idle_s"] == pytest.approx(260e-6)
    assert got["busy_s"] == pytest.approx(240e-6)
    assert got["longest_gaps"] == [{"s": pytest.approx(250e-6), "after": "overlaps a", "before": "b"}]
    assert kernel_gaps([(0.0, 5.0, "x")]) == {"span_s": 5e-6, "busy_s": 5e-6, "idle_s": 0.0, "gaps": 0,
                                              "longest_gaps": []}
    assert kernel_gaps([])["busy_s"] == 0.0


def test_idle_is_refused_on_the_cpu():
    ap = argparse.ArgumentParser()
    prefill.add_arguments(ap)
    error = prefill.check(ap.parse_args(["--random-weights", "tiny", "--lengths", "256", "--device", "cpu", "--idle"]))
    assert error is not None and "--idle" in error and "CPU" in error
