"""FP8 prefill projections with the activation quantization fused into the norm / silu-mul (issue 19).

    python bench/fp8_prefill_fused.py [--out fp8_prefill_fused.json] [--rows 8192 32768]

One Llama-3.1-8B decoder layer's projections (hidden 4096, wqkv 6144, wo 4096, w13 2 x 14336, w2;
random weights, attention itself left out) at 8K and 32K rows on one GPU, three ways:
- bf16: RMSNorm (F.rms_norm) -> F.linear, F.linear (wo), RMSNorm -> F.linear -> silu * up -> F.linear;
- fp8_unfused: the same chain with Fp8Linear as before issue 19's fusion: the norm and silu-mul in
  bf16, then quantize_rows (one Triton pass) and torch._scaled_mm per projection;
- fp8_fused: Fp8Linear with its input transform (parallel/fp8.fuse_inputs): rms_norm_quant /
  silu_mul_quant (kernels/activation.py) write e4m3 directly, then torch._scaled_mm.
Times: CUDA events, median of 20 after 3 warm-ups, the whole chain and each step. Errors: fused vs
unfused outputs (relative Frobenius; the norm path should agree to the bit up to sum-order ties, the
silu path rounds once instead of twice), both vs bf16, and the share of e4m3 bytes that differ.
Kernel layouts: silu_mul_quant at F = 14336 (and 7168, one TP=2 rank) with the default tile, one
register tile and other looping tiles, against the unfused silu-mul + quantize_rows.
JSON to stdout (and --out): device, torch and triton versions, shapes. About 30 s on one H200.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton

from starshard.engine.model import RMSNorm
from starshard.kernels.activation import LOOP_TILE, ONE_TILE_MAX, rms_norm_quant, silu_mul, silu_mul_quant
from starshard.kernels.fp8 import quantize_rows_cuda
from starshard.parallel.fp8 import DeferredRMSNorm, Fp8Linear

H, QKV, FFN, EPS = 4096, (32 + 2 * 8) * 128, 14336, 1e-5


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return round(statistics.median(ts), 4)  # ms


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def differing_bytes(a8, b8):
    return (a8.view(torch.uint8) != b8.view(torch.uint8)).float().mean().item()


def layer(dev, dtype):
    """bf16 weights and norms, and the FP8 modules unfused / fused on the same e4m3 bytes."""
    g = torch.Generator(device=dev).manual_seed(0)

    def linear(n, k):
        return torch.randn(n, k, device=dev, generator=g, dtype=dtype) / k**0.5

    w = {"wqkv": linear(QKV, H), "wo": linear(H, H), "w13": linear(2 * FFN, H), "w2": linear(H, FFN)}
    norms = []
    for _ in range(2):
        n = RMSNorm(H, EPS).to(dev, dtype)
        n.weight.data = torch.rand(H, device=dev, generator=g, dtype=dtype) + 0.5
        norms.append(n)
    unfused = {k: Fp8Linear.quantize(_Wrap(v)) for k, v in w.items()}
    fused = {k: Fp8Linear(m.weight, m.weight_scale) for k, m in unfused.items()}
    fused["wqkv"].fuse_norm(DeferredRMSNorm.of(norms[0]))
    fused["w13"].fuse_norm(DeferredRMSNorm.of(norms[1]))
    fused["w2"].input_act = "silu_mul"
    return w, norms, unfused, fused


class _Wrap:
    """What Fp8Linear.quantize reads from a linear: its weight."""

    def __init__(self, weight):
        self.weight = weight


def chains(w, norms, unfused, fused):
    """Each variant as steps (name -> fn(x, attn, h, gate_up)) returning the step's output."""
    an, fn = norms
    bf16 = {
        "norm+wqkv": lambda x, a, h, gu: F.linear(an(x), w["wqkv"]),
        "wo": lambda x, a, h, gu: F.linear(a, w["wo"]),
        "norm+w13": lambda x, a, h, gu: F.linear(fn(h), w["w13"]),
        "silu_mul+w2": lambda x, a, h, gu: F.linear(silu_mul(gu), w["w2"]),
    }
    u = {
        "norm+wqkv": lambda x, a, h, gu: unfused["wqkv"](an(x)),
        "wo": lambda x, a, h, gu: unfused["wo"](a),
        "norm+w13": lambda x, a, h, gu: unfused["w13"](fn(h)),
        "silu_mul+w2": lambda x, a, h, gu: unfused["w2"](silu_mul(gu)),
    }
    f = {
        "norm+wqkv": lambda x, a, h, gu: fused["wqkv"](x),
        "wo": lambda x, a, h, gu: fused["wo"](a),
        "norm+w13": lambda x, a, h, gu: fused["w13"](h),
        "silu_mul+w2": lambda x, a, h, gu: fused["w2"](gu),
    }
    return {"bf16": bf16, "fp8_unfused": u, "fp8_fused": f}


