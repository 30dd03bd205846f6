"""AnchorAttention vs cuDNN dense attention and MInference Vertical-Slash -> JSON.

    python launch/bench.py anchor --out bench/results/anchor_h100.json        # 1 GPU, 32 x d128 bf16, 32K-128K
    python launch/bench.py anchor --quick --out /tmp/a.json                    # small sizes
    TRITON_INTERPRET=1 python launch/bench.py anchor --device cpu --quick --out /tmp/a.json   # code path check

Per length: dense causal attention (torch's cuDNN kernel, aten._scaled_dot_product_cudnn_attention, on
GPU; torch SDPA on CPU). Per theta (--thetas): identification (anchor scores + stripe lists), the
sparse kernel alone and the whole call, each the median of --repeats timed runs after --warmup (CUDA
events on GPU); density (computed (row, key) pairs / causal pairs), recall (share of the dense softmax
mass of the visible keys that the selection keeps) and the relative output error against a masked
reference, both on --recall-blocks query blocks spread over the sequence (last included). Per
Vertical-Slash budget (--vs): the same numbers for MInference's kernel, and for each theta the
fastest VS budget whose recall is at least AnchorAttention's ("vs_at_matched_recall"). Identification
takes the model's default stripe kernel (kernels/anchor.py grouped_identify); with --group-heads, also
the per-head and the KV-grouped kernels each ("identify_per_head_ms", "identify_grouped_ms") and
whether they kept the same lists ("grouped_same_lists").

Inputs: `launch/bench.py sparse`'s "structured" (local bands, planted columns, sinks) or "random".
"""
from __future__ import annotations

import json
import sys

import torch

from starshard.benchmarks.common import DTYPES, commit, device_name, timed_median, utc_now, write
from starshard.benchmarks.sparse import make_inputs, quality
from starshard.kernels import anchor as an
from starshard.kernels import minference as mi

HELP = "AnchorAttention vs dense attention and MInference Vertical-Slash"
DEFAULTS_IN_HELP = True  # its flags' help shows their defaults


