"""Tiles of the FP8 weight-only GEMV (kernels/fp8.py, decode with up to GEMV_MAX_ROWS rows) on the
Llama-3.1-8B projection shapes, one row: microseconds per call from a CUDA graph, against torch's bf16
linear (cuBLAS) on the same shapes, and the weight bytes per second each reaches.

    python bench/fp8_gemv_tune.py --out fp8_gemv_tune.json
"""
import argparse
import json

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import graph_time_us
from starshard.kernels.fp8 import GEMV_TILE, quantize_rows, weight_only_linear

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rows", type=int, default=1)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device("cuda")
SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}


tiles = [dict(block_n=n, block_k=k, warps=w) for n in (4, 8, 16) for k in (512, 1024, 2048) for w in (2, 4, 8)]
rows, totals = [], {}
for name, (N, K) in SHAPES.items():
    w = torch.randn(N, K, device=dev).bfloat16() / K**0.5
    w8, ws = quantize_rows(w)
    x = torch.randn(args.rows, K, device=dev).bfloat16()
    want = x.double() @ (w8.double() * ws.double()[:, None]).t()
    bf16_us = graph_time_us(lambda: F.linear(x, w))
    rows.append({"shape": name, "N": N, "K": K, "kernel": "bf16 cuBLAS", "us": bf16_us, "tb_per_s": N * K * 2 / bf16_us / 1e6})
    totals.setdefault("bf16 cuBLAS", 0.0)
    totals["bf16 cuBLAS"] += bf16_us
    for t in tiles:
        key = f"gemv n{t['block_n']} k{t['block_k']} w{t['warps']}"
        try:
            y = weight_only_linear(x, w8, ws, gemv_tile=t)
            err = ((y.double() - want).norm() / want.norm()).item()
            us = graph_time_us(lambda: weight_only_linear(x, w8, ws, gemv_tile=t))
        except Exception as e:  # a tile the compiler refuses
            rows.append({"shape": name, "kernel": key, "error": str(e)[:200]})
            continue
        rows.append({"shape": name, "N": N, "K": K, "kernel": key, "us": us, "tb_per_s": N * K / us / 1e6, "rel_err": err})
        totals[key] = totals.get(key, 0.0) + us
best = sorted(totals.items(), key=lambda kv: kv[1])[:5]
print("default", GEMV_TILE, "sum over the four shapes (us):", best, "bf16:", totals["bf16 cuBLAS"], flush=True)
for r in rows:
    if r.get("kernel") in ("bf16 cuBLAS", best[0][0]):
        print(r, flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows_per_call": args.rows, "rows": rows,
                   "sum_us": totals}, f, indent=1)
