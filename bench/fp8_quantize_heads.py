"""wo's FP8 input straight from attention's output layout (issue 19, the 128K prefill with `--fp8 linear,kv`).

    python bench/fp8_quantize_heads.py [--out fp8_quantize_heads.json] [--lengths 8192 32768 131072]

Attention returns o [B, H, L, D]; wo's FP8 GEMM takes e4m3 rows [B * L, H * D] with a scale per row.
Before: the transposing copy (`o.transpose(1, 2).reshape(...)`, bf16 read and written) then quantize_rows;
now: kernels/activation.py quantize_heads reads o where it lies. Llama-3.1-8B's 32 heads of 128, o
contiguous [1, 32, L, 128] as cuDNN returns it, random bf16 values. Times: median of 20 calls (a device sync around each)
after 3 warm-ups, for the two-step path, the copy alone, quantize_rows alone, and quantize_heads with
each tile (block_l positions, warps, all heads in registers or a loop over them); the e4m3 bytes and scales of quantize_heads against the two-step path (the
share of bytes that differ; same numerics, so 0 up to float32 division ties). JSON to stdout (and --out).
"""
import argparse
import json

import torch
import triton

from starshard.benchmarks.common import commit, timed_median
from starshard.kernels.activation import heads_tile, quantize_heads
from starshard.kernels.fp8 import quantize_rows_cuda

# (block_l, warps, one_tile): all heads of block_l positions in registers, or the loop over heads
TILES = [(1, 4, True), (2, 4, True), (2, 8, True), (4, 8, True), (4, 16, True), (8, 16, True),
         (8, 4, False), (16, 4, False), (16, 8, False), (32, 8, False)]


def timed(fn, reps=20):
    """Median ms per call (a device sync around each), after 3 warm-ups."""
    return round(1e3 * timed_median(fn, torch.device("cuda"), reps, 3), 4)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    H, D = args.heads, args.head_dim
    rows = []
    for L in args.lengths:
        o = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16) * 3

        def copy():
            return o.transpose(1, 2).reshape(L, H * D)

        def two_step():
            return quantize_rows_cuda(copy())

        flat = copy()
        want8, want_s = two_step()
        got8, got_s = quantize_heads(o)
        r = {"length": L, "heads": H, "head_dim": D, "copy_then_quantize_rows_ms": timed(two_step),
             "copy_ms": timed(copy), "quantize_rows_ms": timed(lambda: quantize_rows_cuda(flat)),
             "default_tile": heads_tile(H, D),
             "bytes_differing": (got8.view(torch.uint8) != want8.view(torch.uint8)).float().mean().item(),
             "scales_equal": bool(torch.equal(got_s, want_s)), "quantize_heads_ms": {}}
        for bl, w, one in TILES:
            t = dict(block_l=bl, warps=w, one_tile=one)
            r["quantize_heads_ms"][f"{bl}x{w}{' one tile' if one else ' loop'}"] = timed(lambda: quantize_heads(o, tile=t))
        best = min(r["quantize_heads_ms"].values())
        r["bandwidth_tb_s_best"] = round(o.numel() * 3 / best / 1e9, 3)  # bf16 read + e4m3 write
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": commit(), "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
