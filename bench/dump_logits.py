"""Logits and greedy tokens of a small random-weight model on one device, to compare two trees bit for bit
(run it under each, then `--compare A B`): a change meant to move memory, not numbers, must give the same
bytes. The model is a preset (default Llama-3.1-8B's shape) cut to --layers layers; random token ids.

    python bench/dump_logits.py --layers 2 --prompt-len 8192 [--fp8 linear,kv] [--sparse minference] --out a.pt
    python bench/dump_logits.py --compare a.pt b.pt
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from starshard import LLM
from starshard.benchmarks.prefill import prompt_ids
from starshard.kernels.sparse import SparseConfig
from starshard.presets import PRESETS

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--preset", default="llama-3.1-8b")
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--prompt-len", type=int, default=8192)
ap.add_argument("--new-tokens", type=int, default=16)
ap.add_argument("--fp8", default=None)
ap.add_argument("--sparse", default=None, choices=["minference", "anchor"])
ap.add_argument("--out", default=None)
ap.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"))
args = ap.parse_args()

if args.compare:
    a, b = (torch.load(p) for p in args.compare)
    same = {k: torch.equal(a[k], b[k]) for k in a}
    diff = {k: ((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item()
            for k in a if a[k].is_floating_point()}
    print(json.dumps(dict(equal=same, rel_diff=diff)))
    sys.exit(0 if all(same.values()) else 1)

sparse = SparseConfig(args.sparse, min_length=0, fallback=False) if args.sparse else None
with tempfile.TemporaryDirectory() as tmp:
    cfg = Path(tmp) / "config.json"
    cfg.write_text(json.dumps(dict(PRESETS[args.preset], num_hidden_layers=args.layers)))
    torch.manual_seed(0)
    llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=str(cfg), fp8=args.fp8, sparse=sparse)
ids = prompt_ids(args.prompt_len, llm.config.vocab_size, None)
ids = ids.tolist() if torch.is_tensor(ids) else ids
with torch.inference_mode():
    logits = llm.runner.model(torch.tensor([ids], device="cuda"))[0, -64:].float().cpu()
out = llm.generate(ids, raw=True, max_new_tokens=args.new_tokens)
torch.save(dict(logits=logits, tokens=torch.tensor(out.token_ids)), args.out)
print(json.dumps(dict(out=args.out, tokens=out.token_ids)))
