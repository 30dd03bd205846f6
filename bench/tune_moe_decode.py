"""Tile sizes of the MoE decode GEMVs (kernels/moe_decode.py) at the Qwen3-30B-A3B shape, one token
(8 pairs): microseconds per call from a CUDA graph of 20 calls, and the achieved read bandwidth.

    python bench/tune_moe_decode.py --out tune.json
"""
import argparse
import json

import torch

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
flat, tok = experts.reshape(-1), torch.zeros(k, dtype=torch.long, device=dev)
act = expert_gate_up(x, tok, flat, w13)


def time_us(fn):
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / 200


rows = []
configs = [(n, kk, w) for n in (4, 8, 16, 32) for kk in (128, 256, 512) for w in (2, 4, 8)]
for n, kk, w in configs:
    for name, fn, nbytes in (
        ("gate_up", lambda: expert_gate_up(x, tok, flat, w13, block_n=n, block_k=kk, warps=w), k * 2 * F * H * 2),
        ("down", lambda: expert_down(act, flat, weights.reshape(-1), w2, block_n=2 * n, block_k=kk, warps=w), k * H * F * 2),
    ):
        try:
            us = time_us(fn)
        except Exception as e:  # a tile the compiler refuses
            rows.append({"kernel": name, "block_n": n, "block_k": kk, "warps": w, "error": str(e)[:200]})
            continue
        rows.append({"kernel": name, "block_n": n if name == "gate_up" else 2 * n, "block_k": kk, "warps": w,
                     "us": us, "tb_per_s": nbytes / us / 1e6})
for name in ("gate_up", "down"):
    best = sorted((r for r in rows if r["kernel"] == name and "us" in r), key=lambda r: r["us"])[:4]
    print(name, best, flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
