"""Two prefill probes on one GPU (issue 19, `--fp8 linear,kv` at 128K):

1. the e4m3 GEMM (`torch._scaled_mm`, row / channel scales) with and without `use_fast_accum` (the
   tensor cores' own accumulator, no periodic promotion to float32) on the Llama-3.1-8B projection
   shapes, against bf16 F.linear: time (CUDA events, median) and relative error against a float32
   matmul of the same e4m3 operands (a slice of rows);
2. cuDNN causal attention at 128K (32 q / 8 KV heads, d 128) with q / k / v laid out as the model hands
   them today (q, k contiguous [B, H, L, D], v a view of the projection) and the alternatives: all three
   contiguous, or all three as [B, L, H, D] memory (viewed [B, H, L, D]); time and the output's strides
   (whether `out.transpose(1, 2).reshape(B, L, H * D)` is a copy).

    python bench/fp8_fast_accum.py --out fp8_fast_accum.json [--rows 131072] [--attn-len 131072]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from starshard.benchmarks.common import commit, timed_median
from starshard.kernels.fp8 import quantize_rows_cuda

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--rows", type=int, nargs="+", default=[8192, 131072])
ap.add_argument("--attn-len", type=int, default=131072)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device("cuda")
SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}


def time_ms(fn, repeats=args.repeats):
    return 1e3 * timed_median(fn, dev, repeats, warmup=1)


g = torch.Generator(device=dev).manual_seed(0)
gemm = []
for M in args.rows:
    for name, (N, K) in SHAPES.items():
        x = torch.randn(M, K, device=dev, generator=g).bfloat16()
        w = (torch.randn(N, K, device=dev, generator=g) * K ** -0.5).bfloat16()
        x8, sx = quantize_rows_cuda(x)
        w8, sw = quantize_rows_cuda(w)

        def mm(fast):
            return torch._scaled_mm(x8, w8.t(), scale_a=sx[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)

        row = dict(rows=M, proj=name, N=N, K=K)
        flop = 2 * M * N * K
        row["bf16_ms"] = time_ms(lambda: F.linear(x, w))
        for fast in (False, True):
            ms = time_ms(lambda: mm(fast))
            row[f"fp8_fast{int(fast)}_ms"] = ms
            row[f"fp8_fast{int(fast)}_tflops"] = flop / ms / 1e9
            n = min(M, 2048)
            ref = (x8[:n].float() * sx[:n, None]) @ (w8.float() * sw[:, None]).t()
            got = mm(fast)[:n].float()
            row[f"fp8_fast{int(fast)}_rel_err"] = ((got - ref).norm() / ref.norm()).item()
        row["bf16_tflops"] = flop / row["bf16_ms"] / 1e9
        print(json.dumps(row), flush=True)
        gemm.append(row)
        del x, w, x8, w8
torch.cuda.empty_cache()

L, HQ, HKV, D = args.attn_len, 32, 8, 128
op = torch.ops.aten._scaled_dot_product_cudnn_attention
qkv = torch.randn(1, L, (HQ + 2 * HKV) * D, device=dev, generator=g).bfloat16()
q_v, k_v, v_v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
q_v, k_v, v_v = (t.view(1, L, -1, D).transpose(1, 2) for t in (q_v, k_v, v_v))
layouts = {
    "model (q, k contiguous BHLD, v a view)": (q_v.contiguous(), k_v.contiguous(), v_v),
    "all contiguous BHLD": (q_v.contiguous(), k_v.contiguous(), v_v.contiguous()),
    "all BLHD memory": tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q_v, k_v, v_v)),
    "all views of the projection": (q_v, k_v, v_v),
}
attn = []
flop = 4 * L * L * HQ * D / 2
for name, (q, k, v) in layouts.items():
    out = op(q, k, v, None, True, 0.0, True, False)[0]
    ms = time_ms(lambda: op(q, k, v, None, True, 0.0, True, False), repeats=3)
    row = dict(layout=name, L=L, ms=ms, tflops=flop / ms / 1e9, q_strides=q.stride(), out_strides=out.stride(),
               out_blhd_view=out.transpose(1, 2).is_contiguous())
    print(json.dumps(row), flush=True)
    attn.append(row)
    del out

res = dict(device=torch.cuda.get_device_name(), commit=commit(), torch=torch.__version__, gemm=gemm, attention=attn)
if args.out:
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
