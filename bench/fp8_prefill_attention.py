"""FP8 causal prefill attention in Triton (kernels/flash_fp8.py, issue 19 item 4) against the bf16 paths.

    python bench/fp8_prefill_attention.py --out fp8_prefill_attention.json
    python bench/fp8_prefill_attention.py --lengths 4096 --sweep-length 4096 --device cpu --dtype float16  # smoke,
        # with TRITON_INTERPRET=1 (slow: the interpreter)

One GPU, Llama-3.1-8B attention heads by default (32 q, 8 KV, head dim 128), batch 1, causal, square
(the prefill of a whole prompt). Inputs as starshard/benchmarks/fp8_attention.py: random normal q / k /
v in bf16, q times --q-scales (4: a peaked softmax; 1: near-flat), one generator seeded by the length.
Timed (CUDA events, median of --repeats after 2 warm-ups), each on the same inputs:
- cudnn_bf16: our bf16 path, `kernels.attention.attention` (torch's cuDNN SDPA for this call; the
  baseline of fp8_attention.py);
- flash_bf16: our Triton bf16 kernel (kernels/flash.py, default config);
- fp8_a / fp8_b / fp8_s: flash_fp8 variant a (e4m3 Q / K, P and V in bf16), b (P and V in e4m3 too)
  and s (int8 Q and int8 K minus its mean, P and V in bf16: `--fp8 attention`), each
  as `total` (pre-pass + kernel, what a model would pay), `kernel` (K / V already quantized) and
  `prepass` (quantize_kv alone).
TFLOP/s count causal flops 2 * 2 * L^2 / 2 * D * H. Errors (fp8_attention.py's method): out relative
Frobenius error, max abs error and lse max abs error on --check-rows query rows spread over the
sequence (the last included) against a float32 reference on the same bf16 inputs.
Tile sweep: at --sweep-length, each FP8 variant over --configs (BLOCK_M, BLOCK_N, warps, stages, and
":tma" for tensor-descriptor loads), kernel time and error; the fastest sane config (error within 1.5x
of the best error) is used at every length, and at the longest length the sweep's three fastest are
timed again.
"""
import argparse
import math
import statistics

import torch
import triton

from starshard.benchmarks.common import commit, device_name, timed, today, write
from starshard.benchmarks.fp8_attention import _errors
from starshard.kernels.attention import attention, cuda_backend, mask_mode
from starshard.kernels.common import sm_count
from starshard.kernels.flash import flash_attention
from starshard.kernels.flash_fp8 import DEFAULT_CONFIG, flash_fp8_attention, quantize_kv
from starshard.kernels.reference import attention_math

CONFIGS = ("128,128,8,2 128,128,8,3 128,64,8,3 128,64,8,4 128,128,4,2 64,128,4,3 64,64,4,4 64,128,4,2 "
           "128,128,8,3:tma 128,64,8,3:tma 64,128,4,3:tma")


def parse_config(s: str):
    base, _, opt = s.partition(":")
    return tuple(int(x) for x in base.split(",")), opt == "tma"


def ints(s):
    return [int(x) for x in s.split(",")]


def floats(s):
    return [float(x) for x in s.split(",")]


def median_s(fn, dev, repeats):
    return statistics.median(timed(fn, dev, repeats, 2))


def make_inputs(L, args, dev, dtype, q_scale):
    gen = torch.Generator(device=dev).manual_seed(L)
    q = (torch.randn(1, args.heads, L, args.head_dim, device=dev, generator=gen) * q_scale).to(dtype)
    k, v = (torch.randn(1, args.kv_heads, L, args.head_dim, device=dev, generator=gen).to(dtype) for _ in range(2))
    if args.layout == "model":  # the projections' [B, L, H, D] memory seen as [B, H, L, D], as a model passes them
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    return q, k, v


def reference(q, k, v, L, rows, dev):
    sel = torch.linspace(0, L - 1, rows, device=dev).round().long().unique()
    pos = torch.arange(L, device=dev)
    ref_out, ref_lse = attention_math(q[:, :, sel].float(), k.float(), v.float(), q_pos=sel, k_pos=pos)
    return sel, ref_out, ref_lse


def errors(out, lse, ref):
    sel, ref_out, ref_lse = ref
    return _errors(out[:, :, sel], lse[:, :, sel], ref_out, ref_lse)


def sweep(args, dev, dtype):
    L = args.sweep_length
    q, k, v = make_inputs(L, args, dev, dtype, args.q_scales[0])
    ref = reference(q, k, v, L, 64, dev)
    flops = 4 * args.heads * args.head_dim * L * L / 2
    rows = []
    for variant in args.variants:
        kv = quantize_kv(k, v, variant)
        for spec in args.configs.split():
            cfg, tma = parse_config(spec)
            row = {"variant": variant, "config": spec, "length": L}
            try:
                out, lse = flash_fp8_attention(q, k, v, variant=variant, kv=kv, config=cfg, tma=tma)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                row.update(errors(out, lse, ref))
                del out, lse
                s = median_s(lambda: flash_fp8_attention(q, k, v, variant=variant, kv=kv, config=cfg, tma=tma), dev,
                             args.repeats)
                row.update(kernel_s=s, tflops=flops / s / 1e12)
            except Exception as e:  # a config that does not compile (shared memory, layouts): say so
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print("sweep", row, flush=True)
        del kv
    return rows


def best_configs(rows, variant):
    ok = [r for r in rows if r["variant"] == variant and "kernel_s" in r and math.isfinite(r["out_rel_err"])]
    if not ok:
        return []
    best_err = min(r["out_rel_err"] for r in ok)
    sane = [r for r in ok if r["out_rel_err"] <= 1.5 * best_err]
    return [r["config"] for r in sorted(sane, key=lambda r: r["kernel_s"])]


