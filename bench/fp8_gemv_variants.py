"""Ways to read an e4m3 weight in a one-row GEMV (issue 19, decode at 128K): which one streams the
weight bytes fastest on one GPU. Variants (all one program per BLOCK_N output columns):
- `f32`: the kernel in kernels/fp8.py (e4m3 -> float32 conversion, a row sum per K tile);
- `f32-2d`: the same conversion, a [BLOCK_N, BLOCK_K] float32 accumulator summed once at the end;
- `bits`: e4m3 bytes turned into float32 bit patterns by integer ops ((b & 0x7F) << 20 | sign << 24:
  the value times 2^-120, exact for every finite e4m3 incl. subnormals), 2^120 folded into the scale;
- `dot8`: tensor cores on e4m3 x e4m3: the row is quantized per row in the prologue (as the prefill
  path quantizes activations), the row padded to BLOCK_M rows;
- `dot16`: tensor cores in fp16 (weights e4m3 -> fp16, the row clamped to fp16's range).
Each call cycles through copies of the weight (>= 256 MB in all) so nothing is served from L2.

    python bench/fp8_gemv_variants.py --out fp8_gemv_variants.json
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from starshard.benchmarks.common import graph_time_us
from starshard.kernels.fp8 import gemv_tile_for, quantize_rows, weight_only_linear

SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}


@triton.jit
def _gemv_2d(X, W, S, Y, N, K, s_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = W + offs_n[:, None].to(tl.int64) * s_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(X + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if BITS:
            b = tl.load(w_rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.uint32)
            wf = (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
        else:
            wf = tl.load(w_rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += wf * x[None, :]
    out = tl.sum(acc, axis=1) * tl.load(S + offs_n, mask=n_ok, other=0.0)
    if BITS:
        out = out * 1.329227995784916e36  # 2^120
    tl.store(Y + offs_n, out.to(Y.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_dot(X, W, S, Y, N, K, s_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              FP8: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < 1
    xs = 1.0
    if FP8:  # the row's e4m3 scale (amax / 448), as quantize_rows
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(tl.load(X + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)))
        xs = tl.maximum(tl.max(amax, 0), 1e-12) / 448.0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(X + offs_m[:, None] * 0 + k0 + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * s_wn + k0 + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        if FP8:
            x8 = tl.minimum(tl.maximum(x.to(tl.float32) / xs, -448.0), 448.0).to(tl.float8e4nv)
            acc = tl.dot(x8, w, acc)
        else:
            x16 = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
            acc = tl.dot(x16, w.to(tl.float16), acc)
    out = acc * (xs * tl.load(S + offs_n, mask=n_ok, other=0.0))[None, :]
    tl.store(Y + offs_m[:, None] * 0 + offs_n[None, :], out.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def run_variant(name, cfg, x, w8, ws, y):
    N, K = w8.shape
    if name == "f32":
        return weight_only_linear(x, w8, ws, gemv_tile=dict(block_n=cfg[0], block_k=cfg[1], warps=cfg[2]))
    if name in ("f32-2d", "bits"):
        bn, bk, warps, stages = cfg
        wt = w8.view(torch.uint8) if name == "bits" else w8
        _gemv_2d[(triton.cdiv(N, bn),)](x, wt, ws, y, N, K, w8.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                        BITS=name == "bits", num_warps=warps, num_stages=stages)
        return y
    bm, bn, bk, warps, stages = cfg
    _gemv_dot[(triton.cdiv(N, bn),)](x, w8, ws, y, N, K, w8.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                     FP8=name == "dot8", num_warps=warps, num_stages=stages)
    return y


CONFIGS = {
    "f32": [(4, 512, 2), (4, 1024, 4), (4, 2048, 2), (4, 2048, 4)],
    "f32-2d": [(bn, bk, w, s) for bn, bk in ((2, 2048), (4, 1024), (4, 2048), (8, 512), (8, 1024)) for w in (2, 4)
               for s in (2, 3)],
    "bits": [(bn, bk, w, s) for bn, bk in ((2, 2048), (4, 1024), (4, 2048), (8, 512), (8, 1024)) for w in (2, 4)
             for s in (2, 3)],
    "dot8": [(bm, bn, bk, 4, s) for bm in (16, 64) for bn in (16, 32, 64) for bk in (128, 256, 512) for s in (3, 5)],
    "dot16": [(16, bn, bk, 4, s) for bn in (16, 32, 64) for bk in (128, 256) for s in (3, 5)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=",".join(CONFIGS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "rows": []}
    sums = {}
    for shape, (N, K) in SHAPES.items():
        copies = max(2, -(-256 * 2**20 // (N * K)))
        w8s, wss = [], []
        for _ in range(copies):
            w8, ws = quantize_rows(torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5)
            w8s.append(w8)
            wss.append(ws)
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        want = x.double() @ (w8s[0].double() * wss[0].double()[:, None]).t()
        for name in args.variants.split(","):
            for cfg in CONFIGS[name]:
                key = f"{name} {cfg}"
                try:
                    out = run_variant(name, cfg, x, w8s[0], wss[0], y).clone()
                    err = ((out.double() - want).norm() / want.norm()).item()
                    us = graph_time_us(lambda i: run_variant(name, cfg, x, w8s[i], wss[i], y), 24, best=True, copies=copies)
                except Exception as e:  # a tile the compiler refuses
                    res["rows"].append({"shape": shape, "variant": key, "error": str(e)[:300]})
                    print(shape, key, "failed", str(e)[:200], flush=True)
                    continue
                row = {"shape": shape, "N": N, "K": K, "variant": key, "us": us, "tb_per_s": N * K / us / 1e6,
                       "rel_err_vs_float64": err}
                res["rows"].append(row)
                sums.setdefault(key.replace(shape, ""), {})[shape] = us
                print(f"{shape:5s} {key:32s} {us:8.2f} us {N * K / us / 1e6:5.2f} TB/s err {err:.2e}", flush=True)
        default = gemv_tile_for(N, K)
        print(shape, "default tile", default, flush=True)
    best = {}
    for shape in SHAPES:
        rows = [r for r in res["rows"] if r["shape"] == shape and "us" in r]
        for fam in CONFIGS:
            fr = [r for r in rows if r["variant"].startswith(fam + " ")]
            if fr:
                b = min(fr, key=lambda r: r["us"])
                best.setdefault(fam, {})[shape] = {"variant": b["variant"], "us": b["us"], "tb_per_s": b["tb_per_s"],
                                                   "rel_err": b["rel_err_vs_float64"]}
    for fam, per in best.items():
        tot = sum(v["us"] for v in per.values())
        print(f"best {fam}: layer sum {tot:.1f} us", {k: (v['variant'], round(v['us'], 2), round(v['tb_per_s'], 2)) for k, v in per.items()}, flush=True)
    res["best_per_variant"] = best
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
