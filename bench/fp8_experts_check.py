"""--fp8 experts' decode kernels on one GPU: e4m3 experts with row scales against the bf16 ones.

Qwen3-30B-A3B expert shapes (128 experts, 8 per token, hidden 2048, width 768), one token, each call routed
to its own experts (router logits drawn per copy, so the experts come from HBM as in a decode step; 16
routes cycled). For bf16 and e4m3 weights (quantize_rows: one float32 scale per expert row): the routed
gate/up and the down kernel (kernels/moe_decode.py) in us per call from a CUDA graph with PDL, and their
output against a float32 product on the weights they hold (bf16, or e4m3 dequantized), plus the e4m3
output against the bf16 one (what quantizing the experts changes).

    python bench/fp8_experts_check.py --out fp8_experts.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, graph_time_us, timed_median
from starshard.kernels.fp8 import dequantize, quantize_rows
from starshard.engine.moe import grouped_experts, route
from starshard.kernels.moe_decode import expert_down, routed_gate_up

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--copies", type=int, default=16)
ap.add_argument("--sweep", action="store_true", help="also time e4m3 gate/up and down tiles, and dequantize")
ap.add_argument("--prefill-tokens", type=lambda s: [int(v) for v in s.split(",")], default=[],
                help="comma-separated token counts: also run grouped_experts on each (prefill): the FP8 grouped GEMMs "
                     "against the reference rounding on dequantized weights and against bf16, error and time")
ap.add_argument("--out", required=True)
args = ap.parse_args()
dev, E, k, H, Fw = torch.device("cuda"), 128, 8, 2048, 768
g = torch.Generator(device=dev).manual_seed(0)
w13 = (torch.randn(E, 2 * Fw, H, device=dev, generator=g) * 0.02).bfloat16()
w2 = (torch.randn(E, H, Fw, device=dev, generator=g) * 0.02).bfloat16()
x = torch.randn(1, H, device=dev, generator=g).bfloat16()
logits = [torch.randn(1, E, device=dev, generator=g).bfloat16() for _ in range(args.copies)]
w13_8, s13 = quantize_rows(w13)
w2_8, s2 = quantize_rows(w2)
held = {"bf16": (w13, None, w2, None), "e4m3": (w13_8, s13, w2_8, s2)}


def step(name, i):
    a, sa, b, sb = held[name]
    act, weights, experts = routed_gate_up(x, logits[i], a, k, True, w13_scale=sa)
    return expert_down(act, experts, weights, b, out_dtype=x.dtype, w2_scale=sb), act, weights, experts


def reference(name, weights, experts):
    a, sa, b, sb = held[name]
    a = a.float() if sa is None else dequantize(a, sa, torch.float32)
    b = b.float() if sb is None else dequantize(b, sb, torch.float32)
    out = torch.zeros(1, H, device=dev)
    for wj, ej in zip(weights[0], experts[0].long()):
        h = a[ej] @ x[0].float()
        out[0] += wj * (b[ej] @ (torch.nn.functional.silu(h[:Fw]) * h[Fw:]))
    return out


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


res = {"bench": "fp8_experts_check", "device": torch.cuda.get_device_name(), "commit": commit(), "rows": []}
outs = {}
for name in held:
    y, act, weights, experts = step(name, 0)
    outs[name] = y
    row = {"weights": name, "rel_err_vs_float32_of_held": rel(y, reference(name, weights, experts)),
           "gate_up_us": graph_time_us(lambda i, n=name: routed_gate_up(x, logits[i], held[n][0], k, True,
                                                                         w13_scale=held[n][1]),
                                       16, best=True, copies=args.copies),
           "step_us": graph_time_us(lambda i, n=name: step(n, i)[0], 16, best=True, copies=args.copies)}
    row["down_us"] = row["step_us"] - row["gate_up_us"]
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
res["e4m3_vs_bf16_rel"] = rel(outs["e4m3"], outs["bf16"])
print("e4m3 output vs bf16 output:", res["e4m3_vs_bf16_rel"], flush=True)
if args.sweep:  # e4m3 tiles (BLOCK_N, BLOCK_K, warps): half the bytes per element of the bf16-tuned ones
    res["gate_up_tiles"], res["down_tiles"] = [], []
    ref_act = [routed_gate_up(x, lg, w13_8, k, True, w13_scale=s13) for lg in logits]
    for n, kk, w in [(4, 512, 2), (4, 1024, 2), (4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 2048, 4), (8, 2048, 8),
                     (2, 2048, 2), (16, 1024, 4), (8, 512, 2), (2, 1024, 1)]:
        tile = dict(block_n=n, block_k=kk, warps=w)
        us = graph_time_us(lambda i: routed_gate_up(x, logits[i], w13_8, k, True, w13_scale=s13, **tile), 16,
                           best=True, copies=args.copies)
        row = {**tile, "us": us, "max_rel_diff": max(rel(routed_gate_up(x, lg, w13_8, k, True, w13_scale=s13, **tile)[0],
                                                         r[0]) for lg, r in zip(logits, ref_act))}
        res["gate_up_tiles"].append(row)
        print("gate_up", json.dumps(row), flush=True)
    for n, kk, w in [(1, 1024, 1), (2, 1024, 1), (2, 1024, 2), (4, 1024, 2), (4, 1024, 4), (8, 1024, 4), (1, 1024, 2),
                     (4, 512, 2), (2, 512, 1)]:
        tile = dict(block_n=n, block_k=kk, warps=w)
        us = graph_time_us(lambda i: expert_down(ref_act[i][0], ref_act[i][2], ref_act[i][1], w2_8, out_dtype=x.dtype,
                                                 w2_scale=s2, **tile), 16, best=True, copies=args.copies)
        row = {**tile, "us": us}
        res["down_tiles"].append(row)
        print("down", json.dumps(row), flush=True)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        t0.record()
        dequantize(w13_8, s13, torch.bfloat16), dequantize(w2_8, s2, torch.bfloat16)
        t1.record()
        t1.synchronize()
    res["dequantize_layer_ms"] = t0.elapsed_time(t1)
    print("dequantize one layer's experts (ms):", res["dequantize_layer_ms"], flush=True)
res["prefill"] = []
for tokens in args.prefill_tokens:  # prefill-sized calls: "grouped_fp8" (picked on a GPU that runs it) vs the reference
    xs = torch.randn(tokens, H, device=dev, generator=g).bfloat16()
    pw, pe = route(torch.randn(tokens, E, device=dev, generator=g), k, True)
    fp8 = grouped_experts(xs, pw, pe, w13_8, w2_8, w13_scale=s13, w2_scale=s2)
    ref = grouped_experts(xs, pw, pe, w13_8, w2_8, impl="grouped", w13_scale=s13, w2_scale=s2)
    bf = grouped_experts(xs, pw, pe, w13, w2)
    row = {"tokens": tokens, "fp8_vs_reference_rel": rel(fp8, ref), "fp8_vs_bf16_rel": rel(fp8, bf)}
    for name, fn in (("fp8_ms", lambda: grouped_experts(xs, pw, pe, w13_8, w2_8, w13_scale=s13, w2_scale=s2)),
                     ("reference_ms", lambda: grouped_experts(xs, pw, pe, w13_8, w2_8, impl="grouped", w13_scale=s13,
                                                              w2_scale=s2)),
                     ("bf16_ms", lambda: grouped_experts(xs, pw, pe, w13, w2))):
        row[name] = 1e3 * timed_median(fn, dev, 5, 2)
    res["prefill"].append(row)
    print("prefill", json.dumps(row), flush=True)
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
