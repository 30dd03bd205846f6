"""The decode step's small kernels on one GPU: SwiGLU's silu-mul and greedy argmax, eager torch vs the
one-launch Triton kernels (kernels/activation.py silu_mul_rows, kernels/argmax.py), and the FP8 GEMV
with the block's residual added in its epilogue vs GEMV + torch add (kernels/fp8.py residual=),
microseconds per call replayed from a CUDA graph as a decode step runs them, and whether results agree.

    python bench/decode_small_kernels.py --out decode_small_kernels.json

Shapes: Llama-3.1-8B (SwiGLU 14336 wide, vocabulary 128256) and SmolLM2-135M (1536, 49152), one row
(and 4 / 64 rows for the silu-mul). Random inputs: time does not depend on the values; agreement: bf16
silu-mul bit-equal rate against eager torch (the exp may differ in its last float32 bit) and its error
against float64; argmax exactly equal (ties and NaN included).
"""
import argparse
import json

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import commit, graph_time_us
from starshard.kernels.activation import silu_mul_rows
from starshard.kernels.argmax import argmax_rows
from starshard.kernels.fp8 import quantize_rows, weight_only_linear


def eager_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(), "silu_mul": [],
           "argmax": []}
    for width in (14336, 1536):
        for rows in (1, 4, 64):
            x = (3 * torch.randn(rows, 2 * width, device=dev, generator=g)).to(torch.bfloat16)
            ref = eager_silu_mul(x)
            got = silu_mul_rows(x)
            gate, up = x.double().chunk(2, dim=-1)
            exact = gate * torch.sigmoid(gate) * up
            r = {"width": width, "rows": rows,
                 "eager_us": graph_time_us(lambda: eager_silu_mul(x)),
                 "kernel_us": graph_time_us(lambda: silu_mul_rows(x)),
                 "bit_equal": (got == ref).float().mean().item(),
                 "rel_err_kernel": ((got.double() - exact).norm() / exact.norm()).item(),
                 "rel_err_eager": ((ref.double() - exact).norm() / exact.norm()).item()}
            res["silu_mul"].append(r)
            print("silu_mul", r, flush=True)
    for vocab in (128256, 49152):
        x = torch.randn(1, vocab, device=dev, generator=g)
        x[0, vocab // 3] = x[0, vocab // 2] = 10.0  # a tie: the first wins
        r = {"vocab": vocab, "torch_us": graph_time_us(lambda: x.argmax(-1)),
             "kernel_us": graph_time_us(lambda: argmax_rows(x)),
             "equal": bool(torch.equal(argmax_rows(x), x.argmax(-1)))}
        y = torch.randn(8, vocab, device=dev, generator=g)
        y[3, 77] = float("nan")
        r["equal_8_rows_nan"] = bool(torch.equal(argmax_rows(y), y.argmax(-1)))
        res["argmax"].append(r)
        print("argmax", r, flush=True)
    res["gemv_residual"] = []
    for name, (N, K) in {"wo": (4096, 4096), "w2": (4096, 14336)}.items():
        w8, ws = quantize_rows(torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16) / K**0.5)
        x = torch.randn(1, K, device=dev, generator=g).to(torch.bfloat16)
        r = (10 * torch.randn(1, N, device=dev, generator=g)).to(torch.bfloat16)
        fused = weight_only_linear(x, w8, ws, residual=r)
        row = {"proj": name, "N": N, "K": K,
               "gemv_plus_add_us": graph_time_us(lambda: weight_only_linear(x, w8, ws) + r),
               "fused_us": graph_time_us(lambda: weight_only_linear(x, w8, ws, residual=r)),
               "bit_equal": bool(torch.equal(fused, weight_only_linear(x, w8, ws) + r))}
        res["gemv_residual"].append(row)
        print("gemv_residual", row, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
