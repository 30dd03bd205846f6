"""What every benchmark shares: timing, the commit and device recorded with a result, JSON writing."""
from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def commit(short: bool = True) -> str:
    """The checkout's git commit (short by default), or "unknown" where there is no git."""
    cmd = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"
    return out or "unknown"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def today() -> str:
    return datetime.date.today().isoformat()


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# Nominal HBM bytes per second by device name (vendor datasheets), for bytes-bound figures: the first
# key contained in torch.cuda.get_device_name() wins (the H100 SXM part reports "H100 80GB HBM3").
NOMINAL_HBM_BYTES_PER_SECOND = {
    "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12,
}


def nominal_hbm_bandwidth(device: torch.device) -> float | None:
    """The device's nominal HBM bytes per second from NOMINAL_HBM_BYTES_PER_SECOND, None if not listed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for key, v in NOMINAL_HBM_BYTES_PER_SECOND.items() if key in name), None)


def timed(fn, device: torch.device, repeats: int, warmup: int = 1, barrier=None) -> list[float]:
    """Seconds per call of fn(): `warmup` untimed calls, then `repeats` timed ones, each synchronised
    (CUDA events on GPU, perf_counter on CPU). barrier: called before each timed call, so that every
    rank of a parallel job starts together."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def back_to_back(fn, device: torch.device, calls: int, warmup: int = 2) -> dict:
    """fn() `calls` times with no sync between calls (as a serving loop runs steps), one event pair around
    each: seconds per call over the whole run, the device's busy time per call (median) and its idle time
    between calls (median, sum), which is the host's launch time showing. CPU: host clocks (no idle)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return {"seconds_per_call": (time.perf_counter() - t) / calls}
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    torch.cuda.synchronize(device)
    for start, end in events:
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    busy = [a.elapsed_time(b) / 1e3 for a, b in events]
    idle = [b0.elapsed_time(a1) / 1e3 for (_, b0), (a1, _) in zip(events, events[1:])]
    return {"seconds_per_call": events[0][0].elapsed_time(events[-1][1]) / 1e3 / calls,
            "busy_s_median": statistics.median(busy), "idle_between_s_median": statistics.median(idle) if idle else 0.0,
            "idle_between_s_sum": sum(idle)}


def device_spans(prof) -> list[tuple[float, float, str]]:
    """(start_us, end_us, name) of every kernel, copy and memset a torch.profiler run saw on the device, in time
    order (from its trace, the profiler's record of the device's own clock)."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def kernel_gaps(spans: list[tuple[float, float, str]], longest: int = 0) -> dict:
    """The device's busy and idle time (seconds) from its activity `spans` (device_spans): busy is their
    union (overlapping streams count once), idle the time between the first start and the last end that no
    span covers, `gaps` how many stretches that is; with `longest`, the longest gaps and the spans either
    side (the host's launches or syncs show as gaps)."""
    if not spans:
        return {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "gaps": 0, "longest_gaps": []}
    gaps = []
    end, before = spans[0][1], spans[0][2]
    for s0, s1, name in spans[1:]:
        if s0 > end:
            gaps.append({"s": (s0 - end) / 1e6, "after": before[:80], "before": name[:80]})
        if s1 > end:
            end, before = s1, name
    span = (end - spans[0][0]) / 1e6
    idle = sum(g["s"] for g in gaps)
    return {"span_s": span, "busy_s": span - idle, "idle_s": idle, "gaps": len(gaps),
            "longest_gaps": sorted(gaps, key=lambda g: -g["s"])[:longest]}


def device_idle(fn, device: torch.device, longest: int = 5) -> dict:
    """fn() once more, under torch.profiler recording the device only: kernel_gaps of what it ran (CUDA)."""
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return kernel_gaps(device_spans(prof), longest)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float | None:
    """Bytes per second of a device-to-device copy (each byte read once and written once); None off CUDA."""
    if device.type != "cuda":
        return None
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = statistics.median(timed(lambda: y.copy_(x), device, 5, warmup=2))
    return 2 * nbytes / t  # x and y are freed with this frame


def _captured(fn, calls: int, warmup: int, copies: int | None) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `calls` calls of fn, replayed once. The warm-up runs on a side stream
    (compilation, autotuning and allocations stay out of the capture). copies: fn takes an index and
    call i gets i % copies."""
    def call(i):
        return fn(i % copies) if copies else fn()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_replay_us(fn, calls: int = 20, replays: int = 10, *, warmup: int = 3, copies: int | None = None) -> list[float]:
    """Microseconds per call in each of `replays` replays, each timed alone, of one CUDA graph of `calls`
    calls of fn (see graph_time_us). copies: fn(i) with i % copies, so that each call can read its own copy
    of the data (from HBM, not L2)."""
    graph = _captured(fn, calls, warmup, copies)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / calls)
    return out


def graph_time_us(fn, calls: int = 20, replays: int = 10, *, best: bool = False, warmup: int = 3,
                  copies: int | None = None) -> float:
    """Microseconds per call of fn() replayed from one CUDA graph of `calls` calls: the kernels' device
    time without launch overhead, as a CUDA-graph decode step runs them. The warm-up runs on a side
    stream (compilation, autotuning and allocations stay out of the capture). best: the fastest of
    `replays` replays (each timed alone); else the mean over `replays` back-to-back replays. copies: as
    graph_replay_us."""
    if best:
        return min(graph_replay_us(fn, calls, replays, warmup=warmup, copies=copies))
    graph = _captured(fn, calls, warmup, copies)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def timed_median(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """The median of timed(): seconds per call."""
    return statistics.median(timed(fn, device, repeats, warmup))


def median(xs):
    return statistics.median(xs) if xs else None


def ints(s: str) -> list[int]:
    """A comma-separated list of integers (argparse type)."""
    return [int(x) for x in s.split(",")]


def add_common_arguments(p) -> None:
    """The flags of the model-level benchmarks (prefill, attention, hf)."""
    p.add_argument("--lengths", type=ints, default=[8192], help="comma-separated prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median reported)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="compute dtype")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (launch that many ranks)")


def save_json(path: str | Path, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def write(out: str | None, result: dict) -> None:
    """Print the run's JSON, and write it to `out` when given."""
    print(json.dumps(result, indent=1))
    if out:
        save_json(out, result)


def header(kind: str, device: torch.device, gpus: int, args, **extra) -> dict:
    """The fields every result of launch/bench.py's model benchmarks opens with."""
    return {"kind": kind, "device": device_name(device), "gpus": gpus, "date": today(), "commit": commit(),
            **extra, "args": vars(args)}
