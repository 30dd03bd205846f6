"""Tile sizes of the MoE decode GEMVs (kernels/moe_decode.py) at the Qwen3-30B-A3B shape, one token
(8 pairs): microseconds per call from a CUDA graph of 20 calls, and the achieved read bandwidth. The down
kernel runs one program per (token, column slice) over the token's k experts, so it has k times fewer
programs than gate_up: its sweep reaches narrower slices and fewer warps. routed_gate_up (gate/up routing
its tokens itself) is swept over gate_up's tiles.

Then, at the default tiles: routing + gate/up launched apart (route_topk, expert_gate_up) against the one
launch (routed_gate_up), alone and with the down kernel after them (a layer's expert side), from CUDA
graphs (PDL on where the GPU has it); and a check that the one launch's act, weights and experts equal
the two launches' bit for bit, eager and replayed from a graph, at 1, 4 and 8 tokens, with and without
renormalization, on bf16 router GEMV logits and float32 logits. Exits 1 if any differ.

    python bench/tune_moe_decode.py --out tune.json
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import graph_time_us
from starshard.engine.moe import route
from starshard.kernels.moe_decode import expert_down, expert_gate_up, route_topk, routed_gate_up
from starshard.kernels.pdl import pdl_enabled

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev, E, k, H, Fw = torch.device("cuda"), 128, 8, 2048, 768
g = torch.Generator(device=dev).manual_seed(0)
w13 = (torch.randn(E, 2 * Fw, H, device=dev, generator=g) * 0.02).bfloat16()
w2 = (torch.randn(E, H, Fw, device=dev, generator=g) * 0.02).bfloat16()
router = (torch.randn(E, H, device=dev, generator=g) * 0.02).bfloat16()
x = torch.randn(1, H, device=dev, generator=g).bfloat16()
weights, experts = route(torch.randn(1, E, device=dev, generator=g), k, True)
act = expert_gate_up(x, experts, w13)
logits = F.linear(x, router)  # bf16, as the engine's router GEMV gives them


rows = []
gate_up_configs = [(n, kk, w) for n in (4, 8) for kk in (256, 512) for w in (2, 4)]  # unchanged kernel: near the best
down_configs = [(n, kk, w) for n in (1, 2, 4, 8) for kk in (256, 512, 1024) for w in (1, 2, 4)]
runs = [("gate_up", n, kk, w, k * 2 * Fw * H * 2,
         lambda n=n, kk=kk, w=w: expert_gate_up(x, experts, w13, block_n=n, block_k=kk, warps=w))
        for n, kk, w in gate_up_configs]
runs += [("routed_gate_up", n, kk, w, k * 2 * Fw * H * 2,
          lambda n=n, kk=kk, w=w: routed_gate_up(x, logits, w13, k, True, block_n=n, block_k=kk, warps=w))
         for n, kk, w in gate_up_configs]
runs += [("down", n, kk, w, k * H * Fw * 2,
          lambda n=n, kk=kk, w=w: expert_down(act, experts, weights, w2, block_n=n, block_k=kk, warps=w))
         for n, kk, w in down_configs]
for name, n, kk, w, nbytes, fn in runs:
    try:
        us = graph_time_us(fn)
    except Exception as e:  # a tile the compiler refuses
        rows.append({"kernel": name, "block_n": n, "block_k": kk, "warps": w, "error": str(e)[:200]})
        continue
    rows.append({"kernel": name, "block_n": n, "block_k": kk, "warps": w, "us": us, "tb_per_s": nbytes / us / 1e6})
for name in ("gate_up", "routed_gate_up", "down"):
    best = sorted((r for r in rows if r["kernel"] == name and "us" in r), key=lambda r: r["us"])[:4]
    print(name, best, flush=True)


# ---- routing + gate/up in two launches against one, default tiles, one token
def apart(x, logits, renormalize=True):
    w, e = route_topk(logits, k, renormalize)
    return expert_gate_up(x, e, w13), w, e


def one(x, logits, renormalize=True):
    return routed_gate_up(x, logits, w13, k, renormalize)


def layer(gate_up):
    def fn():
        a, w, e = gate_up(x, logits)
        return expert_down(a, e, w, w2, out_dtype=x.dtype)
    return fn


times = {"route_us": graph_time_us(lambda: route_topk(logits, k, True)),
         "gate_up_us": graph_time_us(lambda: expert_gate_up(x, experts, w13)),
         "route_then_gate_up_us": graph_time_us(lambda: apart(x, logits)),
         "routed_gate_up_us": graph_time_us(lambda: one(x, logits)),
         "layer_three_launches_us": graph_time_us(layer(apart)),
         "layer_two_launches_us": graph_time_us(layer(one))}
times["saved_us"] = times["route_then_gate_up_us"] - times["routed_gate_up_us"]
times["layer_saved_us"] = times["layer_three_launches_us"] - times["layer_two_launches_us"]
print("fused", json.dumps(times), flush=True)


def graphed(fn):
    """fn()'s outputs replayed from a CUDA graph (warmed up on a side stream, as graph_time_us)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


def with_down(gate_up, *a):
    act, w, e = gate_up(*a)
    return act, w, e, expert_down(act, e, w, w2, out_dtype=a[0].dtype)


names = ("act", "weights", "experts", "down")
checks = []
for T in (1, 4, 8):
    xt = torch.randn(T, H, device=dev, generator=g).bfloat16()
    for logit_dtype in ("bfloat16", "float32"):
        lt = F.linear(xt, router).to(getattr(torch, logit_dtype))
        for renorm in (True, False):
            want = with_down(apart, xt, lt, renorm)
            got = with_down(one, xt, lt, renorm)
            want_g = graphed(lambda: with_down(apart, xt, lt, renorm))
            got_g = graphed(lambda: with_down(one, xt, lt, renorm))
            row = {"tokens": T, "logits": logit_dtype, "renormalize": renorm,
                   "ties": int((lt.float().sort(dim=-1).values.diff(dim=-1) == 0).sum()),
                   "eager_equal": {n: torch.equal(a, b) for n, a, b in zip(names, got, want)},
                   "graph_equal": {n: torch.equal(a, b) for n, a, b in zip(names, got_g, want_g)},
                   "graph_equals_eager": {n: torch.equal(a, b) for n, a, b in zip(names, got_g, got)}}
            row["ok"] = all(all(row[c].values()) for c in ("eager_equal", "graph_equal", "graph_equals_eager"))
            checks.append(row)
            print("check", json.dumps(row), flush=True)
ok = all(r["ok"] for r in checks)
print("fused outputs equal the two launches':", ok, flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pdl": pdl_enabled(dev),
                   "shape": dict(E=E, k=k, H=H, F=Fw, tokens=1), "rows": rows, "fused": times,
                   "checks": checks, "ok": ok}, f, indent=1)
sys.exit(0 if ok else 1)
