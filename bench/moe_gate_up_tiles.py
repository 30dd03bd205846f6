"""Tiles of the MoE decode's routed gate/up and down GEMVs (kernels/moe_decode.py) at the Qwen3-30B-A3B shape,
one token, each call routed to its own experts (router logits drawn per copy), so that the expert weights come
from HBM as in a decode step (every layer has its own experts) rather than from L2 (bench/tune_moe_decode.py
routes every call to the same 8 experts, 50 MB, about the L2's size). Microseconds per call from a CUDA graph
and the achieved read bandwidth; every tile's output against the default tile's (the float32 sums run in
another order: equal to rounding, not bit for bit).

    python bench/moe_gate_up_tiles.py --out tiles.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, graph_time_us
from starshard.kernels.moe_decode import DOWN_TILE, GATE_UP_TILE, expert_down, routed_gate_up

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", required=True)
ap.add_argument("--copies", type=int, default=16, help="routes cycled through (each its own 8 experts)")
args = ap.parse_args()
dev, E, k, H, Fw = torch.device("cuda"), 128, 8, 2048, 768
g = torch.Generator(device=dev).manual_seed(0)
w13 = (torch.randn(E, 2 * Fw, H, device=dev, generator=g) * 0.02).bfloat16()
w2 = (torch.randn(E, H, Fw, device=dev, generator=g) * 0.02).bfloat16()
x = torch.randn(1, H, device=dev, generator=g).bfloat16()
logits = [torch.randn(1, E, device=dev, generator=g).bfloat16() for _ in range(args.copies)]
routed = [routed_gate_up(x, lg, w13, k, True) for lg in logits]  # default tile: the reference outputs

res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
       "default_gate_up": GATE_UP_TILE, "default_down": DOWN_TILE, "rows": []}
gate_up_bytes, down_bytes = k * 2 * Fw * H * 2, k * H * Fw * 2
for n, kk, w in [(4, 512, 2), (4, 512, 4), (4, 1024, 4), (4, 2048, 4), (4, 2048, 8), (8, 1024, 4), (8, 2048, 8),
                 (2, 2048, 4), (2, 1024, 2), (8, 512, 4)]:
    tile = dict(block_n=n, block_k=kk, warps=w)
    diff = max(((routed_gate_up(x, lg, w13, k, True, **tile)[0].float() - ref[0].float()).abs().max()
                / ref[0].float().abs().max()).item() for lg, ref in zip(logits, routed))
    us = graph_time_us(lambda i: routed_gate_up(x, logits[i], w13, k, True, **tile), 16, best=True, copies=args.copies)
    row = {"kernel": "routed_gate_up", **tile, "us": us, "tb_per_s": gate_up_bytes / us / 1e6, "max_rel_diff": diff}
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
for n, kk, w in [(1, 1024, 1), (1, 1024, 2), (2, 1024, 2), (1, 512, 1), (4, 1024, 4)]:
    tile = dict(block_n=n, block_k=kk, warps=w)
    us = graph_time_us(lambda i: expert_down(routed[i][0], routed[i][2], routed[i][1], w2, out_dtype=x.dtype, **tile),
                       16, best=True, copies=args.copies)
    row = {"kernel": "down", **tile, "us": us, "tb_per_s": down_bytes / us / 1e6}
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
best = min((r for r in res["rows"] if r["kernel"] == "routed_gate_up" and r["max_rel_diff"] < 1e-2), key=lambda r: r["us"])
res["best_gate_up"] = {key: best[key] for key in ("block_n", "block_k", "warps")}
print("best gate_up", json.dumps(res["best_gate_up"]), flush=True)
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
