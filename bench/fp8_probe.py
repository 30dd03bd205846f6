"""FP8 kernels on one GPU: correctness against float64 and speed against bf16 (issue 19).

    python bench/fp8_probe.py --out fp8_probe.json [--quick]

1. row quantization: the Triton kernel equals the torch reference (bytes and scales);
2. fp8_linear, Llama-3.1-8B projection shapes: the weight-only decode kernel (1-64 rows) and the FP8
   GEMM (prefill rows) against a float64 matmul of the dequantized weight, and their time against
   bf16 F.linear (CUDA events, median);
3. split-KV decode attention over an e4m3 cache (per-(head, key) scales) against float64 on the
   dequantized cache, and its time against the bf16 cache at 128K keys (32 q / 8 KV heads, D 128);
4. per-layer output error: one Llama-3.1-8B-shape decoder layer (random weights) at 8K tokens, bf16
   vs --fp8 linear, and vs a KV cache written in e4m3 then read back.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from starshard.config import ModelConfig
from starshard.engine.model import Transformer
from starshard.kernels.decode import decode_attention
from starshard.kernels.fp8 import (
    dequantize,
    fp8_linear,
    quantize_rows,
    quantize_rows_cuda,
)
from starshard.parallel.fp8 import quantize_linears
from starshard.presets import PRESETS


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}

    x = torch.randn(1000, 4096, device=dev, dtype=torch.bfloat16) * 3
    q8, qs = quantize_rows_cuda(x)
    r8, rs = quantize_rows(x.cpu())  # the torch path
    res["quantize_rows"] = {"scale_rel": rel(qs.cpu(), rs),
                            "bytes_equal_frac": (q8.cpu().view(torch.uint8) == r8.view(torch.uint8)).float().mean().item()}
    print(res["quantize_rows"], flush=True)

    shapes = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}
    lin = {}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5
        w8, ws = quantize_rows(w)
        wd = dequantize(w8, ws, torch.float64)
        row = {}
        for M in ([1, 16, 64, 4096] if args.quick else [1, 7, 16, 64, 100, 8192, 32768]):
            xm = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = xm.double() @ wd.t()
            y = fp8_linear(xm, w8, ws)
            entry = {"rel_err_vs_f64_dequant": rel(y, ref), "rel_err_vs_bf16_weight": rel(y, xm.double() @ w.double().t())}
            if M in (1, 16, 64, 4096, 8192, 32768):
                entry["fp8_s"] = timed(lambda: fp8_linear(xm, w8, ws))
                entry["bf16_s"] = timed(lambda: F.linear(xm, w))
                entry["speedup"] = entry["bf16_s"] / entry["fp8_s"]
            row[M] = entry
            print(name, M, entry, flush=True)
        lin[name] = row
    res["linear"] = lin

    att = {}
    for Lk in [1000, 131072]:
        B, Hq, Hkv, D = 1, 32, 8, 128
        q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.bfloat16)
        k8, ks = quantize_rows(k)
        v8, vs = quantize_rows(v)
        pos = torch.arange(Lk, device=dev)
        qp = torch.tensor([Lk], device=dev)
        o8, l8 = decode_attention(q, k8, v8, q_pos=qp, k_pos=pos, causal=False, k_scale=ks, v_scale=vs)
        kd, vd = dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64)
        g = Hq // Hkv
        s = (q.double() @ kd.repeat_interleave(g, 1).transpose(-1, -2)) * D**-0.5
        ref = torch.softmax(s, -1) @ vd.repeat_interleave(g, 1)
        ob, _ = decode_attention(q, k, v, q_pos=qp, k_pos=pos, causal=False)
        entry = {"rel_err_vs_f64_dequant": rel(o8, ref), "lse_err": (l8.double() - torch.logsumexp(s, -1)).abs().max().item(),
                 "rel_err_vs_bf16_cache": rel(o8, ob)}
        if Lk > 1000:
            entry["fp8_s"] = timed(lambda: decode_attention(q, k8, v8, q_pos=qp, k_pos=pos, causal=False, k_scale=ks, v_scale=vs))
            entry["bf16_s"] = timed(lambda: decode_attention(q, k, v, q_pos=qp, k_pos=pos, causal=False))
            entry["speedup"] = entry["bf16_s"] / entry["fp8_s"]
        att[Lk] = entry
        print("decode", Lk, entry, flush=True)
    res["decode_attention"] = att

    cfg = ModelConfig.from_hf(dict(PRESETS["llama-3.1-8b"], num_hidden_layers=1))
    torch.manual_seed(1)
    with torch.device(dev):
        model = Transformer(cfg).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() == 2 else torch.nn.init.ones_(p)
    layer = model.layers[0]
    L = 2048 if args.quick else 8192
    h = torch.randn(1, L, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(L, device=dev)
    cos, sin = model.rope(pos)
    cos, sin = cos.to(dev, torch.bfloat16), sin.to(dev, torch.bfloat16)
    with torch.inference_mode():
        ref = layer(h, cos, sin, pos, None)
        quantize_linears(model)
        got = layer(h, cos, sin, pos, None)
    res["layer_linear_rel_err"] = rel(got, ref)
    print("layer --fp8 linear rel err", res["layer_linear_rel_err"], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
