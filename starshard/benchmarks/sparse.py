"""MInference sparse prefill kernels vs dense attention -> JSON.

    python launch/bench.py sparse --out bench/results/sparse_h200.json            # 1 GPU, 32 x d128 bf16
    python launch/bench.py sparse --device cpu --lengths 256 --out /tmp/s.json     # code path check

Per length: torch's cuDNN SDPA (causal, under sdpa_kernel(CUDNN_ATTENTION)) and starshard's Triton
flash kernel as dense references; per pattern (--patterns, e.g. "vs:1000,6096;ashape:1024,4096;bs:100";
"vs_mi:V,S" is Vertical-Slash with MInference's raw slash estimate, "vs" leaves out column echoes):
index build alone, the sparse kernel alone, and the whole call (index + kernel, what a layer pays),
each the median of --repeats timed runs after --warmup, CUDA events on GPU. Also per pattern:
density (score entries the kernel computes / a dense causal kernel's), attention recall (share of
the dense softmax mass the pattern keeps) and the kernel's relative error against a masked dense
reference, both on --recall-blocks query row blocks spread over the sequence (the last included).

Inputs (--inputs): "structured" (default) gives every head a smooth latent shared by q and k
(a local band of attention whose width varies by head), a few hundred planted key columns that every
query likes (vertical lines, the first keys among them) and noise, so that estimates find real
structure as in trained models; "random" is i.i.d. normal (flat attention: sparse budgets then pick
scattered, near-random lines, a worst case for the kernels).
"""
from __future__ import annotations

import json
import statistics
import sys

import torch

from starshard.benchmarks.common import DTYPES, commit, device_name, timed_median, utc_now, write
from starshard.kernels import minference as mi
from starshard.kernels.flash import flash_attention

HELP = "MInference sparse prefill kernels vs dense attention"


