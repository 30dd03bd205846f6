"""A prefill MLP run whole or a row chunk at a time, one GPU: time and peak memory.

At 128K rows the Llama-3.1-8B MLP's w13 writes a [rows, 2 x 14336] output (7.5 GB in bf16) that the
silu-mul and w2 then read; the planner counts the MLP part as the layer's activation peak (about twice
the attention part). This probe runs one decoder block's MLP half -- ffn_norm, w13, silu-mul, w2 plus
the residual, as engine/model.py TransformerBlock does -- on the whole [1, rows, h] hidden state, and
again `chunk` rows at a time into a preallocated output, in bf16 and with `--fp8 linear` (the FP8
layers of parallel/fp8.py: the norm and silu-mul quantize their rows inside the GEMMs' input kernels).
Random weights and hidden states (fine for dense speed). Reports the median time (CUDA events), the
peak memory above the inputs, and the chunked outputs' largest difference from the whole run (row
chunks change no row's arithmetic, so it should be 0).

    python bench/mlp_row_chunks.py [--rows 131072] [--chunks 0,8192,16384,32768] [--out mlp_row_chunks.json]
"""
import argparse
import dataclasses
import json

import torch

from starshard.benchmarks.common import commit, ints, timed_median
from starshard.engine.model import Transformer
from starshard.parallel.fp8 import fuse_inputs, quantize_linears
from starshard.presets import preset_config

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--preset", default="llama-3.1-8b")
ap.add_argument("--rows", type=int, default=131072)
ap.add_argument("--chunks", type=ints, default=[0, 8192, 16384, 32768], help="0: the whole rows at once")
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device("cuda")
cfg = dataclasses.replace(preset_config(args.preset), num_layers=1)


def mlp_half(block, h):
    return block.feed_forward(block.ffn_norm(h), residual=h)


def run(block, h, chunk):
    if not chunk:
        return mlp_half(block, h)
    out = torch.empty_like(h)
    for s in range(0, h.shape[1], chunk):
        out[:, s:s + chunk] = mlp_half(block, h[:, s:s + chunk])
    return out


rows = []
for precision in ("bf16", "fp8_linear"):
    torch.manual_seed(0)
    with torch.device(dev):
        model = Transformer(cfg).to(torch.bfloat16)
    model.tok_embeddings = model.output = None
    if precision == "fp8_linear":
        fuse_inputs(quantize_linears(model))
    block = model.layers[0]
    h = torch.randn(1, args.rows, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        whole = run(block, h, 0)
        for chunk in args.chunks:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            y = run(block, h, chunk)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            diff = (y.float() - whole.float()).abs().max().item()
            del y
            t = timed_median(lambda b=block, x=h, c=chunk: run(b, x, c), dev, args.repeats, warmup=1)
            row = dict(precision=precision, rows=args.rows, chunk=chunk, ms=1e3 * t, peak_gib=peak / 2**30,
                       max_abs_diff_vs_whole=diff)
            print(json.dumps(row), flush=True)
            rows.append(row)
    del model, block, h, whole
    torch.cuda.empty_cache()

result = dict(bench="mlp_row_chunks", commit=commit(), device=torch.cuda.get_device_name(dev), preset=args.preset,
              results=rows)
if args.out:
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
