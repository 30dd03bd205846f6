"""Does this torch's torch._scaled_grouped_mm run the MoE prefill's e4m3 expert GEMMs on this GPU, and how fast?

Qwen3-30B-A3B expert shapes (128 experts, hidden 2048, width 768), 32K tokens x 8 experts routed at random (group
sizes not multiples of 16): rows quantized per row (e4m3 + float32 scale), experts e4m3 with row scales; the
product against a float32 one on the dequantized operands, and the time against bf16 torch._grouped_mm on the same
routing (CUDA events, median of 5).

    python bench/scaled_grouped_mm_probe.py --out probe.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, timed_median
from starshard.kernels.fp8 import dequantize, quantize_rows

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tokens", type=int, default=32768)
ap.add_argument("--out", required=True)
args = ap.parse_args()
dev, E, k, H, Fw = torch.device("cuda"), 128, 8, 2048, 768
g = torch.Generator(device=dev).manual_seed(0)
res = {"bench": "scaled_grouped_mm_probe", "device": torch.cuda.get_device_name(), "commit": commit(),
       "torch": torch.__version__, "has_scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm")}
experts = torch.randint(0, E, (args.tokens * k,), device=dev, generator=g)
counts = torch.bincount(experts, minlength=E)
offs = counts.cumsum(0).to(torch.int32)
rows = torch.randn(args.tokens * k, H, device=dev, generator=g).bfloat16()
w13 = (torch.randn(E, 2 * Fw, H, device=dev, generator=g) * 0.02).bfloat16()
w13_8, s13 = quantize_rows(w13)
r8, sr = quantize_rows(rows)
res["groups_multiple_of_16"] = bool((counts % 16 == 0).all())
try:
    out = torch._scaled_grouped_mm(r8, w13_8.transpose(-2, -1), sr, s13, offs=offs, out_dtype=torch.bfloat16)
    n = 4096
    ref = torch.empty(n, 2 * Fw, device=dev)
    a = dequantize(r8[:n], sr[:n], torch.float32)
    w = dequantize(w13_8, s13, torch.float32)
    e_of_row = torch.repeat_interleave(torch.arange(E, device=dev), counts)[:n]
    ref = torch.bmm(w[e_of_row], a[:, :, None])[:, :, 0]
    res["rel_err"] = ((out[:n].float() - ref).norm() / ref.norm()).item()
    res["fp8_ms"] = 1e3 * timed_median(lambda: torch._scaled_grouped_mm(r8, w13_8.transpose(-2, -1), sr, s13, offs=offs,
                                                                      out_dtype=torch.bfloat16), dev, 5, 2)
except Exception as e:  # report what this build says
    res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
res["bf16_ms"] = 1e3 * timed_median(lambda: torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs), dev, 5, 2)
res["quantize_rows_ms"] = 1e3 * timed_median(lambda: quantize_rows(rows), dev, 5, 2)
print(json.dumps(res, indent=1))
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
