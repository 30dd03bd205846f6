"""Where a prefill makes the host wait for the GPU: torch's sync debug mode names each synchronizing call's
starshard line, during one `LLM.generate(..., max_new_tokens=1)` after a warm-up (random weights, bf16). A sync
drains the GPU's queue, which then idles while the host launches what follows (`bench prefill --idle`). JSON line
per strategy: {"strategy", "sync_sites": {site: count}}; the token's read at the prefill's end is
runtime/generate.py's.

    python tests/gpu/check_prefill_syncs.py --strategies dense,star:4,apb:4,minference,anchor
"""
import argparse
import json
import os
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

import starshard
from starshard import LLM
from starshard.config import ParallelConfig
from starshard.kernels.anchor_model import AnchorModelConfig
from starshard.kernels.sparse import SparseConfig
from starshard.presets import preset_config

PKG = str(Path(starshard.__file__).resolve().parent) + os.sep  # sites: the package's own lines

ap = argparse.ArgumentParser()
ap.add_argument("--random-weights", default="tiny")
ap.add_argument("--prompt-len", type=int, default=3001)
ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill in chunks of this many rows (the service's way)")
ap.add_argument("--fp8", default=None, help="what runs in FP8, as LLM's fp8 (e.g. kv,attention)")
ap.add_argument("--strategies", default="dense,star:4,apb:4",
                help="comma-separated NAME[:N]: N blocks (star) / hosts (apb) on this one device; minference and "
                     "anchor: dense with that sparse method forced at every length (anchor with one theta per head, "
                     "as a calibrated file holds)")
args = ap.parse_args()
for spec in args.strategies.split(","):
    name, _, n = spec.partition(":")
    opts = {} if not n else {"num_blocks": int(n)} if name == "star" else {"apb_hosts": int(n)}
    sparse = None
    if name in ("minference", "anchor"):
        path = None
        if name == "anchor":  # per-head thetas (the shipped Qwen file's form), each head's own
            cfg = preset_config(args.random_weights)
            path = os.path.join(tempfile.mkdtemp(), "anchor.json")
            AnchorModelConfig(layers=[{h: 4.0 + h for h in range(cfg.num_heads)}] * cfg.num_layers, block_q=64,
                              step=2).save(path)
        sparse, name = SparseConfig(name, config_path=path, min_length=0, fallback=False), "dense"
    llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=args.random_weights,
              parallel=ParallelConfig(cp_strategy=name, **opts), sparse=sparse, fp8=args.fp8)
    ids = torch.randint(100, llm.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    llm.generate(ids.tolist(), max_new_tokens=1, prefill_chunk=args.prefill_chunk)  # warm-up: kernels, plans
    torch.cuda.synchronize()
    sites = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("Synchronization debug mode is a prototype"):
            return  # torch's notice on switching the mode on, not a sync
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if str(Path(f.filename).resolve()).startswith(PKG)]
        if frames:
            sites[f"{str(Path(frames[-1].filename).resolve())[len(PKG):]}:{frames[-1].lineno}"] += 1
        else:  # not under a starshard line: name the thread, the innermost frame and the warning, to be found
            where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "no Python frame"
            sites[f"? {threading.current_thread().name} {where} {category.__name__}: {str(message)[:120]}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(ids.tolist(), max_new_tokens=1, prefill_chunk=args.prefill_chunk)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(json.dumps({"strategy": spec, "model": args.random_weights, "prompt_len": args.prompt_len,
                      "prefill_chunk": args.prefill_chunk, "fp8": args.fp8, "sync_sites": dict(sites.most_common())}))
    del llm
    torch.cuda.empty_cache()
