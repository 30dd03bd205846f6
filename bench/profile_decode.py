"""Profile decode steps of a model on one GPU: where a step's host and device time goes.

    python bench/profile_decode.py [--random-weights llama-3.1-8b] [--prompt-len 8000] [--steps 20]
        [--fp8 linear,kv] [--sort cuda_time_total]

The CUDA-graph replays are traced by the profiler kernel by kernel: `--sort cuda_time_total` lists the
device kernels of a step with their counts (kernels per layer = count / (5 steps x layers)). Run it with
STARSHARD_PDL=0 for kernel times: with PDL (kernels/pdl.py) each kernel starts early and its span includes
the wait for the kernel ahead (one H100, Qwen3-30B-A3B shape: RMSNorm 20.8 us per call with PDL, ~1.7 without).
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from starshard import LLM

ap = argparse.ArgumentParser()
ap.add_argument("--random-weights", default=None)
ap.add_argument("--prompt-len", type=int, default=8000)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--fp8", default=None, help="as launch/infer.py --fp8 (e.g. linear,kv)")
ap.add_argument("--sort", default="cpu_time_total", help="profiler table order (cuda_time_total: device kernels)")
args = ap.parse_args()
llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=args.random_weights, fp8=args.fp8)
ids = [100 + i % (llm.config.vocab_size - 100) for i in range(args.prompt_len)]  # ids stay inside the vocabulary
runner = llm.runner
cache = runner.new_cache(len(ids) + 2 * args.steps + 8)  # warm-up, timed and 5 profiled steps
from starshard.config import SamplingConfig
from starshard.runtime.prompt import Prompt

s = SamplingConfig()
with torch.inference_mode():
    tok = runner.prefill(Prompt(ids, len(ids)), cache, s, None)
    for _ in range(args.steps):  # warm-up
        tok = runner.next_token(tok.view(1, 1), cache, s, None)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        tok = runner.next_token(tok.view(1, 1), cache, s, None)
    torch.cuda.synchronize()
    print(f"decode step {1e3 * (time.perf_counter() - t) / args.steps:.2f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            tok = runner.next_token(tok.view(1, 1), cache, s, None)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by=args.sort, row_limit=45, max_name_column_width=90))
