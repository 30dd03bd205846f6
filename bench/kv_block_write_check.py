"""The prefill KV write into an e4m3 cache on one GPU (kernels/kv_write.py write_kv_block) against the torch
path LayerKV used before (quantize_rows, then copies into the cache): bytes and scales, and time per layer
for a Llama-3.1-8B-shaped block (8 KV heads, d 128; k contiguous, v a view of the fused projection).

    python bench/kv_block_write_check.py --tokens 131072 --out kv_block_write.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, timed_median
from starshard.engine import kv_cache
from starshard.engine.kv_cache import LayerKV

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tokens", type=int, default=131072)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev, n, H, D = torch.device("cuda"), args.tokens, 8, 128
g = torch.Generator(device=dev).manual_seed(0)
qkv = torch.randn(1, n, (32 + 2 * H) * D, device=dev, generator=g).bfloat16()
k = qkv[..., 32 * D : (32 + H) * D].view(1, n, H, D).transpose(1, 2).contiguous()
v = qkv[..., (32 + H) * D :].view(1, n, H, D).transpose(1, 2)
pos = torch.arange(n, device=dev)


def store(kernel: bool) -> LayerKV:
    kv_cache.use_kv_write_kernel = (lambda t: True) if kernel else (lambda t: False)
    cache = LayerKV(1, H, D, n, torch.bfloat16, dev, fp8=True)
    cache.store(k, v, pos)
    return cache


def ms(kernel: bool) -> float:
    return 1e3 * timed_median(lambda: store(kernel), dev, repeats=7, warmup=1)


ref, got = store(False), store(True)
res = dict(device=torch.cuda.get_device_name(), commit=commit(), tokens=n, kv_heads=H, head_dim=D)
for name in ("k", "v"):
    a, b = getattr(ref, name).view(torch.uint8), getattr(got, name).view(torch.uint8)
    res[f"{name}_bytes_equal"] = (a == b).float().mean().item()
    res[f"{name}_scales_equal"] = torch.equal(getattr(ref, f"{name}_scale"), getattr(got, f"{name}_scale"))
res["torch_path_ms"], res["kernel_ms"] = ms(False), ms(True)  # includes the cache's allocation, both alike
print(json.dumps(res))
if args.out:
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
