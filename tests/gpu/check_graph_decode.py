"""CUDA-graph decode vs eager: same tokens, and step time. JSON lines (rank 0).

    python tests/gpu/check_graph_decode.py                       # embedded SmolLM2 (8K prompt)
    python tests/gpu/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 131072
    torchrun --nproc-per-node 2 tests/gpu/check_graph_decode.py --random-weights llama-3.1-8b --cp 2 --cp-strategy ring
    torchrun --nproc-per-node 2 tests/gpu/check_graph_decode.py --random-weights llama-3.1-8b --tp 2
"""
import argparse
import json
import time

import torch

from starshard import LLM
from starshard.config import ParallelConfig

ap = argparse.ArgumentParser()
ap.add_argument("--random-weights", default=None)
ap.add_argument("--prompt-len", type=int, default=8000)
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--cp", type=int, default=1)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--cp-strategy", default="dense")
ap.add_argument("--fp8", default=None, help="as launch/infer.py --fp8 (e.g. linear,kv,experts)")
args = ap.parse_args()
llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=args.random_weights,
          parallel=ParallelConfig(tp=args.tp, cp=args.cp, cp_strategy=args.cp_strategy), fp8=args.fp8)
ids = torch.randint(100, llm.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
res = {"model": args.random_weights or "smollm2-135m", "prompt_len": args.prompt_len, "steps": args.steps,
       "tp": args.tp, "cp": args.cp, "cp_strategy": args.cp_strategy, "fp8": args.fp8}
for graphs in (False, True):
    llm.runner.cuda_graphs = graphs
    llm.generate(ids[:1000], max_new_tokens=8)  # warm-up (kernels, cuDNN plans)
    out = llm.generate(ids, max_new_tokens=args.steps)
    res[f"tokens_graphs_{graphs}"] = out.token_ids
    res[f"decode_ms_per_step_graphs_{graphs}"] = 1e3 * out.metrics["decode_seconds"] / max(1, len(out.token_ids) - 1)
    res[f"prefill_s_graphs_{graphs}"] = out.metrics["prefill_seconds"]
res["same_tokens"] = res["tokens_graphs_False"] == res["tokens_graphs_True"]
n = next(i for i, (a, b) in enumerate(zip(res["tokens_graphs_False"] + [None], res["tokens_graphs_True"] + [-1])) if a != b)
res["first_difference_at"] = n
for k in ("tokens_graphs_False", "tokens_graphs_True"):
    res[k] = res[k][:16]
if llm.topology.rank == 0:
    print(json.dumps(res), flush=True)
