"""Decode RMSNorm on one GPU: torch's F.rms_norm vs kernels/norm.py, CUDA-graph replays (issue 19/20).

    python bench/norm_bench.py --out norm.json
"""
import argparse
import json

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import graph_time_us
from starshard.kernels.norm import rms_norm


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev), "dtype": "bf16", "rows": []}
    for rows, D in [(1, 4096), (1, 2048), (32, 128), (4, 128), (64, 4096), (8192, 4096)]:
        x = torch.randn(rows, D, device=dev, dtype=torch.bfloat16)
        w = torch.randn(D, device=dev, dtype=torch.bfloat16)
        t_torch = graph_time_us(lambda: F.rms_norm(x, (D,), w, 1e-5), calls=50, replays=5, best=True, warmup=1)
        t_ours = graph_time_us(lambda: rms_norm(x, w, 1e-5), calls=50, replays=5, best=True, warmup=1)
        err = (rms_norm(x, w, 1e-5).float() - F.rms_norm(x, (D,), w, 1e-5).float()).abs().max().item()
        row = {"rows": rows, "D": D, "torch_us": t_torch, "triton_us": t_ours, "max_abs_diff": err}
        res["rows"].append(row)
        print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
