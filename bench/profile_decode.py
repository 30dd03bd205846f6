"""Profile decode steps of a model on one GPU: where a step's host and device time goes.

    python bench/profile_decode.py [--random-weights llama-3.1-8b] [--prompt-len 8000] [--steps 20]
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
args = ap.parse_args()
llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=args.random_weights)
ids = list(range(100, 100 + args.prompt_len))
runner = llm.runner
cache = runner.new_cache(len(ids) + 2 * args.steps + 2)
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
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=35, max_name_column_width=60))
