"""q / k RoPE (+ Qwen3's per-head norms) on one GPU: the torch path of Attention.forward vs kernels/rope.py
(issues 19 / 20). bf16; q and k as the layer makes them (transposed views of the fused qkv output).

    python bench/rope_bench.py [--out rope.json]      # one JSON on stdout (and in --out); ~20 s on an H200

Decode shapes (L = 1) are timed as CUDA-graph replays of 50 calls (the decode step is a graph); prefill
shapes with CUDA events around 20 eager calls. Errors: max |rope_qk - torch path| and each path's max
error against float64 math (the torch path rounds to bf16 after every op, the kernel once).
"""
import argparse
import json

import torch

from starshard.benchmarks.common import graph_time_us
from starshard.engine.model import RMSNorm, apply_rope
from starshard.kernels.rope import rope_qk, rope_qk_reference

MODELS = {  # Hq, Hkv, D, per-head q / k norm
    "llama3-8b": (32, 8, 128, False),
    "qwen3-30b-a3b": (32, 4, 128, True),
}
LENGTHS = [1, 8192, 32768]


def event_us(fn, n=20):
    fn()
    torch.cuda.synchronize()
    return best_of(lambda: [fn() for _ in range(n)], n)


def best_of(run, n, repeats=5):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / n)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "dtype": "bf16", "B": 1, "rows": []}
    for name, (Hq, Hkv, D, qk_norm) in MODELS.items():
        for L in LENGTHS:
            torch.manual_seed(0)
            qkv = torch.randn(1, L, (Hq + 2 * Hkv) * D, device=dev, dtype=dt)
            q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q, k = q.view(1, L, Hq, D), k.view(1, L, Hkv, D)
            pos = torch.arange(100_000, 100_000 + L, device=dev) if L == 1 else torch.arange(L, device=dev)
            inv = 1.0 / (500_000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
            f = pos.float()[:, None] * inv
            cos, sin = f.cos().to(dt), f.sin().to(dt)
            qn, kn = RMSNorm(D, 1e-6).to(dev, dt), RMSNorm(D, 1e-6).to(dev, dt)
            with torch.no_grad():
                qn.weight.uniform_(0.5, 1.5)
                kn.weight.uniform_(0.5, 1.5)
            w = (qn.weight, kn.weight) if qk_norm else (None, None)

            def torch_path():  # Attention.forward before the kernel
                qq, kk = (qn(q), kn(k)) if qk_norm else (q, k)
                return apply_rope(qq.transpose(1, 2), cos, sin), apply_rope(kk.transpose(1, 2), cos, sin)

            def kernel_path():
                return rope_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin, *w, eps=1e-6)

            with torch.no_grad():
                timer = (lambda f: graph_time_us(f, calls=50, replays=5, best=True, warmup=1)) if L <= 64 else event_us
                t_torch, t_kernel = timer(torch_path), timer(kernel_path)
                (qt, kt), (qk_, kk_) = torch_path(), kernel_path()
                exact = rope_qk_reference(q.transpose(1, 2).double(), k.transpose(1, 2).double(), cos, sin, *w,
                                          eps=1e-6)
                err = lambda a, b: max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))  # noqa: E731
                row = {"model": name, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D, "qk_norm": qk_norm,
                       "timing": "cuda_graph_x50" if L <= 64 else "events_x20",
                       "torch_us": round(t_torch, 2), "rope_qk_us": round(t_kernel, 2),
                       "speedup": round(t_torch / t_kernel, 2),
                       "max_abs_diff_vs_torch": err((qk_, kk_), (qt, kt)),
                       "max_abs_err_vs_fp64": {"torch": err((qt, kt), exact), "rope_qk": err((qk_, kk_), exact)}}
                if L > 1:  # one pass over q and k: read + write
                    row["rope_qk_GBps"] = round(2 * (q.numel() + k.numel()) * 2 / t_kernel / 1e3, 1)
            res["rows"].append(row)
            del qkv, q, k, qt, kt, qk_, kk_, exact
            torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
