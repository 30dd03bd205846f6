"""Tune the FP8 decode kernels on one GPU (issue 19): every time is a CUDA-graph replay of 20 calls
(decode runs from graphs; eager timing of a 10 us kernel measures the host).

    python bench/fp8_tune.py --out fp8_tune.json
"""
import argparse
import json

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import graph_time_us
from starshard.kernels.decode import decode_attention
from starshard.kernels.fp8 import _weight_only_kernel, quantize_rows, weight_only_linear


def graph_time(fn, n=20):
    """Seconds per call: the fastest of 5 replays of a CUDA graph of n calls."""
    return graph_time_us(fn, calls=n, replays=5, best=True, warmup=2) / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="linear,decode", help="comma list of linear, decode (what to time)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev), "linear": {}, "decode": {}}
    shapes = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}
    for name, (N, K) in (shapes.items() if "linear" in parts else ()):
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5
        w8, ws = quantize_rows(w)
        for M in (1, 16):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            t8 = graph_time(lambda: weight_only_linear(x, w8, ws))
            tb = graph_time(lambda: F.linear(x, w))
            best = {k: v for k, v in _weight_only_kernel.best_config.all_kwargs().items()} if _weight_only_kernel.best_config else None
            r = {"fp8_us": t8 * 1e6, "bf16_us": tb * 1e6, "speedup": tb / t8, "fp8_TBps": N * K / t8 / 1e12,
                 "bf16_TBps": 2 * N * K / tb / 1e12, "best": str(best)}
            res["linear"][f"{name}_M{M}"] = r
            print(name, M, r, flush=True)
    if "decode" not in parts:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    B, Hq, Hkv, D, Lk = 1, 32, 8, 128, 131072
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.bfloat16)
    k8, ks = quantize_rows(k)
    v8, vs = quantize_rows(v)
    pos = torch.arange(Lk, device=dev)
    qp = torch.tensor([Lk], device=dev)
    ref, _ = decode_attention(q, k, v, q_pos=qp, k_pos=pos, causal=False)
    tb = graph_time(lambda: decode_attention(q, k, v, q_pos=qp, k_pos=pos, causal=False))
    res["decode"]["bf16_default_us"] = tb * 1e6
    print("bf16 decode", tb * 1e6, flush=True)
    f = lambda: decode_attention(q, k8, v8, q_pos=qp, k_pos=pos, causal=False, k_scale=ks, v_scale=vs)
    t = graph_time(f)
    err = ((f()[0].float() - ref.float()).norm() / ref.float().norm()).item()
    res["decode"]["fp8_default"] = {"us": t * 1e6, "speedup": tb / t, "rel_err_vs_bf16": err,
                                    "TBps": (k8.numel() + v8.numel() + 4 * (ks.numel() + vs.numel())) / t / 1e12}
    print("fp8 decode default", res["decode"]["fp8_default"], flush=True)
    for bn, w, st in [(64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 2, 3), (256, 4, 2), (256, 4, 3), (64, 2, 4)]:
        for splits in (16, 24, 33, 66):
            try:
                f = lambda: decode_attention(q, k8, v8, q_pos=qp, k_pos=pos, causal=False, k_scale=ks, v_scale=vs,
                                             config=(bn, w, st), num_splits=splits)
                o, _ = f()
                t = graph_time(f)
                err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                res["decode"][f"fp8_bn{bn}_w{w}_s{st}_splits{splits}"] = {"us": t * 1e6, "speedup": tb / t, "rel_err_vs_bf16": err}
                print("fp8 decode", bn, w, st, splits, t * 1e6, tb / t, err, flush=True)
            except Exception as e:  # a config that does not compile or fit
                print("fp8 decode", bn, w, st, splits, "failed", str(e)[:200], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
