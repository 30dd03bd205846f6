"""Where one sparse prefill attention call makes the host wait for the GPU (issue 18: the index build
runs at host speed when the GPU drains at every sync): torch's sync debug mode lists each synchronizing
call with the line of starshard that made it, and CUDA events time the calls.

    python bench/sparse_sync_points.py --out sync_points.json [--config FILE] [--length 131072]

Random bf16 q / k / v of SmolLM2-135M's attention shape (9 / 3 heads, d 64; --heads / --kv-heads /
--head-dim), the model's own sparse method (kernels/sparse.py load_sparse_method: per-head patterns of
--config, the H200 fallback rates), --layers consecutive calls as a model makes them. Random inputs
make the patterns dense-like: this counts syncs and host time, not sparse speed.
"""
import argparse
import json
import traceback
import warnings
from collections import Counter

import torch

from starshard.benchmarks.common import commit
from starshard.kernels.attention import attention
from starshard.kernels.sparse import SparseConfig, load_sparse_method


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output JSON")
    ap.add_argument("--config", default=None, help="MInference config file (default: Vertical-Slash 1000/6096)")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--layers", default="14,15,16", help="layer ids of the calls (default 14,15,16)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--no-fallback", action="store_true", help="every head runs its pattern (no cost model)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    L, H, Hkv, D = args.length, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, H, L, D, device=dev, generator=g).bfloat16()
    k = torch.randn(1, Hkv, L, D, device=dev, generator=g).bfloat16()
    v = torch.randn(1, Hkv, L, D, device=dev, generator=g).bfloat16()
    pos = torch.arange(L, device=dev)
    method = load_sparse_method(SparseConfig("minference", config_path=args.config, min_length=0,
                                             fallback=False if args.no_fallback else True))
    layers = [int(x) for x in args.layers.split(",")]

    def run():
        for layer in layers:
            attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, sparse=method.pattern(layer, H))

    run()  # compile and warm up
    torch.cuda.synchronize()
    sites = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/starshard/" in f.filename]
        site = f"{frames[-1].filename.split('/starshard/', 1)[1]}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        sites[site] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    run()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(layers))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
           "shape": {"length": L, "heads": H, "kv_heads": Hkv, "head_dim": D}, "config": args.config,
           "layers": layers, "fallback": not args.no_fallback, "ms_per_call": sorted(times)[len(times) // 2],
           "syncs_per_call": sum(sites.values()) / len(layers),
           "sync_sites": dict(sites.most_common()), "report": vars(method.report) if hasattr(method.report, "__dict__") else None}
    print(json.dumps(res, indent=1, default=str))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
