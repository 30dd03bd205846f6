"""cuDNN causal attention over all heads at once vs a few KV heads per call, one GPU.

cuDNN's bf16 causal prefill attention ran at 640 TFLOP/s at 32K but 560 at 128K on an H100
(bench/results/2026-11-25-h100-fp8-attention). At 128K one KV head's K and V take 64 MB, more than the
50 MB L2; with every head's query blocks in flight at once the keys the running blocks read may not stay
in L2. This probe times torch's cuDNN op (what kernels/attention.py calls) on Llama-3.1-8B heads (32 q,
8 KV, d 128, batch 1, bf16, v a strided view of a fused projection as the model hands it) called once for
all heads and once per group of `g` KV heads (their query heads with them), the outputs concatenated
along the heads, and checks the outputs and logsumexp against the one-call result (heads are independent:
equal bits are expected).

    python bench/attention_head_groups.py [--lengths 32768,65536,131072] [--groups 1,2,4] --out groups.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, ints, timed_median

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--lengths", type=ints, default=[32768, 65536, 131072])
ap.add_argument("--groups", type=ints, default=[1, 2, 4], help="KV heads per call (8: one call)")
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device("cuda")
HQ, HKV, D = 32, 8, 128
G = HQ // HKV
op = torch.ops.aten._scaled_dot_product_cudnn_attention


def grouped(q, k, v, kv_per_call):
    if kv_per_call >= HKV:
        out, lse = op(q, k, v, None, True, 0.0, True, False)[:2]
        return out, lse
    outs, lses = [], []
    for h in range(0, HKV, kv_per_call):
        o, s = op(q[:, h * G:(h + kv_per_call) * G], k[:, h:h + kv_per_call], v[:, h:h + kv_per_call],
                  None, True, 0.0, True, False)[:2]
        outs.append(o)
        lses.append(s)
    return torch.cat(outs, 1), torch.cat(lses, 1)


rows = []
g = torch.Generator(device=dev).manual_seed(0)
for L in args.lengths:
    qkv = torch.randn(1, L, (HQ + 2 * HKV) * D, device=dev, generator=g).bfloat16()
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = (t.view(1, L, -1, D).transpose(1, 2) for t in (q, k, v))
    q, k = q.contiguous(), k.contiguous()  # as the model's RoPE returns them; v stays a view
    flop = 4 * L * L * HQ * D / 2
    ref_out, ref_lse = grouped(q, k, v, HKV)
    for kv_per_call in [HKV, *args.groups]:
        out, lse = grouped(q, k, v, kv_per_call)
        s = timed_median(lambda c=kv_per_call: grouped(q, k, v, c), dev, args.repeats, warmup=2)
        row = dict(L=L, kv_heads_per_call=kv_per_call, calls=-(-HKV // kv_per_call), ms=1e3 * s,
                   tflops=flop / s / 1e12, out_equal=bool(torch.equal(out, ref_out)),
                   lse_equal=bool(torch.equal(lse.reshape(ref_lse.shape), ref_lse)),
                   out_max_diff=(out.float() - ref_out.float()).abs().max().item())
        print(json.dumps(row), flush=True)
        rows.append(row)
        del out, lse
    del qkv, q, k, v, ref_out, ref_lse
    torch.cuda.empty_cache()

if args.out:
    with open(args.out, "w") as fh:
        json.dump(dict(bench="attention_head_groups", commit=commit(), device=torch.cuda.get_device_name(dev),
                       torch=torch.__version__, cudnn=torch.backends.cudnn.version(), rows=rows), fh, indent=1)
