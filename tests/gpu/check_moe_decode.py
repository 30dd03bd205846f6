"""One MoE layer's expert GEMMs at decode sizes on the GPU (Qwen3-30B-A3B shape by default): the Triton
expert GEMVs ("gemv") against grouped_mm ("grouped"), both against a float32 reference, and their time
per call replayed from a CUDA graph.

    python tests/gpu/check_moe_decode.py --out moe_decode.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import graph_time_us
from starshard.engine.moe import grouped_experts, route

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--experts", type=int, default=128)
ap.add_argument("--top-k", type=int, default=8)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--width", type=int, default=768)
ap.add_argument("--tokens", default="1,4,8", help="comma-separated token counts")
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev, E, k, H, F = torch.device("cuda"), args.experts, args.top_k, args.hidden, args.width
g = torch.Generator(device=dev).manual_seed(0)
w13 = (torch.randn(E, 2 * F, H, device=dev, generator=g) * 0.02).bfloat16()
w2 = (torch.randn(E, H, F, device=dev, generator=g) * 0.02).bfloat16()
rows = []
for T in map(int, args.tokens.split(",")):
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    weights, experts = route(torch.randn(T, E, device=dev, generator=g), k, True)
    want = grouped_experts(x.float(), weights, experts, w13.float(), w2.float(), impl="padded")
    row = {"tokens": T, "pairs": T * k}
    for impl in ("gemv", "grouped"):
        out = grouped_experts(x, weights, experts, w13, w2, impl=impl)
        row[f"{impl}_rel_err"] = ((out.float() - want).norm() / want.norm()).item()
        row[f"{impl}_us"] = graph_time_us(lambda: grouped_experts(x, weights, experts, w13, w2, impl=impl))
    chosen = experts.unique().numel()
    row["bytes_read"] = chosen * (3 * F * H) * 2
    row["bytes_bound_us"] = row["bytes_read"] / 4.8e12 * 1e6
    rows.append(row)
    print(json.dumps(row), flush=True)
result = {"device": torch.cuda.get_device_name(), "shape": dict(E=E, k=k, H=H, F=F), "rows": rows}
if args.out:
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
