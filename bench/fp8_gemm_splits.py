"""Does cuBLAS's e4m3 GEMM run the Llama-8B MLP projections faster in other shapes? (issue 19, 128K prefill)

    python bench/fp8_gemm_splits.py [--rows 131072] [--rounds 7] [--out fp8_gemm_splits.json]

At 128K rows the `--fp8 linear,kv` prefill's four GEMMs ran at 1250-1460 TFLOP/s, w13 (4096 -> 2 x 14336)
the slowest (bench/results/2026-11-26-gpu-fp8-prefill). Each variant computes the same product as
torch._scaled_mm with row / channel scales and fast accumulation (kernels/fp8.py scaled_mm):
- whole: one call [M, K] x [K, N];
- n_halves: two calls of N / 2 columns (w13's gate and up apart);
- m_chunks2 / m_chunks4: the rows in 2 / 4 calls;
- swapped: W x^T, the output transposed ([N, M]);
- tensorwise: one scale per operand (not what the engine does: is the row-scale epilogue the cost?).
Interleaved rounds, CUDA events per call, median per variant; TFLOP/s; the cuBLAS kernel each ran (from
torch.profiler); GPU SM clock and power sampled by nvidia-smi during the rounds. JSON to stdout and --out.
"""
import argparse
import json
import statistics
import subprocess

import torch
from torch.profiler import ProfilerActivity, profile

from starshard.benchmarks.common import commit
from starshard.kernels.fp8 import quantize_rows_cuda

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rows", type=int, default=131072)
ap.add_argument("--rounds", type=int, default=7)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device("cuda")
SHAPES = {"w13": (28672, 4096), "w2": (4096, 14336), "wqkv": (6144, 4096)}
M = args.rows
g = torch.Generator(device=dev).manual_seed(0)


def mm(a8, sa, b8, sb):
    return torch._scaled_mm(a8, b8.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def variants(x8, sx, w8, sw):
    N = w8.shape[0]
    one = torch.ones((), device=dev)
    return {
        "whole": lambda: mm(x8, sx, w8, sw),
        "n_halves": lambda: [mm(x8, sx, w8[: N // 2], sw[: N // 2]), mm(x8, sx, w8[N // 2 :], sw[N // 2 :])],
        "m_chunks2": lambda: [mm(x8[s : s + M // 2], sx[s : s + M // 2], w8, sw) for s in range(0, M, M // 2)],
        "m_chunks4": lambda: [mm(x8[s : s + M // 4], sx[s : s + M // 4], w8, sw) for s in range(0, M, M // 4)],
        "swapped": lambda: mm(w8, sw, x8, sx),
        "tensorwise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                               use_fast_accum=True),
    }


def event_ms(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
                       stdout=subprocess.PIPE, text=True)
results = []
for name, (N, K) in SHAPES.items():
    x8, sx = quantize_rows_cuda(torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g))
    w8, sw = quantize_rows_cuda(torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.02)
    vs = variants(x8, sx, w8, sw)
    ref = vs["whole"]().float()
    ms = {v: [] for v in vs}
    for fn in vs.values():
        fn()
    for _ in range(args.rounds):
        for v, fn in vs.items():
            ms[v].append(event_ms(fn))
    kernels = {}
    for v, fn in vs.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels[v] = sorted({e.key[:90] for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA})
    flops = 2 * M * N * K
    row = {"proj": name, "M": M, "N": N, "K": K, "variants": {}}
    for v in vs:
        med = statistics.median(ms[v])
        row["variants"][v] = {"ms": round(med, 3), "tflops": round(flops / med / 1e9, 1), "kernels": kernels[v]}
    swapped = vs["swapped"]().float().t()
    row["swapped_max_abs_diff"] = (swapped - ref).abs().max().item()
    results.append(row)
    print(json.dumps({k: v for k, v in row.items()}), flush=True)
    del x8, w8, ref, swapped
smi.terminate()
samples = [tuple(float(v) for v in line.split(",")) for line in smi.stdout.read().splitlines() if "," in line]
clock = [c for c, _ in samples]
power = [p for _, p in samples]
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(), "rows": M,
       "results": results, "sm_clock_mhz": {"min": min(clock), "median": statistics.median(clock), "max": max(clock)},
       "power_w": {"min": min(power), "median": statistics.median(power), "max": max(power)}}
print(json.dumps({k: out[k] for k in ("sm_clock_mhz", "power_w")}))
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
