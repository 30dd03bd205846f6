#!/usr/bin/env python
"""starshard main job: run one prompt through a model and print the answer.

    python launch/infer.py                                   # embedded SmolLM2-135M-Instruct, CPU
    python launch/infer.py --model CKPT --context-file doc.txt --question "Who ...?" --json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Run a prompt through a model with starshard. With no --model, runs the embedded "
        "SmolLM2-135M-Instruct (converted once into the cache dir, $STARSHARD_CACHE or ~/.cache/starshard).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default=None,
                    help="starshard checkpoint dir, Hugging Face model dir, or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    src = ap.add_argument_group("prompt (pick one; default: a short built-in question)")
    src.add_argument("--prompt", help="the whole prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the whole prompt from this file")
    src.add_argument("--context-file", type=Path,
                     help="long context read from this file; use with --question (the query part)")
    src.add_argument("--question", help="the question asked about --context-file")
    ap.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen = ap.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (stops earlier at EOS)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    gen.add_argument("--prefill-chunk", type=int, default=None,
                     help="run the prompt through the model this many tokens at a time (bounds activation memory)")
    par = ap.add_argument_group("parallel layout (launch with torchrun --nproc-per-node tp*pp*cp)")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    par.add_argument("--cp", type=int, default=1, help="context-parallel size: ranks that share the sequence")
    par.add_argument("--cp-strategy", choices=["dense", "ring", "ulysses", "star"], default=None,
                     help="how the CP group splits the sequence: ring / ulysses (exact), star (approximate); "
                     "default dense for --cp 1, ring otherwise")
    par.add_argument("--block-size", type=int, default=None,
                     help="star: context tokens per block (default: context / cp)")
    par.add_argument("--anchor-size", type=int, default=None,
                     help="star: anchor tokens (the context's first tokens) before each block (default: block size)")
    par.add_argument("--query-rank", type=int, default=None,
                     help="CP rank that owns the query and the generated tokens' KV (default: the last)")
    rt = ap.add_argument_group("runtime")
    rt.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    rt.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    rt.add_argument("--json", action="store_true",
                    help="print one JSON object as the last stdout line (text, token_ids, prompt_tokens, timings)")
    args = ap.parse_args(argv)
    given = [x for x in ("prompt", "prompt_file", "context_file") if getattr(args, x) is not None]
    if len(given) > 1:
        ap.error(f"give only one of --prompt, --prompt-file, --context-file (got {', '.join('--' + g.replace('_', '-') for g in given)})")
    if (args.context_file is None) != (args.question is None):
        ap.error("--context-file and --question go together")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from starshard import LLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    kw = {}
    if args.context_file is not None:
        if not args.context_file.is_file():
            raise SystemExit(f"error: --context-file {args.context_file} does not exist")
        kw = dict(context=args.context_file.read_text(), question=args.question)
    elif args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise SystemExit(f"error: --prompt-file {args.prompt_file} does not exist")
        kw = dict(prompt=args.prompt_file.read_text())
    else:
        kw = dict(prompt=args.prompt if args.prompt is not None else DEFAULT_PROMPT)
    from starshard.config import ParallelConfig

    parallel = ParallelConfig(
        tp=args.tp, pp=args.pp, cp=args.cp, cp_strategy=args.cp_strategy or ("dense" if args.cp == 1 else "ring"),
        block_size=args.block_size, anchor_size=args.anchor_size, query_rank=args.query_rank,
    )
    llm = LLM(args.model, dtype=dtype, device=device, parallel=parallel, progress=not args.json)
    lead = llm.topology.rank == 0  # every rank runs the model; one prints
    out = llm.generate(
        **kw, raw=args.raw, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, prefill_chunk=args.prefill_chunk,
    )
    if not lead:
        return 0
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason, **out.metrics}))
    else:
        m = out.metrics
        print(out.text)
        print(f"[{m['prompt_tokens']} prompt tokens, prefill {m['prefill_seconds']:.2f} s, "
              f"{m['generated_tokens']} new tokens at {m['decode_tokens_per_second']:.1f} tok/s, {out.finish_reason}]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
