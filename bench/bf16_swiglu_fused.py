"""How much of the 128K FP8 prefill's gain over bf16 is the SwiGLU fusion alone? (issue 19, disclosure)

    python bench/bf16_swiglu_fused.py [--prompt-len 131072] [--rounds 2] [--out bf16_swiglu_fused.json]

The bf16 prefill computes SwiGLU's silu(gate) * up as eager torch does: a silu pass and a multiply pass
over [tokens, 14336] (396 ms of a 11.4 s 128K prefill on an H100, bench/results/2026-11-26-gpu-fp8-128k-
profile), where `--fp8 linear` runs one silu_mul_quant pass. This times the bf16 prefill of the Llama-3.1-8B
shape (random weights and token ids) as it is and with the model's silu_mul swapped for the one-launch
kernel (kernels/activation.py silu_mul_rows' kernel, eager torch's two roundings: values within a last
bit of torch's; 32768 rows a launch, under its grid's row limit), alternating, `--rounds` times each
after a warm-up each; the first new token of each is recorded. A measurement only: the engine's bf16 path is unchanged. JSON to stdout (and --out).
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import triton

import starshard.engine.model as model_module
from starshard import LLM
from starshard.benchmarks.common import commit
from starshard.benchmarks.prefill import prompt_ids
from starshard.config import SamplingConfig
from starshard.kernels import activation
from starshard.kernels.activation import silu_mul
from starshard.presets import PRESETS
from starshard.runtime.prompt import Prompt

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--prompt-len", type=int, default=131072)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--out", default=None)
args = ap.parse_args()

with tempfile.TemporaryDirectory() as tmp:
    cfg_path = Path(tmp) / "config.json"
    cfg_path.write_text(json.dumps(PRESETS["llama-3.1-8b"]))
    llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=str(cfg_path))
ids = prompt_ids(args.prompt_len, llm.config.vocab_size, None)
ids = ids.tolist() if torch.is_tensor(ids) else ids
runner, s = llm.runner, SamplingConfig()


def silu_mul_one_pass(gate_up):
    """silu_mul_rows' kernel over all rows, 32768 rows a launch into one output (no concatenation)."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    M, Fw = rows.shape[0], rows.shape[1] // 2
    y = torch.empty(M, Fw, dtype=rows.dtype, device=rows.device)
    block = min(activation.SILU_MUL_BLOCK, triton.next_power_of_2(Fw))
    for r in range(0, M, 32768):
        g, o = rows[r : r + 32768], y[r : r + 32768]
        activation._silu_mul_rows_kernel[(triton.cdiv(Fw, block), g.shape[0])](
            g, o, Fw, g.stride(0), o.stride(0), BLOCK=block, num_warps=4 if block >= 1024 else 2)
    return y.view(*gate_up.shape[:-1], Fw)


def prefill(fn):
    model_module.silu_mul = fn
    cache = runner.new_cache(len(ids) + 8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        tok = runner.prefill(Prompt(ids, len(ids)), cache, s, None)
    torch.cuda.synchronize()
    return time.perf_counter() - t, int(tok.reshape(-1)[0])


variants = {"torch_silu_then_mul": silu_mul, "one_pass_kernel": silu_mul_one_pass}
times = {n: [] for n in variants}
tokens = {n: prefill(fn)[1] for n, fn in variants.items()}  # warm-ups
for _ in range(args.rounds):
    for n, fn in variants.items():
        times[n].append(prefill(fn)[0])
model_module.silu_mul = silu_mul
out = {"device": torch.cuda.get_device_name(), "commit": commit(), "prompt_len": args.prompt_len,
       "seconds": times, "best": {n: min(t) for n, t in times.items()}, "first_token": tokens}
print(json.dumps(out))
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
