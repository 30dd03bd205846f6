"""Tile sizes of the MoE decode GEMVs (kernels/moe_decode.py) at the Qwen3-30B-A3B shape, one token
(8 pairs): microseconds per call from a CUDA graph of 20 calls, and the achieved read bandwidth. The down
kernel runs one program per (token, column slice) over the token's k experts, so it has k times fewer
programs than gate_up: its sweep reaches narrower slices and fewer warps.

    python bench/tune_moe_decode.py --out tune.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import graph_time_us
from starshard.engine.moe import route
from starshard.kernels.moe_decode import expert_down, expert_gate_up

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev, E, k, H, F = torch.device("cuda"), 128, 8, 2048, 768
g = torch.Generator(device=dev).manual_seed(0)
w13 = (torch.randn(E, 2 * F, H, device=dev, generator=g) * 0.02).bfloat16()
w2 = (torch.randn(E, H, F, device=dev, generator=g) * 0.02).bfloat16()
x = torch.randn(1, H, device=dev, generator=g).bfloat16()
weights, experts = route(torch.randn(1, E, device=dev, generator=g), k, True)
act = expert_gate_up(x, experts, w13)


rows = []
gate_up_configs = [(n, kk, w) for n in (4, 8) for kk in (256, 512) for w in (2, 4)]  # unchanged kernel: near the best
down_configs = [(n, kk, w) for n in (1, 2, 4, 8) for kk in (256, 512, 1024) for w in (1, 2, 4)]
runs = [("gate_up", n, kk, w, k * 2 * F * H * 2,
         lambda n=n, kk=kk, w=w: expert_gate_up(x, experts, w13, block_n=n, block_k=kk, warps=w))
        for n, kk, w in gate_up_configs]
runs += [("down", n, kk, w, k * H * F * 2,
          lambda n=n, kk=kk, w=w: expert_down(act, experts, weights, w2, block_n=n, block_k=kk, warps=w))
         for n, kk, w in down_configs]
for name, n, kk, w, nbytes, fn in runs:
    try:
        us = graph_time_us(fn)
    except Exception as e:  # a tile the compiler refuses
        rows.append({"kernel": name, "block_n": n, "block_k": kk, "warps": w, "error": str(e)[:200]})
        continue
    rows.append({"kernel": name, "block_n": n, "block_k": kk, "warps": w, "us": us, "tb_per_s": nbytes / us / 1e6})
for name in ("gate_up", "down"):
    best = sorted((r for r in rows if r["kernel"] == name and "us" in r), key=lambda r: r["us"])[:4]
    print(name, best, flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