def run_length(L, args, dev, dtype, picks, confirm):
    flops = 4 * args.heads * args.head_dim * L * L / 2
    pos = torch.arange(L, device=dev)
    row = {"length": L, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "flops": flops}
    if dev.type == "cuda":
        row["bf16_backend"] = cuda_backend(torch.empty(1, args.heads, L, args.head_dim, device="meta", dtype=dtype), L,
                                           mask_mode(pos, pos, True), sm_count(dev))
    methods = {
        "cudnn_bf16": lambda q, k, v: attention(q, k, v, q_pos=pos, k_pos=pos),
        "flash_bf16": lambda q, k, v: flash_attention(q, k, v, q_pos=pos, k_pos=pos, causal=True),
    }
    for variant in args.variants:
        cfg, tma = parse_config(picks[variant])
        methods[f"fp8_{variant}"] = (lambda var, cfg, tma: lambda q, k, v: flash_fp8_attention(
            q, k, v, variant=var, config=cfg, tma=tma))(variant, cfg, tma)
    for qi, q_scale in enumerate(args.q_scales):
        q, k, v = make_inputs(L, args, dev, dtype, q_scale)
        ref = reference(q, k, v, L, args.check_rows, dev)
        tag = f"q_x{q_scale:g}"
        for name, fn in methods.items():
            out, lse = fn(q, k, v)
            row.setdefault(name, {})[f"errors_{tag}"] = errors(out, lse, ref)
            del out, lse
        if qi == 0:  # times do not depend on the values: once, on the first inputs
            for name, fn in methods.items():
                s = median_s(lambda: fn(q, k, v), dev, args.repeats)
                row[name].update(total_s=s, tflops=flops / s / 1e12)
            for variant in args.variants:
                cfg, tma = parse_config(picks[variant])
                kv = quantize_kv(k, v, variant)
                pre = median_s(lambda: quantize_kv(k, v, variant), dev, args.repeats)
                ker = median_s(lambda: flash_fp8_attention(q, k, v, variant=variant, kv=kv, config=cfg, tma=tma), dev,
                               args.repeats)
                m = row[f"fp8_{variant}"]
                m.update(config=picks[variant], prepass_s=pre, kernel_s=ker, kernel_tflops=flops / ker / 1e12)
                if confirm:
                    m["confirm"] = {}
                    for spec in confirm[variant]:
                        c2, t2 = parse_config(spec)
                        m["confirm"][spec] = median_s(
                            lambda: flash_fp8_attention(q, k, v, variant=variant, kv=kv, config=c2, tma=t2), dev,
                            args.repeats)
                del kv
            base = row["cudnn_bf16"]["total_s"]
            for name in methods:
                row[name]["speedup_vs_cudnn"] = base / row[name]["total_s"]
            for variant in args.variants:
                row[f"fp8_{variant}"]["kernel_speedup_vs_cudnn"] = base / row[f"fp8_{variant}"]["kernel_s"]
        del q, k, v, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("row", row, flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=ints, default=[32768, 65536, 131072])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--q-scales", type=floats, default=[4.0, 1.0], help="first one is timed; all get errors")
    p.add_argument("--check-rows", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep-length", type=int, default=32768, help="0: no sweep, use DEFAULT_CONFIG")
    p.add_argument("--configs", default=CONFIGS, help="space separated BLOCK_M,BLOCK_N,warps,stages[:tma]")
    p.add_argument("--variants", type=lambda s: s.split(","), default=["a", "b", "s"],
                   help="flash_fp8 variants to time, comma separated")
    p.add_argument("--layout", choices=["contiguous", "model"], default="contiguous",
                   help="q / k / v memory: contiguous [B, H, L, D], or the model's [B, L, H, D] viewed as [B, H, L, D]")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    sweep_rows = sweep(args, dev, dtype) if args.sweep_length else []
    picks, confirm = {}, {}
    for variant in args.variants:
        ranked = best_configs(sweep_rows, variant)
        default = ",".join(map(str, DEFAULT_CONFIG[variant]))
        picks[variant] = ranked[0] if ranked else default
        confirm[variant] = ranked[:3]
    rows = [run_length(L, args, dev, dtype, picks, confirm if L == max(args.lengths) and sweep_rows else None)
            for L in args.lengths]
    result = {"kind": "fp8-prefill-attention", "device": device_name(dev), "date": today(), "commit": commit(),
              "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "args": vars(args), "picked_configs": picks, "sweep": sweep_rows, "rows": rows}
    write(args.out, result)
    print("\n| L | method | total s | TFLOP/s | vs cuDNN | kernel s | pre-pass s | out err q x4 | lse err q x4 | out err q x1 |")
    for r in rows:
        for name in ("cudnn_bf16", "flash_bf16", *(f"fp8_{v}" for v in args.variants)):
            m = r[name]
            e = [m.get(f"errors_q_x{s:g}", {}) for s in args.q_scales]
            print(f"| {r['length']} | {name} | {m['total_s']:.4f} | {m['tflops']:.0f} | {m['speedup_vs_cudnn']:.2f}x | "
                  f"{m.get('kernel_s', float('nan')):.4f} | {m.get('prepass_s', float('nan')):.5f} | "
                  f"{e[0].get('out_rel_err', float('nan')):.4f} | {e[0].get('lse_max_abs_err', float('nan')):.3f} | "
                  f"{(e[1] if len(e) > 1 else {}).get('out_rel_err', float('nan')):.4f} |")


if __name__ == "__main__":
    main()