def parse_patterns(spec: str) -> list[tuple[str, mi.HeadPattern]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, args = item.partition(":")
        nums = [int(x) for x in args.split(",") if x]
        if name in ("vs", "vertical_slash", "vs_mi"):
            out.append((f"{name}_{nums[0]}_{nums[1]}", mi.VerticalSlash(nums[0], nums[1])))
        elif name in ("ashape", "a_shape"):
            out.append((f"ashape_{nums[0]}_{nums[1]}", mi.AShape(nums[0], nums[1])))
        elif name in ("bs", "block_sparse"):
            out.append((f"bs_{nums[0]}", mi.BlockSparse(nums[0])))
        elif name == "dense":
            out.append(("dense_triton_sparse_kernel", mi.Dense()))
        else:
            raise SystemExit(f"unknown pattern {item!r}; use vs:V,S  vs_mi:V,S  ashape:SINK,LOCAL  bs:TOPK  dense")
    return out


def _ar1(L: int, dims: int, width: float, gen: torch.Generator, device) -> torch.Tensor:
    """A unit-variance AR(1) process over positions with correlation exp(-d / width): [L, dims]."""
    rho = float(torch.tensor(-1.0 / width, dtype=torch.float64).exp())
    chunk = max(16, min(L, int(16 * width)))  # rho**-chunk stays below e**16 in float64
    z = torch.empty(L, dims, dtype=torch.float64, device=device)
    prev = torch.randn(dims, generator=gen, dtype=torch.float64, device=device)
    c = (1 - rho * rho) ** 0.5
    for s in range(0, L, chunk):
        n = min(chunk, L - s)
        t = torch.arange(1, n + 1, dtype=torch.float64, device=device)
        eps = torch.randn(n, dims, generator=gen, dtype=torch.float64, device=device)
        inner = torch.cumsum(eps * rho ** (-t)[:, None], 0) * rho ** t[:, None]
        z[s : s + n] = rho ** t[:, None] * prev + c * inner
        prev = z[s + n - 1]
    return z


def make_inputs(kind: str, *, L: int, H: int, Hkv: int, D: int, dtype, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.empty(1, H, L, D, dtype=dtype, device=device)
    k = torch.empty(1, Hkv, L, D, dtype=dtype, device=device)
    v = torch.randn(1, Hkv, L, D, generator=gen, device=device).to(dtype)
    if kind == "random":
        q.copy_(torch.randn(1, H, L, D, generator=gen, device=device))
        k.copy_(torch.randn(1, Hkv, L, D, generator=gen, device=device))
        return q, k, v
    g = H // Hkv
    widths = (128.0, 512.0, 2048.0, 8192.0)
    dz = D - 8
    for hk in range(Hkv):
        z = _ar1(L, dz, widths[hk % len(widths)], gen, device).float()
        a = (10.0 * D**0.5 / dz) ** 0.5  # peak local logit ~10 (scale D**-0.5)
        u = torch.zeros(D, device=device)
        u[dz:] = 1.0 / (8**0.5)
        n_cols = max(4, L // 512)
        cols = torch.randperm(L, generator=gen, device=device)[:n_cols]
        planted = torch.zeros(L, device=device)
        planted[cols] = 7.0 * D**0.5
        planted[: min(4, L)] = 10.0 * D**0.5  # attention sinks
        kk = torch.zeros(L, D, device=device)
        kk[:, :dz] = a * z
        kk += planted[:, None] * u[None, :]
        kk += 0.3 * torch.randn(L, D, generator=gen, device=device)
        k[0, hk] = kk.to(dtype)
        for j in range(g):
            qq = torch.zeros(L, D, device=device)
            qq[:, :dz] = a * z
            qq += u[None, :]
            qq += 0.3 * torch.randn(L, D, generator=gen, device=device)
            q[0, hk * g + j] = qq.to(dtype)
    return q, k, v


def quality(q, k, v, out, groups, *, block_size: int, blocks: torch.Tensor, scale: float):
    """(recall, relative error of `out`) on the given row blocks, over all heads."""
    B, H, L, D = q.shape
    g = H // k.shape[1]
    rows = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()
    rows = rows[rows < L]
    vis = torch.zeros(H, rows.numel(), L, dtype=torch.bool, device=q.device)
    for grp in groups:
        m = mi.group_mask(grp, B=1, Lq=L, Lk=L, offset=0, block_size=block_size, blocks=blocks)[0]
        vis[grp.heads] = m[:, : rows.numel()]
    causal = torch.arange(L, device=q.device)[None, :] <= rows[:, None]
    recalls, num, den = [], 0.0, 0.0
    for h in range(H):
        s = (q[0, h, rows].float() @ k[0, h // g].float().T) * scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        kept = (p * vis[h]).sum(-1)
        recalls.append(kept.mean().item())
        ref = (p * vis[h]) @ v[0, h // g].float() / kept.clamp(min=1e-30)[:, None]
        num += (out[0, h, rows].float() - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return statistics.mean(recalls), (num / max(den, 1e-30)) ** 0.5


def add_arguments(p) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the kernels run (default: cuda where there is one; cpu checks the code path only)")
    p.add_argument("--lengths", default="32768,65536,131072", help="sequence lengths, comma-separated (default "
                   "32768,65536,131072)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="q / k / v dtype (default bfloat16)")
    p.add_argument("--patterns", default="vs:1000,6096;vs_mi:1000,6096;ashape:1024,4096;bs:100",
                   help="vs: Vertical-Slash (echo-free slash estimate), vs_mi: with MInference's raw estimate")
    p.add_argument("--block-size", type=int, default=64, help="rows and keys per block of the sparse kernels (default 64)")
    p.add_argument("--inputs", default="structured", choices=["structured", "random"],
                   help="structured (default): planted vertical lines and local bands, as trained heads have; "
                        "random: i.i.d. normal, the kernels' worst case (module doc)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement, the median kept (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before them (default 2)")
    p.add_argument("--recall-blocks", type=int, default=4, help="query row blocks for recall / error")
    p.add_argument("--launch", default=None, help="num_warps,num_stages of the sparse kernel (default: built-in)")
    p.add_argument("--no-flash", action="store_true", help="skip the Triton flash dense reference")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")


def run(args) -> dict:
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    H, D = args.heads, args.head_dim
    Hkv = args.kv_heads or H
    launch = tuple(int(x) for x in args.launch.split(",")) if args.launch else None
    patterns = parse_patterns(args.patterns)
    backend = "triton" if mi.triton_available(torch.empty(0, dtype=dtype, device=dev)) else "torch"
    result = {
        "kind": "sparse_attention",
        "device": device_name(dev),
        "date": utc_now(),
        "commit": commit(),
        "torch": torch.__version__,
        "triton": getattr(mi.triton, "__version__", None),
        "config": {"heads": H, "kv_heads": Hkv, "head_dim": D, "dtype": args.dtype, "block_size": args.block_size,
                   "inputs": args.inputs, "repeats": args.repeats, "warmup": args.warmup, "sparse_backend": backend,
                   "launch": launch or mi.default_settings(max(16, 1 << (D - 1).bit_length()))},
        "results": [],
    }
    for L in (int(x) for x in args.lengths.split(",")):
        q, k, v = make_inputs(args.inputs, L=L, H=H, Hkv=Hkv, D=D, dtype=dtype, device=dev, seed=args.seed)
        pos = torch.arange(L, device=dev)
        scale = D**-0.5
        row = {"length": L}
        kd, vd = (k, v) if Hkv == H else (k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1))
        if dev.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def dense():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=True)

            row["dense_cudnn_ms"] = timed_median(dense, dev, args.repeats, args.warmup) * 1e3
            if not args.no_flash:
                flash = lambda: flash_attention(q, k, v, q_pos=pos, k_pos=pos)  # noqa: E731
                row["dense_flash_triton_ms"] = timed_median(flash, dev, args.repeats, args.warmup) * 1e3
        else:
            def dense():
                return torch.nn.functional.scaled_dot_product_attention(q, kd, vd, is_causal=True)

            row["dense_sdpa_cpu_ms"] = timed_median(dense, dev, args.repeats, args.warmup) * 1e3
        dense_ms = row.get("dense_cudnn_ms", row.get("dense_sdpa_cpu_ms"))
        dcost = mi.dense_cost(Lq=L, Lk=L, offset=0, block_size=args.block_size)
        nM = mi._cdiv(L, args.block_size)
        blocks = torch.linspace(0, nM - 1, min(args.recall_blocks, nM)).round().long().unique().to(dev)
        row["patterns"] = []
        for name, hp in patterns:
            sp = mi.SparsePattern((hp,), block_size=args.block_size, vertical_aware=not name.startswith("vs_mi"))
            plan = lambda: mi.build_plan(q, k, sp, offset=0, scale=scale)  # noqa: E731
            groups = plan()
            kernel = lambda: mi.attention_from_plan(q, k, v, groups, offset=0, scale=scale,  # noqa: E731
                                                    block_size=args.block_size, backend=backend, launch=launch)
            total = lambda: mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=sp,  # noqa: E731
                                                    backend=backend, launch=launch)
            entry = {"name": name, "pattern": hp.to_dict()}
            entry["index_ms"] = timed_median(plan, dev, args.repeats, args.warmup) * 1e3
            entry["kernel_ms"] = timed_median(kernel, dev, args.repeats, args.warmup) * 1e3
            entry["total_ms"] = timed_median(total, dev, args.repeats, args.warmup) * 1e3
            entry["speedup_vs_dense"] = dense_ms / entry["total_ms"]
            entry["kernel_speedup_vs_dense"] = dense_ms / entry["kernel_ms"]
            cost = sum(int(mi.kernel_cost(gp, B=1, Lq=L, Lk=L, offset=0, block_size=args.block_size).sum()) for gp in groups)
            entry["density"] = cost / (dcost * H)
            out, _ = kernel()
            entry["recall"], entry["rel_err"] = quality(q, k, v, out, groups, block_size=args.block_size,
                                                        blocks=blocks, scale=scale)
            for gp in groups:
                if gp.kind == "vertical_slash":
                    entry["slash_runs_per_head"] = gp.index.seg_count.float().mean().item()
                    entry["columns_per_row_block"] = gp.index.col_count.float().mean().item()
            row["patterns"].append(entry)
            del groups, out
        result["results"].append(row)
        print(json.dumps(row), file=sys.stderr)
        del q, k, v, kd, vd
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    write(args.out, result)
    return result


