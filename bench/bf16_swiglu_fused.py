"""SwiGLU's silu-mul in the bf16 prefill: eager torch's two passes vs one kernel (issue 19: how much of the
128K `--fp8 linear,kv` gain over bf16 was this fusion alone; kernels/activation.py silu_mul).

    python bench/bf16_swiglu_fused.py [--prompt-lens 131072] [--rounds 2] [--kernel-rows [ROWS ...]] [--out f.json]

1. Kernel: silu(gate) * up of [rows, 2 x 14336] bf16 (Llama-8B) at 8K / 32K / 128K rows: torch's silu then
   multiply, and silu_mul_rows with each (columns per program, warps) tile; median of 10 calls (a device sync around each).
2. End to end: the bf16 prefill of the Llama-3.1-8B shape (random weights and token ids) with the model's
   silu_mul as the engine has it and as torch ops, alternating, `--rounds` times each after a warm-up
   each, per --prompt-lens length; the first new token of each is recorded (the kernel rounds as eager torch does: silu's result,
   then the product, so values agree within a last bit).
JSON to stdout (and --out).
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import starshard.engine.model as model_module
from starshard import LLM
from starshard.benchmarks.common import commit, timed_median
from starshard.benchmarks.prefill import prompt_ids
from starshard.config import SamplingConfig
from starshard.kernels.activation import silu_mul, silu_mul_rows, silu_mul_tile
from starshard.presets import PRESETS
from starshard.runtime.prompt import Prompt

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--prompt-lens", type=int, nargs="+", default=[131072])
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--kernel-rows", type=int, nargs="*", default=[8192, 32768, 131072], help="none: skip part 1")
ap.add_argument("--out", default=None)
args = ap.parse_args()
TILES = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]


def torch_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def timed(fn, reps=10):
    """Median ms per call (a device sync around each), after 3 warm-ups."""
    return round(1e3 * timed_median(fn, torch.device("cuda"), reps, 3), 4)


kernel = []
for M in args.kernel_rows:
    x = torch.randn(M, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    r = {"rows": M, "torch_ms": timed(lambda: torch_silu_mul(x)), "default_tile": silu_mul_tile(M, 14336),
         "max_abs_diff_vs_torch": (silu_mul_rows(x).float() - torch_silu_mul(x).float()).abs().max().item(), "tiles_ms": {}}
    for block, warps in TILES:
        t = dict(block=block, warps=warps)
        r["tiles_ms"][f"{block}x{warps}"] = timed(lambda: silu_mul_rows(x, tile=t))
    kernel.append(r)
    print(json.dumps(r), flush=True)
    x = None

with tempfile.TemporaryDirectory() as tmp:
    cfg_path = Path(tmp) / "config.json"
    cfg_path.write_text(json.dumps(PRESETS["llama-3.1-8b"]))
    llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=str(cfg_path))
runner, s = llm.runner, SamplingConfig()


def prefill(fn, ids):
    model_module.silu_mul = fn
    cache = runner.new_cache(len(ids) + 8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        tok = runner.prefill(Prompt(ids, len(ids)), cache, s, None)
    torch.cuda.synchronize()
    return time.perf_counter() - t, int(tok.reshape(-1)[0])


variants = {"torch_silu_then_mul": torch_silu_mul, "engine_one_kernel": silu_mul}
prefills = []
for length in args.prompt_lens:
    ids = prompt_ids(length, llm.config.vocab_size, None)
    ids = ids.tolist() if torch.is_tensor(ids) else ids
    times = {n: [] for n in variants}
    tokens = {n: prefill(fn, ids)[1] for n, fn in variants.items()}  # warm-ups
    for _ in range(args.rounds):
        for n, fn in variants.items():
            times[n].append(prefill(fn, ids)[0])
    row = {"prompt_len": length, "seconds": times, "best": {n: min(t) for n, t in times.items()}, "first_token": tokens}
    prefills.append(row)
    print(json.dumps(row), flush=True)
model_module.silu_mul = silu_mul
out = {"device": torch.cuda.get_device_name(), "commit": commit(), "kernel": kernel, "prefill": prefills}
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
