"""Host time per launch of the FP8 prefill's ops against their bf16 counterparts at a short prompt's size (issue 19:
`--fp8 linear,kv` is slower than bf16 below ~1K tokens, where the prefill is bound by the host).

    python bench/launch_overhead.py [--rows 256] [--calls 2000] [--out launch_overhead.json]

Each op is called --calls times back to back without a sync (the host's time per call is then what it
takes to issue it, as long as the GPU keeps up), then once synced; reported: us per call on the host and
the GPU's own time per call (CUDA events around the whole loop / calls). Llama-8B shapes: hidden 4096,
wqkv 6144 outputs, 32 heads of 128.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import commit
from starshard.kernels.activation import quantize_heads, rms_norm_quant, silu_mul_quant, silu_mul_rows
from starshard.kernels.fp8 import quantize_rows_cuda, scaled_mm
from starshard.kernels.rope import rope_qk

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rows", type=int, default=256)
ap.add_argument("--calls", type=int, default=2000)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev, M = torch.device("cuda"), args.rows
x = torch.randn(M, 4096, device=dev, dtype=torch.bfloat16)
w = torch.randn(6144, 4096, device=dev, dtype=torch.bfloat16) * 0.02
nw = torch.ones(4096, device=dev, dtype=torch.bfloat16)
x8, sx = quantize_rows_cuda(x)
w8, sw = quantize_rows_cuda(w)
gu = torch.randn(M, 2 * 14336, device=dev, dtype=torch.bfloat16)
o = torch.randn(1, 32, M, 128, device=dev, dtype=torch.bfloat16)
q, k = torch.randn(1, 32, M, 128, device=dev, dtype=torch.bfloat16), torch.randn(1, 8, M, 128, device=dev, dtype=torch.bfloat16)
cos, sin = (torch.randn(M, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
OPS = {
    "F.rms_norm (bf16)": lambda: F.rms_norm(x, (4096,), nw, 1e-5),
    "rms_norm_quant (Triton)": lambda: rms_norm_quant(x, nw, 1e-5),
    "F.linear (bf16 GEMM)": lambda: F.linear(x, w),
    "scaled_mm (e4m3 GEMM)": lambda: scaled_mm(x8, sx, w8, sw, None, torch.bfloat16),
    "transposing copy (bf16 wo input)": lambda: o.transpose(1, 2).reshape(M, 4096),
    "quantize_heads (Triton)": lambda: quantize_heads(o),
    "silu_mul_rows (Triton)": lambda: silu_mul_rows(gu),
    "silu_mul_quant (Triton)": lambda: silu_mul_quant(gu),
    "x + y (aten add)": lambda: x + x,
    "rope_qk (Triton)": lambda: rope_qk(q, k, cos, sin, None, None, eps=0.0),
}
rows = []
for name, fn in OPS.items():
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for _ in range(args.calls):
        fn()
    host = time.perf_counter() - t
    b.record()
    torch.cuda.synchronize()
    r = {"op": name, "host_us_per_call": round(1e6 * host / args.calls, 2),
         "loop_us_per_call": round(1e3 * a.elapsed_time(b) / args.calls, 2)}
    rows.append(r)
    print(json.dumps(r), flush=True)
out = {"device": torch.cuda.get_device_name(), "commit": commit(), "rows": M, "calls": args.calls, "ops": rows}
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