def anchor_quality(q, k, v, out, index, cfg, *, rows: torch.Tensor, scale: float):
    """(recall, relative error of `out`) on query rows `rows` (offset 0, Lq = Lk), over all heads."""
    B, H, L, D = q.shape
    g = H // k.shape[1]
    reg = an.anchor_region(cfg, Lq=L, Lk=L, offset=0, rows=rows)
    grp = rows // (cfg.block_q * cfg.step)
    causal = torch.arange(L, device=q.device)[None, :] <= rows[:, None]
    recalls, num, den = [], 0.0, 0.0
    for h in range(H):
        sel = torch.zeros(rows.numel(), L + 1, dtype=torch.bool, device=q.device)
        cnt = index.count[0, h, grp].long()
        ki = index.idx.shape[-1]
        if ki:
            ids = index.idx[0, h, grp].long()
            ids = torch.where(torch.arange(ki, device=q.device)[None, :] < cnt[:, None], ids, L)
            sel.scatter_(1, ids, True)
        vis = reg | sel[:, :L]
        s = (q[0, h, rows].float() @ k[0, h // g].float().T) * scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        kept = (p * vis).sum(-1)
        recalls.append(kept.mean().item())
        ref = (p * vis) @ v[0, h // g].float() / kept.clamp(min=1e-30)[:, None]
        num += (out[0, h, rows].float() - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return sum(recalls) / len(recalls), (num / max(den, 1e-30)) ** 0.5


def add_arguments(p) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 32768,65536,131072)")
    p.add_argument("--quick", action="store_true", help="small sizes: default lengths 4096,8192 on GPU (256 on CPU), at most 2 repeats and 1 warm-up")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads, MHA)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="q/k/v dtype")
    p.add_argument("--thetas", default="12", help="comma-separated AnchorAttention thresholds (paper: 12)")
    p.add_argument("--block-q", type=int, default=128, help="query rows per block (pooling and kernel)")
    p.add_argument("--block-k", type=int, default=64, help="keys per load in the kernels")
    p.add_argument("--init-tokens", type=int, default=128, help="initial keys always attended")
    p.add_argument("--local-window", type=int, default=0, help="window keys before each group")
    p.add_argument("--step", type=int, default=16, help="query blocks sharing one stripe selection")
    p.add_argument("--vs", default="1000,6096;2000,8192;4000,16384",
                   help="Vertical-Slash budgets 'vertical,slash;...' for the matched-recall comparison")
    p.add_argument("--vs-block-size", type=int, default=64, help="MInference block size")
    p.add_argument("--inputs", default="structured", choices=["structured", "random"], help="synthetic q/k/v kind")
    p.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--recall-blocks", type=int, default=4, help="query blocks for recall / error")
    p.add_argument("--launch", default=None, help="num_warps,num_stages of the sparse kernel (default: built-in)")
    p.add_argument("--group-heads", action="store_true",
                   help="also time identification with the per-head and the KV-grouped stripe kernels (identify_stripes "
                        "group_heads: each key tile loaded once for a KV head's query heads) and check they keep "
                        "the same lists")
    p.add_argument("--seed", type=int, default=0, help="input seed")
    p.add_argument("--out", default=None, help="JSON output path (also printed)")


def run(args) -> dict:
    dev = torch.device(args.device)
    if args.quick:
        args.lengths = args.lengths or ("4096,8192" if dev.type == "cuda" else "256")
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
    args.lengths = args.lengths or "32768,65536,131072"
    dtype = DTYPES[args.dtype]
    H, D = args.heads, args.head_dim
    Hkv = args.kv_heads or H
    launch = tuple(int(x) for x in args.launch.split(",")) if args.launch else None
    thetas = [float(x) for x in args.thetas.split(",")]
    vs_budgets = [tuple(int(x) for x in s.split(",")) for s in args.vs.split(";") if s.strip()]
    probe = torch.empty(0, dtype=dtype, device=dev)
    backend = "triton" if an.triton_available(probe) else "torch"
    result = {
        "kind": "anchor_attention",
        "device": device_name(dev),
        "date": utc_now(),
        "commit": commit(),
        "torch": torch.__version__,
        "config": {"heads": H, "kv_heads": Hkv, "head_dim": D, "dtype": args.dtype, "block_q": args.block_q,
                   "block_k": args.block_k, "init_tokens": args.init_tokens, "local_window": args.local_window,
                   "step": args.step, "vs_block_size": args.vs_block_size, "inputs": args.inputs,
                   "repeats": args.repeats, "warmup": args.warmup, "backend": backend, "launch": launch},
        "results": [],
    }
    for L in (int(x) for x in args.lengths.split(",")):
        q, k, v = make_inputs(args.inputs, L=L, H=H, Hkv=Hkv, D=D, dtype=dtype, device=dev, seed=args.seed)
        pos = torch.arange(L, device=dev)
        scale = D**-0.5
        row = {"length": L}
        kd, vd = (k, v) if Hkv == H else (k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1))
        if dev.type == "cuda":
            def dense():
                return torch.ops.aten._scaled_dot_product_cudnn_attention(q, kd, vd, None, False, 0.0, True, False,
                                                                          scale=scale)
            row["dense_cudnn_ms"] = timed_median(dense, dev, args.repeats, args.warmup) * 1e3
        else:
            def dense():
                return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=True)
            row["dense_sdpa_cpu_ms"] = timed_median(dense, dev, args.repeats, args.warmup) * 1e3
        dense_ms = row.get("dense_cudnn_ms", row.get("dense_sdpa_cpu_ms"))

        # ---- Vertical-Slash at several budgets ----
        nM = mi._cdiv(L, args.vs_block_size)
        vs_blocks = torch.linspace(0, nM - 1, min(args.recall_blocks, nM)).round().long().unique().to(dev)
        dcost = mi.dense_cost(Lq=L, Lk=L, offset=0, block_size=args.vs_block_size)
        row["vertical_slash"] = []
        for vert, slash in vs_budgets:
            sp = mi.SparsePattern((mi.VerticalSlash(vert, slash),), block_size=args.vs_block_size)
            groups = mi.build_plan(q, k, sp, offset=0, scale=scale)
            entry = {"vertical": vert, "slash": slash}
            entry["index_ms"] = timed_median(lambda: mi.build_plan(q, k, sp, offset=0, scale=scale), dev,
                                             args.repeats, args.warmup) * 1e3
            kernel = lambda: mi.attention_from_plan(q, k, v, groups, offset=0, scale=scale,  # noqa: E731
                                                    block_size=args.vs_block_size, backend=backend)
            entry["kernel_ms"] = timed_median(kernel, dev, args.repeats, args.warmup) * 1e3
            total = lambda: mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=sp,  # noqa: E731
                                                    backend=backend)
            entry["total_ms"] = timed_median(total, dev, args.repeats, args.warmup) * 1e3
            entry["speedup_vs_dense"] = dense_ms / entry["total_ms"]
            cost = sum(int(mi.kernel_cost(gp, B=1, Lq=L, Lk=L, offset=0, block_size=args.vs_block_size).sum())
                       for gp in groups)
            entry["density"] = cost / (dcost * H)
            out, _ = kernel()
            entry["recall"], entry["rel_err"] = quality(q, k, v, out, groups, block_size=args.vs_block_size,
                                                        blocks=vs_blocks, scale=scale)
            row["vertical_slash"].append(entry)
            del groups, out

        # ---- AnchorAttention at each theta ----
        nQ = mi._cdiv(L, args.block_q)
        a_blocks = torch.linspace(0, nQ - 1, min(args.recall_blocks, nQ)).round().long().unique().to(dev)
        rows = (a_blocks[:, None] * args.block_q + torch.arange(args.block_q, device=dev)).flatten()
        rows = rows[rows < L]
        row["anchor"] = []
        for theta in thetas:
            cfg = an.AnchorConfig(theta=theta, block_q=args.block_q, block_k=args.block_k,
                                  init_tokens=args.init_tokens, local_window=args.local_window, step=args.step)
            ident = lambda: an.build_index(q, k, cfg, offset=0, scale=scale, backend=backend)  # noqa: E731
            index = ident()
            entry = {"theta": theta, "config": cfg.to_dict()}
            entry["identify_ms"] = timed_median(ident, dev, args.repeats, args.warmup) * 1e3
            if args.group_heads:
                per_head = lambda: an.build_index(q, k, cfg, offset=0, scale=scale, backend=backend,  # noqa: E731
                                                  group_heads=False)
                grouped = lambda: an.build_index(q, k, cfg, offset=0, scale=scale, backend=backend,  # noqa: E731
                                                 group_heads=True)
                h_index, g_index = per_head(), grouped()
                entry["identify_per_head_ms"] = timed_median(per_head, dev, args.repeats, args.warmup) * 1e3
                entry["identify_grouped_ms"] = timed_median(grouped, dev, args.repeats, args.warmup) * 1e3
                kept = torch.arange(h_index.idx.shape[-1], device=dev) < h_index.count[..., None]
                entry["grouped_same_lists"] = bool(torch.equal(g_index.count, h_index.count)
                                                   and torch.equal(g_index.idx * kept, h_index.idx * kept))
            kernel = lambda: an.sparse_attention(q, k, v, index, cfg, offset=0, scale=scale,  # noqa: E731
                                                 backend=backend, launch=launch)
            entry["kernel_ms"] = timed_median(kernel, dev, args.repeats, args.warmup) * 1e3
            total = lambda: an.anchor_attention(q, k, v, q_pos=pos, k_pos=pos, config=cfg,  # noqa: E731
                                                scale=scale, backend=backend, launch=launch)
            entry["total_ms"] = timed_median(total, dev, args.repeats, args.warmup) * 1e3
            entry["speedup_vs_dense"] = dense_ms / entry["total_ms"]
            entry["density"] = an.density(index, cfg, Lq=L, Lk=L, offset=0)
            entry["sparsity"] = 1.0 - entry["density"]
            out, _ = kernel()
            entry["recall"], entry["rel_err"] = anchor_quality(q, k, v, out, index, cfg, rows=rows, scale=scale)
            matched = [e for e in row["vertical_slash"] if e["recall"] >= entry["recall"]]
            best = min(matched, key=lambda e: e["total_ms"]) if matched else None
            entry["vs_at_matched_recall"] = None if best is None else {
                "vertical": best["vertical"], "slash": best["slash"], "recall": best["recall"],
                "total_ms": best["total_ms"], "anchor_speedup": best["total_ms"] / entry["total_ms"]}
            row["anchor"].append(entry)
            del index, out
        result["results"].append(row)
        print(json.dumps(row), file=sys.stderr)
        del q, k, v, kd, vd
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    write(args.out, result)
    return result


