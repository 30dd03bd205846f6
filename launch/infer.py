#!/usr/bin/env python
"""starshard main job: run one prompt through a model and print the answer.

    python launch/infer.py                                   # embedded SmolLM2-135M-Instruct, CPU
    python launch/infer.py --model CKPT --context-file doc.txt --question "Who ...?" --json
    torchrun --nproc-per-node 4 launch/infer.py --tp 2 --pp 2 --model CKPT        # tensor x pipeline
    torchrun --nproc-per-node 4 launch/infer.py --tp 2 --cp 2 --cp-strategy ring  # tensor x context
    torchrun --nproc-per-node 4 launch/infer.py --cp 4 --cp-strategy usp --ulysses-degree 2
    python launch/infer.py --sparse minference --sparse-config cfg.json --context-file doc.txt --question "..."
    srun --ntasks 8 --gpus-per-task 1 python launch/infer.py --tp 4 --pp 2 ...     # in a Slurm allocation
    python launch/infer.py --random-weights llama-3.1-8b --prompt-len 4096 --max-new-tokens 16 --json
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
    par = ap.add_argument_group(
        "parallel layout (launch tp*pp*cp processes: torchrun --nproc-per-node N, or srun --ntasks N in a Slurm "
        "allocation; CUDA runs NCCL on cuda:LOCAL_RANK, CPU runs gloo)")
    par.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel size: heads and MLP columns split over this many ranks (must divide the "
                     "attention heads; the error lists the valid sizes)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline-parallel stages: layers split over this many ranks, prefill pipelined in chunks")
    par.add_argument("--pp-layers", type=lambda s: [int(x) for x in s.split(",")], default=None, metavar="N,N,..",
                     help="layers per pipeline stage, comma separated (default: even split, earlier stages take the "
                     "remainder); must match a converted checkpoint's split")
    par.add_argument("--cp", type=int, default=1, help="context-parallel size: ranks that share the sequence")
    par.add_argument("--cp-strategy", choices=["dense", "ring", "ulysses", "usp", "star", "apb"], default=None,
                     help="how the CP group splits the sequence: ring / ulysses / usp (exact), star / apb (approximate); "
                     "default dense for --cp 1, ring otherwise; composes with --tp (tp x cp ranks)")
    par.add_argument("--ulysses-degree", type=int, default=None,
                     help="usp: Ulysses ranks inside each ring rank (must divide --cp; default --cp, i.e. plain "
                     "Ulysses); keep them on one node, the all-to-alls are the bandwidth-hungry part")
    par.add_argument("--block-size", type=int, default=None,
                     help="star: context tokens per block (default: context / cp)")
    par.add_argument("--num-blocks", type=int, default=None,
                     help="star: cut the context into this many blocks instead of giving --block-size (default: "
                     "--cp); with --cp 1 this runs on one device exactly what that many hosts would")
    par.add_argument("--anchor-size", type=int, default=None,
                     help="star: anchor tokens (the context's first tokens) before each block (default: block size); "
                     "apb: anchor tokens per host (default: the paper's table, context/hosts/4 capped at 8192; 0 = none)")
    par.add_argument("--query-rank", type=int, default=None,
                     help="CP rank that owns the query and the generated tokens' KV (default: the last)")
    from starshard.parallel.context import add_apb_arguments, apb_cli_error

    add_apb_arguments(ap.add_argument_group("APB (--cp-strategy apb: anchors with the embedded query, compressed "
                                            "passing blocks; paper ablations: --anchor-size 0, --passing-size 0, "
                                            "--compressor random, --no-embed-query)"))
    sp = ap.add_argument_group("sparse prefill (approximate; decode stays dense)")
    sp.add_argument("--sparse", choices=["minference"], default=None,
                    help="sparse attention inside each shard during prefill: minference = per-head A-shape / "
                    "Vertical-Slash / Block-Sparse patterns; composes with dense, ulysses and star, not ring/usp")
    sp.add_argument("--sparse-config", default=None, metavar="FILE",
                    help="per-layer, per-head patterns (JSON from `python -m starshard.kernels.minference_search`, "
                    "or MInference's published per-model config); default: Vertical-Slash (1000, 6096) on every head")
    rt = ap.add_argument_group("runtime")
    rt.add_argument("--random-weights", default=None, metavar="CONFIG",
                    help="no checkpoint: random weights of this shape, a preset name (llama-3.1-8b, tiny, ...; see "
                    "starshard/presets.py) or a HF config.json path; the prompt is --prompt-len random token ids")
    rt.add_argument("--prompt-len", type=int, default=None,
                    help="use this many random token ids as the prompt (needed with --random-weights: no tokenizer)")
    rt.add_argument("--dist-timeout", type=float, default=600.0,
                    help="seconds any collective may wait before the run fails with an error")
    rt.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    rt.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    rt.add_argument("--no-cuda-graphs", action="store_true",
                    help="run decode steps eagerly (default on one GPU: each step replays a captured CUDA graph)")
    rt.add_argument("--json", action="store_true",
                    help="print one JSON object as the last stdout line (text, token_ids, prompt_tokens, timings)")
    args = ap.parse_args(argv)
    given = [x for x in ("prompt", "prompt_file", "context_file") if getattr(args, x) is not None]
    if len(given) > 1:
        ap.error(f"give only one of --prompt, --prompt-file, --context-file (got {', '.join('--' + g.replace('_', '-') for g in given)})")
    if (args.context_file is None) != (args.question is None):
        ap.error("--context-file and --question go together")
    if args.random_weights and args.model:
        ap.error("give --model or --random-weights, not both")
    if args.prompt_len is not None and (given or args.prompt is not None):
        ap.error("--prompt-len replaces the prompt: drop --prompt / --prompt-file / --context-file")
    if args.prompt_len is not None and args.prompt_len < 1:
        ap.error(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if args.sparse_config is not None and args.sparse is None:
        ap.error("--sparse-config needs --sparse minference")
    if args.random_weights and args.prompt_len is None:
        ap.error("--random-weights has no tokenizer: give --prompt-len N (random token ids)")
    bad = apb_cli_error(args, args.cp_strategy, args.cp)
    if bad:
        ap.error(bad)
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
    from starshard.checkpoints.load import CheckpointError
    from starshard.config import ParallelConfig
    from starshard.kernels.sparse import SparseConfig
    from starshard.parallel.context import APB_OPTIONS
    from starshard.parallel.topology import LayoutError

    try:
        parallel = ParallelConfig(
            tp=args.tp, pp=args.pp, cp=args.cp, cp_strategy=args.cp_strategy or ("dense" if args.cp == 1 else "ring"),
            pp_layers=args.pp_layers, block_size=args.block_size, anchor_size=args.anchor_size, num_blocks=args.num_blocks,
            query_rank=args.query_rank, ulysses_degree=args.ulysses_degree, timeout_s=args.dist_timeout,
            **{k: getattr(args, k) for k in APB_OPTIONS},
        )
        sparse = SparseConfig(args.sparse, args.sparse_config) if args.sparse else None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        llm = LLM(args.model, dtype=dtype, device=device, parallel=parallel, progress=not args.json,
                  random_weights=args.random_weights, sparse=sparse)
    except (LayoutError, CheckpointError) as e:  # a launch problem, not a bug: the message says what to change
        raise SystemExit(f"error: {e}") from None
    if args.prompt_len is not None:
        gen = torch.Generator().manual_seed(args.seed or 0)  # same ids on every rank
        kw = dict(prompt=torch.randint(0, llm.config.vocab_size, (args.prompt_len,), generator=gen).tolist())
    llm.runner.cuda_graphs = not args.no_cuda_graphs
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