def kernel_layouts(dev, dtype, rows):
    """silu_mul_quant's tile layouts and rms_norm_quant against their unfused counterparts (ms)."""
    out = {}
    g = torch.Generator(device=dev).manual_seed(1)
    for width in (FFN, FFN // 2):
        gu = torch.randn(rows, 2 * width, device=dev, generator=g, dtype=dtype)
        r = {"unfused_silu_mul+quantize_rows": timed(lambda: quantize_rows_cuda(silu_mul(gu)))}
        tiles = {"default": None, "one_tile": dict(block=triton.next_power_of_2(width), warps=16),
                 "loop_2048_w4": dict(block=2048, warps=4), "loop_4096_w8": dict(block=4096, warps=8),
                 "loop_8192_w16": dict(block=8192, warps=16)}
        for name, tile in tiles.items():
            r[name] = timed(lambda tile=tile: silu_mul_quant(gu, tile=tile))
        out[f"silu_mul_quant_F{width}"] = r
        del gu
    x = torch.randn(rows, H, device=dev, generator=g, dtype=dtype)
    wn = torch.rand(H, device=dev, generator=g, dtype=dtype) + 0.5
    out[f"rms_norm_quant_K{H}"] = {
        "unfused_rms_norm+quantize_rows": timed(lambda: quantize_rows_cuda(F.rms_norm(x, (H,), wn, EPS))),
        "rms_norm_alone": timed(lambda: F.rms_norm(x, (H,), wn, EPS)),
        "default": timed(lambda: rms_norm_quant(x, wn, EPS)),
        "loop_1024_w4": timed(lambda: rms_norm_quant(x, wn, EPS, tile=dict(block=1024, warps=4))),
    }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "shape": dict(hidden=H, wqkv=QKV, wo=H, w13=2 * FFN, w2_in=FFN, dtype=str(dtype)),
           "one_tile_max": ONE_TILE_MAX, "loop_tile": LOOP_TILE, "rows": {}}
    w, norms, unfused, fused = layer(dev, dtype)
    variants = chains(w, norms, unfused, fused)
    for M in args.rows:
        g = torch.Generator(device=dev).manual_seed(M)
        x, attn, h = (torch.randn(M, H, device=dev, generator=g, dtype=dtype) for _ in range(3))
        gate_up = torch.randn(M, 2 * FFN, device=dev, generator=g, dtype=dtype)
        ins = (x, attn, h, gate_up)
        r = {"ms": {}, "speedup_vs_bf16": {}, "rel_err": {}}
        outs = {}
        for name, steps in variants.items():
            outs[name] = {s: fn(*ins) for s, fn in steps.items()}
            per = {s: timed(lambda fn=fn: fn(*ins)) for s, fn in steps.items()}
            per["layer"] = timed(lambda steps=steps: [fn(*ins) for fn in steps.values()])
            r["ms"][name] = per
        for name in ("fp8_unfused", "fp8_fused"):
            r["speedup_vs_bf16"][name] = {s: round(r["ms"]["bf16"][s] / t, 3) for s, t in r["ms"][name].items()}
        for s in variants["bf16"]:
            r["rel_err"][s] = {"fused_vs_unfused": rel(outs["fp8_fused"][s], outs["fp8_unfused"][s]),
                               "unfused_vs_bf16": rel(outs["fp8_unfused"][s], outs["bf16"][s]),
                               "fused_vs_bf16": rel(outs["fp8_fused"][s], outs["bf16"][s])}
        del outs
        r["e4m3_bytes_differing"] = {
            "rms_norm_quant_vs_rms_norm+quantize_rows": differing_bytes(
                rms_norm_quant(x, norms[0].weight, EPS)[0], quantize_rows_cuda(norms[0](x))[0]),
            "silu_mul_quant_vs_silu_mul+quantize_rows": differing_bytes(
                silu_mul_quant(gate_up)[0], quantize_rows_cuda(silu_mul(gate_up))[0]),
        }
        del x, attn, h, gate_up, ins
        r["kernels_ms"] = kernel_layouts(dev, dtype, M)
        res["rows"][M] = r
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
