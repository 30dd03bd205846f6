#!/usr/bin/env python
"""MInference kernel variants on one GPU (issue 18, item 3): pair / flat / wide and launch settings.

    PYTHONPATH=. python bench/minference_kernel_variants.py --out r.json                  # SmolLM2: 9/3 heads, d64
    PYTHONPATH=. python bench/minference_kernel_variants.py --shape llama8b --out r.json   # 32/8 heads, d128
    # CPU smoke run under the interpreter (times meaningless):
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/minference_kernel_variants.py --device cpu --dtype float32 \\
        --length 512 --inputs structured --repeats 1 --warmup 0 --variants "default;pair+flat" --out /tmp/v.json

Inputs (--inputs): "model" captures layer --layer's post-RoPE q / k / v from one forward of the
embedded SmolLM2-135M over --length tokens of natural text (as bench/sparse_components.py; the
checkout's .smol GGUF parts must be present), "structured" is starshard.benchmarks.sparse's synthetic
q / k with local bands and planted columns, "random" i.i.d. normal; "auto" (default): model for the
SmolLM2 shape when it loads, else structured. Each --patterns entry (vs:V,S, ashape:SINK,LOCAL,
bs:TOPK; one pattern for every head) builds its index once (`build_plan`, timed as build_ms); then
every --variants entry (kernel.Launch specs "pair+flat:8,2", "default:4,3", ...; the first is the
reference) runs the kernel alone on that index: first_call_s (Triton compile included), kernel_ms
(CUDA events, median of --repeats after --warmup), FLOPs as `useful_flops` (4 * head_dim * the
default kernel's score entries, `plan.kernel_cost`, what bench/sparse_components.py rates) and
`computed_flops` (what this variant multiplies, `kernel.computed_entries`: more for paired ones),
`rate_vs_cudnn` (useful FLOP/s over cuDNN causal SDPA's FLOP/s at the same shape; target >= 0.8),
`max_abs_diff_vs_first` (whole output against the first variant's) and `max_abs_err_ref` (the rows
of --check-blocks row blocks against a float32 dense-masked reference of the same index).
--block128 also times the default kernel on an index built for 128-row blocks (its own visibility,
rated on its own kernel_cost). Variants left after --budget-s seconds are skipped (noted in the JSON).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402

from starshard.benchmarks.common import DTYPES, commit, device_name, timed, utc_now  # noqa: E402
from starshard.kernels import minference as mi  # noqa: E402
from starshard.kernels.minference import kernel as mk  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # query heads, KV heads, head dim
VARIANTS_D64 = ("default;default:4,3;default:8,2;wide;flat;flat:4,3;pair:4,2;pair:8,2;pair:8,3;pair+flat:4,2;"
                "pair+flat:8,2;pair+wide:8,2")
VARIANTS_D128 = "default;default:8,3;default:4,2;wide;flat;flat:8,3;pair:8,2;pair+flat:8,2"


def parse_patterns(spec: str) -> list:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, args = item.partition(":")
        n = [int(x) for x in args.split(",") if x]
        if name == "vs" and len(n) == 2:
            out.append((f"vs_{n[0]}_{n[1]}", mi.VerticalSlash(n[0], n[1])))
        elif name == "ashape" and len(n) == 2:
            out.append((f"ashape_{n[0]}_{n[1]}", mi.AShape(n[0], n[1])))
        elif name == "bs" and len(n) == 1:
            out.append((f"bs_{n[0]}", mi.BlockSparse(n[0])))
        else:
            raise SystemExit(f"error: pattern {item!r}: use vs:V,S  ashape:SINK,LOCAL  bs:TOPK")
    return out


# ---- inputs --------------------------------------------------------------------------------------


def model_inputs(args, dtype):
    """Layer --layer's q, k, v from one SmolLM2 forward over natural text (bench/sparse_components.py)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import sparse_components as sc

    import starshard

    llm = starshard.LLM(None, dtype=dtype, device=args.device, progress=False)
    if args.layer >= len(llm.model.layers):
        raise SystemExit(f"error: --layer {args.layer}: the model has {len(llm.model.layers)} layers")
    ids, source = sc.essay_token_ids(llm.tokenizer, args.length, None, args.seed)
    q, k, v = sc.capture_qkv(llm.model, ids, [args.layer])[args.layer]
    del llm
    return q, k, v, {"kind": "model", "model": "embedded SmolLM2-135M-Instruct", "layer": args.layer, "prompt": source}


