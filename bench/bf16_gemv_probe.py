"""Does a Triton one-row GEMV read a bf16 weight faster than cuBLAS (F.linear) at decode? (issue 20: the
Qwen3-30B-A3B decode step's attention projections ran at ~1.9 TB/s on an H200, ~2.5x their bytes.)
The GEMV kernel on bf16 weights over a few tiles (kernels/gemv.py `gemv`, the engine's path for one 16-bit
row since 2026-11-25; the runs before that took it through kernels/fp8.py with channel scales of one), against
F.linear, one row, each call reading its weight from HBM (copies cycled, >= 256 MB in all), CUDA graph.

    python bench/bf16_gemv_probe.py --out bf16_gemv_probe.json [--shapes qwen3moe.wo,...] [--tiles 4x1024x4,...]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import commit, graph_time_us
from starshard.kernels.gemv import gemv

SHAPES = {  # [N, K]
    "qwen3moe.wqkv": (5120, 2048), "qwen3moe.wo": (2048, 4096), "qwen3moe.router": (128, 2048),
    "qwen3moe.lm_head": (151936, 2048),
    "llama8b.wqkv": (6144, 4096), "llama8b.wo": (4096, 4096), "llama8b.w13": (28672, 4096), "llama8b.w2": (4096, 14336),
    "llama8b.lm_head": (128256, 4096),
}
TILES = [(4, 512, 2), (4, 1024, 4), (4, 2048, 4), (8, 512, 4), (2, 1024, 2), (8, 256, 2), (16, 256, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--tiles", default=",".join("x".join(map(str, t)) for t in TILES),
                    help="comma-separated BLOCK_NxBLOCK_Kxwarps")
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(), "rows": []}
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        copies = max(2, -(-256 * 2**20 // (N * K * 2)))
        ws = [torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
        x = torch.randn(1, K, device=dev, generator=g, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        row = {"name": name, "N": N, "K": K, "bytes": N * K * 2,
               "cublas_us": graph_time_us(lambda i: F.linear(x, ws[i]), 24, best=True, copies=copies)}
        best = None
        for bn, bk, w in tiles:
            tile = dict(block_n=bn, block_k=bk, warps=w)
            y = gemv(x, ws[0], tile=tile)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            us = graph_time_us(lambda i: gemv(x, ws[i], tile=tile), 24, best=True, copies=copies)
            row[f"triton_{bn}x{bk}x{w}_us"] = us
            if best is None or us < best[0]:
                best = (us, f"{bn}x{bk}x{w}", err)
        row.update(best_triton_us=best[0], best_tile=best[1], best_err=best[2],
                   cublas_tb_s=row["bytes"] / row["cublas_us"] / 1e6, triton_tb_s=row["bytes"] / best[0] / 1e6)
        res["rows"].append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
