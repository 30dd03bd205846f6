"""FP8 fidelity on real weights (the embedded SmolLM2-135M-Instruct), any device: for each --fp8 choice,
the relative error of the prompt's logits against the same model without FP8 (float32), top-1 agreement
over the prompt's positions; then decode teacher-forced along the reference's greedy continuation
(so every config sees the same tokens): the step logits' error and how often the argmax is the reference's
next token; and each config's own greedy continuation compared token by token. Config `bf16` (no FP8,
bfloat16 compute) puts the numbers in scale.

    python bench/fp8_fidelity.py --length 1024 --new-tokens 32 --out fp8_fidelity.json

Prompt: the harness's essay-like filler (bench/make_essay.py's text) with a question, natural text.
On the CPU the FP8 paths are the reference (kernels/fp8.py): e4m3 weights with per-channel scales,
activations rounded per row above 64 rows as the FP8 GEMM does, the KV cache in e4m3 per (head, token).
"""
import argparse
import json
import random

import torch

from starshard import LLM
from starshard.evaluation.tasks import essay_unit

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--length", type=int, default=1024, help="prompt tokens")
ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared")
ap.add_argument("--device", default="cpu")
ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
ap.add_argument("--configs", default="bf16,linear,kv,linear+kv",
                help="comma-separated: bf16, or '+'-joined --fp8 items")
ap.add_argument("--out", default=None)
args = ap.parse_args()
dtype = getattr(torch, args.dtype)
rng = random.Random(0)
text = "".join(essay_unit(rng, i) for i in range(4 * args.length // 5))


def run(fp8, dt, forced=None):
    """(prompt logits [L, V], teacher-forced step logits [n, V] along `forced`, own greedy tokens)."""
    llm = LLM(device=args.device, dtype=dt, fp8=fp8, progress=False)
    ids = llm.tokenizer.encode(text)[: args.length]
    model, steps = llm.runner.model, []
    with torch.inference_mode():
        cache = llm.runner.new_cache(len(ids) + args.new_tokens + 1)
        logits = model(torch.tensor([ids], device=llm.device), cache=cache).float()[0]
        for t in (forced or [])[:-1]:
            steps.append(model(torch.tensor([[t]], device=llm.device), cache=cache).float()[0, -1])
    out = llm.generate(ids, raw=True, max_new_tokens=args.new_tokens)
    return logits, torch.stack(steps) if steps else None, out.token_ids


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


_, _, ref_tokens = run(None, dtype)
ref_logits, ref_steps, _ = run(None, dtype, ref_tokens)
rows = []
for cfg in args.configs.split(","):
    fp8 = None if cfg == "bf16" else cfg.replace("+", ",")
    logits, steps, tokens = run(fp8, torch.bfloat16 if cfg == "bf16" else dtype, ref_tokens)
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
    nxt = torch.tensor(ref_tokens[1:])
    row = {"config": cfg, "fp8": fp8, "prompt_logits_rel_err": rel(logits, ref_logits),
           "prompt_top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
           "decode_logits_rel_err": rel(steps, ref_steps),
           "decode_top1_is_reference_next": (steps.argmax(-1).cpu() == nxt).float().mean().item(),
           "greedy_tokens_equal_prefix": same, "greedy_tokens_equal": sum(a == b for a, b in zip(tokens, ref_tokens))}
    rows.append(row)
    print(row, flush=True)
result = {"model": "SmolLM2-135M-Instruct (embedded)", "device": args.device, "dtype": args.dtype,
          "prompt": f"essay filler, {args.length} tokens", "new_tokens": args.new_tokens, "rows": rows}
if args.out:
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