def make_inputs(args, dtype, H, Hkv, D):
    kind = args.inputs
    if kind in ("auto", "model") and (H, Hkv, D) == SHAPES["smollm2"]:
        try:
            return model_inputs(args, dtype)
        except Exception as e:  # auto: no model files here -> synthetic
            if kind == "model":
                raise
            print(f"model inputs unavailable ({type(e).__name__}: {e}); using structured", file=sys.stderr)
    elif kind == "model":
        raise SystemExit("error: --inputs model needs the SmolLM2 shape (9 / 3 heads, head dim 64)")
    from starshard.benchmarks.sparse import make_inputs as synthetic

    kind = "random" if kind == "random" else "structured"
    q, k, v = synthetic(kind, L=args.length, H=H, Hkv=Hkv, D=D, dtype=dtype, device=torch.device(args.device),
                        seed=args.seed)
    return q, k, v, {"kind": kind, "generator": "starshard.benchmarks.sparse.make_inputs", "seed": args.seed}


# ---- timing, counting, checking ------------------------------------------------------------------


def ms(fn, dev, repeats, warmup) -> float:
    return statistics.median(timed(fn, dev, repeats, warmup)) * 1e3


def causal_pairs(L: int) -> int:
    return L * (L + 1) // 2


def dense_row(q, k, v, args) -> dict:
    B, Hq, L, D = q.shape
    g = Hq // k.shape[1]
    flops = 4 * D * causal_pairs(L) * B * Hq
    kx, vx = (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    dev = q.device
    if q.is_cuda and q.dtype != torch.float32:  # the aten op attention.py calls, lse on
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        t = ms(lambda: op(q, kx, vx, None, True, 0.0, True, False, scale=D**-0.5), dev, args.repeats, args.warmup)
        return {"causal_flops": flops, "cudnn_ms": t, "cudnn_tflops": flops / t / 1e9}
    t = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True), dev, args.repeats,
           args.warmup)
    return {"causal_flops": flops, "sdpa_ms": t, "note": "no cuDNN here: torch SDPA stands in (rates not meaningful)",
            "cudnn_tflops": flops / t / 1e9}


