"""Hugging Face transformers prefill (SDPA, random weights of a preset's shape), the single-GPU peer of
`launch/bench.py prefill`: the same FLOP count and matmul peak.

    python launch/bench.py hf --random-weights llama-3.1-8b --lengths 8192
"""
from __future__ import annotations

import json
import sys

import torch

from starshard.benchmarks.common import add_common_arguments, commit, device_name, median, timed, today, write
from starshard.benchmarks.prefill import matmul_peak, prefill_flops
from starshard.presets import PRESETS, preset_config

HELP = "Hugging Face transformers prefill (SDPA), the single-GPU peer"


def add_arguments(p) -> None:
    add_common_arguments(p)
    p.add_argument("--random-weights", default="llama-3.1-8b", help="preset name")


def run(args) -> None:
    import transformers

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = transformers.LlamaConfig(**{k: v for k, v in PRESETS[args.random_weights].items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).eval()
    peak = matmul_peak(dev)
    rows = []
    for L in args.lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, L), device=dev)

        def run_once():
            with torch.inference_mode():
                model(ids, use_cache=False, logits_to_keep=1)

        try:
            t = median(timed(run_once, dev, args.repeats))
            flops = prefill_flops(preset_config(args.random_weights), L)["total"]
            rows.append({"length": L, "prefill_seconds": t, "mfu": flops / t / peak})
        except torch.OutOfMemoryError:
            rows.append({"length": L, "error": "out of memory"})
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"kind": "hf-prefill", "device": device_name(dev), "gpus": 1, "date": today(), "commit": commit(),
              "transformers": transformers.__version__, "args": vars(args),
              "matmul_peak_tflops": peak / 1e12, "results": rows}
    write(args.out, result)
