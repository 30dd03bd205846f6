"""Where a decode step's time goes at a long context (issue 47, item 3): a Llama-3.1-8B-shaped model
(random bf16 weights; --fp8 as serve's), one prefill of --length tokens, then --steps decode steps replayed
from the CUDA graph back to back, profiled: device time per kernel per step, their sum against the step's
wall time (the rest: the device idle), and the bytes bound.

    python bench/results/2026-12-06-step-loop/profile_decode.py --length 131072 [--fp8 kv] --out prof.json
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from starshard import LLM
from starshard.benchmarks.common import back_to_back
from starshard.benchmarks.prefill import decode_bound
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--length", type=int, default=131072)
ap.add_argument("--steps", type=int, default=32)
ap.add_argument("--fp8", default=None)
ap.add_argument("--out", default=None)
args = ap.parse_args()
llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights="llama-3.1-8b", fp8=args.fp8)
runner, s = llm.runner, SamplingConfig()
ids = torch.randint(100, 100000, (args.length,)).tolist()
cache = runner.new_cache(args.length + 2 * args.steps + 16)
tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
with torch.inference_mode():
    runner.prefill(Prompt(ids, len(ids)), cache, s, None)

    def step():
        runner.next_token(tok, cache, s, None)

    timing = back_to_back(step, torch.device("cuda"), args.steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
rows, total = [], 0.0
for e in prof.key_averages():
    dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
    if e.device_type == torch.autograd.DeviceType.CUDA and dev_us > 0:
        rows.append({"kernel": e.key[:120], "calls_per_step": e.count / args.steps, "ms_per_step": dev_us / 1e3 / args.steps})
        total += dev_us / 1e3 / args.steps
rows.sort(key=lambda r: -r["ms_per_step"])
out = {"length": args.length, "fp8": args.fp8, "device": torch.cuda.get_device_name(), "timing": timing,
       "kernels_ms_per_step": total, "kernels": rows[:15],
       **decode_bound(llm.runner.model, cache, torch.device("cuda"), timing["seconds_per_call"])}
print(json.dumps(out, indent=1))
if args.out:
    open(args.out, "w").write(json.dumps(out, indent=1) + "\n")
