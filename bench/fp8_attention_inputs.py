"""Does the FP8 prefill's attention run slower for the layout of v it gets? (issue 19, 128K `--fp8 linear,kv`)

    python bench/fp8_attention_inputs.py [--prompt-len 131072] [--rounds 2] [--out attention_inputs.json]

In a 32-layer 128K profile the cuDNN attention kernel took 259.3 ms per layer in the `linear,kv` prefill
and 256.8 ms in bf16 (bench/results/2026-11-26-gpu-fp8-128k-profile/run_b.log). The two paths hand it
different v: bf16 reads k and v back from its cache (contiguous [B, Hkv, L, D]); with an FP8 cache the
first block attends its own k (RoPE's contiguous output) and v, a strided view of the wqkv projection.
This times the `linear,kv` prefill of the Llama-3.1-8B shape (random weights and token ids) as it is and
with v made contiguous before attention (a 0.25 GB copy per layer at 128K), alternating, `--rounds`
times each after one warm-up each. JSON to stdout (and --out).
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from starshard import LLM
from starshard.benchmarks.common import commit
from starshard.benchmarks.prefill import prompt_ids
from starshard.config import SamplingConfig
from starshard.engine.model import dense_attend
from starshard.presets import PRESETS
from starshard.runtime.prompt import Prompt

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--prompt-len", type=int, default=131072)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--fp8", default="linear,kv")
ap.add_argument("--out", default=None)
args = ap.parse_args()

with tempfile.TemporaryDirectory() as tmp:
    cfg_path = Path(tmp) / "config.json"
    cfg_path.write_text(json.dumps(PRESETS["llama-3.1-8b"]))
    llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=str(cfg_path), fp8=args.fp8)
ids = prompt_ids(args.prompt_len, llm.config.vocab_size, None)
ids = ids.tolist() if torch.is_tensor(ids) else ids
runner, s = llm.runner, SamplingConfig()
layers = runner.model.layers


def attend_contiguous_v(q, k, v, pos, cache, sparse=None):
    return dense_attend(q, k, v.contiguous(), pos, cache, sparse)


def prefill(attend) -> float:
    for block in layers:
        block.attention.attend = attend
    cache = runner.new_cache(len(ids) + 8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        runner.prefill(Prompt(ids, len(ids)), cache, s, None)
    torch.cuda.synchronize()
    return time.perf_counter() - t


variants = {"as_is": dense_attend, "v_contiguous": attend_contiguous_v}
times = {name: [] for name in variants}
for name, fn in variants.items():
    prefill(fn)  # warm-up
for _ in range(args.rounds):
    for name, fn in variants.items():
        times[name].append(prefill(fn))
out = {"device": torch.cuda.get_device_name(), "commit": commit(), "prompt_len": args.prompt_len, "fp8": args.fp8,
       "seconds": times, "best": {n: min(t) for n, t in times.items()}}
print(json.dumps(out))
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
