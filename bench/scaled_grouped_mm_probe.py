"""Does this torch's torch._scaled_grouped_mm run the MoE prefill's e4m3 expert GEMMs on this GPU, and how fast?

Qwen3-30B-A3B expert shapes (128 experts, hidden 2048, width 768), per token count (`--tokens`, comma-separated)
x 8 experts: routed at random (group sizes not multiples of 16, as a real prefill's) and split equally (every
group the same multiple of 16 rows). Rows quantized per row (e4m3 + float32 scale), experts e4m3 with row scales;
for gate/up (w13, 2048 -> 1536) and down (w2, 768 -> 2048): the time of the e4m3 grouped GEMM (promoted and
fast accumulation) against bf16 torch._grouped_mm on the same groups (CUDA events, median of 5), the time to
dequantize all the layer's experts to bf16, and for the first count and gate/up the product
against a float32 one on the dequantized operands.

    python bench/scaled_grouped_mm_probe.py --out probe.json [--tokens 2048,8192,32768]
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, timed_median
from starshard.kernels.fp8 import dequantize, quantize_rows

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[32768])
ap.add_argument("--out", required=True)
args = ap.parse_args()
dev, E, k, H, Fw = torch.device("cuda"), 128, 8, 2048, 768
g = torch.Generator(device=dev).manual_seed(0)
res = {"bench": "scaled_grouped_mm_probe", "device": torch.cuda.get_device_name(), "commit": commit(),
       "torch": torch.__version__, "has_scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm"), "points": []}
weights = {"w13": (torch.randn(E, 2 * Fw, H, device=dev, generator=g) * 0.02).bfloat16(),
           "w2": (torch.randn(E, H, Fw, device=dev, generator=g) * 0.02).bfloat16()}
quantized = {name: quantize_rows(w) for name, w in weights.items()}


def ms(fn):
    return round(1e3 * timed_median(fn, dev, 5, 2), 4)


for tokens in args.tokens:
    pairs = tokens * k
    random_counts = torch.bincount(torch.randint(0, E, (pairs,), device=dev, generator=g), minlength=E)
    for routing, counts in (("random", random_counts), ("equal", torch.full((E,), pairs // E, device=dev))):
        offs = counts.cumsum(0).to(torch.int32)
        point = {"tokens": tokens, "routing": routing, "groups_multiple_of_16": bool((counts % 16 == 0).all())}
        for name, w in weights.items():
            w8, sw = quantized[name]
            rows = torch.randn(int(offs[-1]), w.shape[-1], device=dev, generator=g).bfloat16()
            r8, sr = quantize_rows(rows)
            try:
                def fp8():
                    return torch._scaled_grouped_mm(r8, w8.transpose(-2, -1), sr, sw, offs=offs, out_dtype=torch.bfloat16)
                out = fp8()
                point[f"{name}_fp8_ms"] = ms(fp8)
                point[f"{name}_fp8_fast_accum_ms"] = ms(lambda: torch._scaled_grouped_mm(
                    r8, w8.transpose(-2, -1), sr, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True))
                if name == "w13" and tokens == args.tokens[0] and routing == "random":
                    n = min(4096, rows.shape[0])
                    a = dequantize(r8[:n], sr[:n], torch.float32)
                    wf = dequantize(w8, sw, torch.float32)
                    e_of_row = torch.repeat_interleave(torch.arange(E, device=dev), counts)[:n]
                    ref = torch.bmm(wf[e_of_row], a[:, :, None])[:, :, 0]
                    res["rel_err"] = ((out[:n].float() - ref).norm() / ref.norm()).item()
            except Exception as e:  # report what this build says
                point[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
            point[f"{name}_bf16_ms"] = ms(lambda: torch._grouped_mm(rows, w.transpose(-2, -1), offs=offs))
        point["quantize_rows_ms"] = ms(lambda: quantize_rows(rows))
        point["dequantize_experts_ms"] = ms(lambda: [dequantize(w8, sw, torch.bfloat16) for w8, sw in quantized.values()])
        res["points"].append(point)
        print(json.dumps(point), flush=True)
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