def reference_rows(q, k, v, groups, *, blocks, BM, scale):
    """float32 attention of the rows of `blocks` under the groups' visibility: (rows, [B, Hq, R, D])."""
    B, Hq, Lq, D = q.shape
    Lk, g = k.shape[2], Hq // k.shape[1]
    rows = (blocks[:, None] * BM + torch.arange(BM, device=q.device)).flatten()
    rows = rows[rows < Lq]
    ref = torch.zeros(B, Hq, rows.numel(), D, dtype=torch.float32, device=q.device)
    for grp in groups:
        vis = mi.group_mask(grp, B=B, Lq=Lq, Lk=Lk, offset=0, block_size=BM, blocks=blocks)[:, :, : rows.numel()]
        for j, h in enumerate(grp.heads):
            s = (q[:, h, rows].float() @ k[:, h // g].float().transpose(-1, -2)) * scale
            p = torch.softmax(s.masked_fill_(~vis[:, j], float("-inf")), -1).nan_to_num_(0.0)
            ref[:, h] = p @ v[:, h // g].float()
        del vis
    return rows, ref


def group_stats(groups) -> dict:
    st = {}
    for grp in groups:
        if grp.kind == "vertical_slash":
            ix = grp.index
            st.update(slash_runs_per_head=ix.seg_count.float().mean().item(),
                      columns_per_row_block=ix.col_count.float().mean().item(),
                      single_diagonal_runs=float(((ix.seg[..., 0] == ix.seg[..., 1]) &
                                                  (torch.arange(ix.seg.shape[2], device=ix.seg.device)
                                                   < ix.seg_count[..., None])).sum(-1).float().mean()))
    return st


def pattern_row(name, hp, q, k, v, args, dense, variants, t_start, block_size) -> dict:
    B, Hq, L, D = q.shape
    dev, scale, BM = q.device, D**-0.5, block_size
    sp = mi.SparsePattern((hp,), block_size=BM)
    plan = lambda: mi.build_plan(q, k, sp, offset=0, scale=scale)  # noqa: E731
    groups = plan()
    row = {"name": name, "pattern": hp.to_dict(), "block_size": BM,
           "build_ms": ms(plan, dev, max(1, args.repeats // 2), min(args.warmup, 1))}
    dense_tiles = mi.dense_cost(Lq=L, Lk=L, offset=0, block_size=BM)
    useful = sum(int(mi.kernel_cost(gp, B=B, Lq=L, Lk=L, offset=0, block_size=BM).sum()) for gp in groups)
    row.update(useful_flops=4 * D * useful, density=useful / (dense_tiles * B * Hq), **group_stats(groups))
    nM = mi._cdiv(L, BM)
    blocks = torch.tensor(sorted({nM // 2, nM - 1} if args.check_blocks >= 2 else {nM - 1}), device=dev)
    rows, ref = reference_rows(q, k, v, groups, blocks=blocks, BM=BM, scale=scale)
    row["check_rows"] = rows.numel()
    first_out, cudnn = None, dense["cudnn_tflops"]
    row["variants"] = []
    for spec in variants:
        launch = mk.Launch.parse(spec)
        ent = {"variant": spec}
        if time.time() - t_start > args.budget_s:
            ent["skipped"] = f"past --budget-s {args.budget_s}"
            row["variants"].append(ent)
            continue
        def run(launch=launch):
            return mk.attention_triton(q, k, v, groups, offset=0, scale=scale, block_size=BM, launch=launch)

        try:
            t0 = time.time()
            out, lse = run()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ent["first_call_s"] = round(time.time() - t0, 2)
            ent["kernel_ms"] = ms(run, dev, args.repeats, args.warmup)
        except Exception as e:  # a launch that does not compile or fit: say so, go on
            ent["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            row["variants"].append(ent)
            continue
        computed = sum(int(mk.computed_entries(gp, B=B, Lq=L, Lk=L, offset=0, block_size=BM, launch=launch).sum())
                       for gp in groups)
        ent["computed_flops"] = 4 * D * computed
        ent["useful_tflops"] = row["useful_flops"] / ent["kernel_ms"] / 1e9
        ent["computed_tflops"] = ent["computed_flops"] / ent["kernel_ms"] / 1e9
        ent["rate_vs_cudnn"] = ent["useful_tflops"] / cudnn
        ent["computed_rate_vs_cudnn"] = ent["computed_tflops"] / cudnn
        ent["speedup_vs_cudnn"] = dense.get("cudnn_ms", dense.get("sdpa_ms")) / ent["kernel_ms"]
        ent["max_abs_err_ref"] = (out[:, :, rows].float() - ref).abs().max().item()
        if first_out is None:
            first_out, first_lse = out, lse
            ent["max_abs_diff_vs_first"] = 0.0
        else:
            ent["max_abs_diff_vs_first"] = (out.float() - first_out.float()).abs().max().item()
            fin = torch.isfinite(first_lse)
            ent["max_lse_diff_vs_first"] = (lse[fin] - first_lse[fin]).abs().max().item() if bool(fin.any()) else 0.0
        row["variants"].append(ent)
        print(f"  {name} {spec:18s} {ent['kernel_ms']:8.3f} ms  rate/cudnn {ent['rate_vs_cudnn']:.3f} "
              f"(computed {ent['computed_rate_vs_cudnn']:.3f})  diff {ent['max_abs_diff_vs_first']:.2e}  "
              f"ref err {ent['max_abs_err_ref']:.2e}  first call {ent['first_call_s']} s", file=sys.stderr, flush=True)
    ok = [e for e in row["variants"] if "kernel_ms" in e]
    if ok:
        best = min(ok, key=lambda e: e["kernel_ms"])
        row.update(best_variant=best["variant"], best_kernel_ms=best["kernel_ms"],
                   best_rate_vs_cudnn=best["rate_vs_cudnn"])
    del groups, first_out, ref
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--out", default=None, help="output JSON (also printed)")
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES), help="heads / KV heads / head dim preset")
    p.add_argument("--heads", type=int, default=None, help="query heads (overrides --shape)")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--length", type=int, default=131072, help="tokens (queries = keys, causal; default 131072)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--inputs", default="auto", choices=["auto", "model", "structured", "random"])
    p.add_argument("--layer", type=int, default=15, help="layer captured for --inputs model (default 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--patterns", default="vs:1000,6096", help="';'-separated vs:V,S  ashape:SINK,LOCAL  bs:TOPK")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--variants", default=None,
                   help="';'-separated kernel.Launch specs, the first the reference (default: a sweep by head dim)")
    p.add_argument("--block128", action="store_true", help="also the default kernel on a 128-row-block index")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-blocks", type=int, default=2, choices=[1, 2], help="row blocks checked vs float32")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip variants not started by then")
    args = p.parse_args(argv)

    t_start = time.time()
    H0, Hkv0, D0 = SHAPES[args.shape]
    H, Hkv, D = args.heads or H0, args.kv_heads or Hkv0, args.head_dim or D0
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    variants = [s.strip() for s in (args.variants or (VARIANTS_D64 if D <= 64 else VARIANTS_D128)).split(";") if s.strip()]
    for s in variants:
        mk.Launch.parse(s)  # fail early on a typo
    patterns = parse_patterns(args.patterns)
    probe = torch.empty(0, dtype=dtype, device=dev)
    if not mi.triton_available(probe):
        raise SystemExit("error: the Triton kernel needs CUDA (or TRITON_INTERPRET=1 on CPU) and fp16/bf16/fp32")
    with torch.inference_mode():
        q, k, v, source = make_inputs(args, dtype, H, Hkv, D)
    inputs_s = time.time() - t_start
    result = {
        "kind": "minference_kernel_variants", "date": utc_now(), "device": device_name(dev), "commit": commit(),
        "torch": torch.__version__, "triton": getattr(mk.triton, "__version__", None), "cuda": torch.version.cuda,
        "shape": {"batch": 1, "heads": H, "kv_heads": Hkv, "head_dim": D, "length": args.length, "dtype": args.dtype},
        "inputs": source, "inputs_seconds": round(inputs_s, 2), "args": vars(args),
        "timing": {"repeats": args.repeats, "warmup": args.warmup, "statistic": "median",
                   "clock": "CUDA events" if dev.type == "cuda" else "perf_counter (CPU: meaningless)"},
        "target": "rate_vs_cudnn >= 0.8",
    }
    with torch.inference_mode():
        result["dense"] = dense_row(q, k, v, args)
        d = result["dense"]
        print(f"dense: {d.get('cudnn_ms', d.get('sdpa_ms')):.3f} ms, {d['cudnn_tflops']:.1f} TFLOP/s", file=sys.stderr)
        result["patterns"] = [pattern_row(n, hp, q, k, v, args, d, variants, t_start, args.block_size)
                              for n, hp in patterns]
        if args.block128:
            result["block128"] = [pattern_row(n, hp, q, k, v, args, d, ["default:8,2", "default:4,2", "default:8,3"],
                                              t_start, 128) for n, hp in patterns]
    result["total_seconds"] = round(time.time() - t_start, 1)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out} ({result['total_seconds']} s)", file=sys.stderr)
    else:
        print(text)
    return result


if __name__ == "__main__":
    main()
