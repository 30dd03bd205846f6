"""Decode KV write on one GPU: the torch path (quantize_rows + index_copy_) vs kernels/kv_write.py (issue 19).

One CUDA graph replays a decode step's writes for 32 layers (Llama-8B shape: batch 1, 8 KV heads,
head dim 128, capacity 131072, slot near the end), FP8 (e4m3 + scales) and bf16 caches. Also checks
that both paths store the same bytes.

    python bench/kv_write_bench.py --out kv_write.json      # ~15 s on one H200
"""
import argparse
import json
import sys

import torch

from starshard.benchmarks.common import graph_time_us
from starshard.kernels.fp8 import FP8_DTYPE
from starshard.kernels.kv_write import write_kv_slot, write_kv_slot_reference

LAYERS, B, HKV, HQ, D, CAP = 32, 1, 8, 32, 128, 131072


def caches(fp8, dev):
    store = FP8_DTYPE if fp8 else torch.bfloat16
    out = []
    for _ in range(LAYERS):
        k = torch.zeros(B, HKV, CAP, D, dtype=store, device=dev)
        scales = [torch.zeros(B, HKV, CAP, device=dev) for _ in range(2)] if fp8 else [None, None]
        out.append([k, torch.zeros_like(k), torch.zeros(CAP, dtype=torch.long, device=dev)] + scales)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file to write (default: stdout only)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    # this step's k, v per layer: [B, HKV, 1, D] slices of a fused qkv projection, as the model hands them
    qkv = [torch.randn(B, 1, (HQ + 2 * HKV) * D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ks = [t[..., HQ * D:(HQ + HKV) * D].view(B, 1, HKV, D).transpose(1, 2) for t in qkv]
    vs = [t[..., (HQ + HKV) * D:].view(B, 1, HKV, D).transpose(1, 2) for t in qkv]
    pos = torch.tensor([CAP - 5], device=dev)
    slot = torch.tensor([CAP - 3], device=dev)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "layers": LAYERS,
           "shape": {"batch": B, "kv_heads": HKV, "head_dim": D, "capacity": CAP, "slot": CAP - 3},
           "compute_dtype": "bf16", "rows": []}
    for fp8 in (True, False):
        ref, new = caches(fp8, dev), caches(fp8, dev)

        def torch_path():
            for i in range(LAYERS):
                write_kv_slot_reference(ks[i], vs[i], pos, slot, *ref[i])

        def kernel_path():
            for i in range(LAYERS):
                write_kv_slot(ks[i], vs[i], pos, slot, *new[i])

        t_torch, t_kernel = (graph_time_us(f, calls=20, replays=10, best=True, warmup=1) for f in (torch_path, kernel_path))
        same = all(torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                               b.view(torch.uint8) if b.dtype == FP8_DTYPE else b)
                   for r, n in zip(ref, new) for a, b in zip(r, n) if a is not None)
        row = {"cache": "fp8" if fp8 else "bf16", "torch_us_per_step": round(t_torch, 2),
               "kernel_us_per_step": round(t_kernel, 2), "speedup": round(t_torch / t_kernel, 2),
               "same_bytes": same}
        res["rows"].append(row)
        print(row, file=sys.stderr, flush=True)
        del ref, new
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
