"""Attention kernels on one GPU: correctness against float64, probes of torch's fused kernels, and
speed (TFLOP/s for prefill, µs and GB/s for decode). Prints and writes one JSON document.

    python launch/bench.py kernels --out bench/results/kernels_h200_<date>.json [--commit SHA] [--quick]

Sections: "correctness" (flash.py, decode.py, the dispatcher; bf16/fp16/fp32), "probes" (cuDNN and
flash SDPA: native GQA, causal alignment when Lq != Lk, lse layout, first-call cost of a new shape),
"prefill" (causal bf16 d128: Triton vs cuDNN SDPA vs flash SDPA; a Triton block-config sweep),
"masked" (zigzag ring shard), "decode" (split-KV vs flash SDPA), "query_block" (tens of rows vs a
long cache). --quick (for a short device lease): bf16/fp16 correctness on the distinct code
paths, GQA prefill at 8K/32K with native-GQA fused variants tried directly, four Triton configs,
decode at 128K/1M; no probes, masked or query-block sections.
"""
from __future__ import annotations

import json
import time
import traceback

import torch

from starshard.benchmarks.common import commit, save_json, today
from starshard.kernels.attention import DECODE_MAX_ROWS, attention, cuda_backend, mask_mode, sm_count
from starshard.kernels.decode import decode_attention
from starshard.kernels.flash import default_config, flash_attention

try:
    import triton
    from triton.testing import do_bench
except ImportError:  # installs without triton: `launch/bench.py kernels` refuses to run
    triton = do_bench = None

HELP = "attention kernels on one GPU: correctness, probes of torch's fused kernels, speed"

DEV = torch.device("cuda")
BOUND = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}
LSE_BOUND = 5e-3


def reference(q, k, v, q_pos, k_pos, causal, scale=None):
    """float64 attention written out: explicit K/V repeat, masked softmax; one head at a time."""
    B, Hq, Lq, D = q.shape
    g = Hq // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros(B, Hq, Lq, D, dtype=torch.float64, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float64, device=q.device)
    for b in range(B):
        qp = q_pos[b] if q_pos.dim() == 2 else q_pos
        kp = k_pos[b] if k_pos.dim() == 2 else k_pos
        for h in range(Hq):
            s = (q[b, h].double() @ k[b, h // g].double().T) * scale
            if causal:
                s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
            lse[b, h] = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[b, h, :, None])
            out[b, h] = torch.nan_to_num(p, nan=0.0) @ v[b, h // g].double()
    return out, lse


def compare(out, lse, ref_out, ref_lse, dtype) -> dict:
    fin = torch.isfinite(ref_lse)
    err = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    lse_err = (lse[fin].double() - ref_lse[fin]).abs().max().item() if bool(fin.any()) else 0.0
    empty_ok = bool(torch.isneginf(lse[~fin]).all()) and bool((out[~fin] == 0).all())
    finite = bool(torch.isfinite(out).all())
    ok = finite and empty_ok and err <= BOUND[dtype] and lse_err <= LSE_BOUND
    return {"rel_err": err, "lse_abs_err": lse_err, "empty_rows": int((~fin).sum()), "empty_ok": empty_ok, "ok": ok}


def positions(kind, Lq, Lk, B=1):
    k_pos = torch.arange(Lk, device=DEV)
    if kind in ("same", None):
        return torch.arange(Lq, device=DEV), k_pos
    if kind == "tail":
        return torch.arange(Lk - Lq, Lk, device=DEV), k_pos
    if kind == "middle":
        return torch.arange(Lq, device=DEV) + (Lk - Lq) // 2, k_pos
    if kind == "offset_empty":
        return torch.arange(Lq, device=DEV) - 50, k_pos
    if kind == "zigzag":  # ring shard of cp=2: chunks 0 and 3 of 4
        c = Lq // 2
        p = torch.cat([torch.arange(c), torch.arange(3 * c, 3 * c + Lq - c)]).to(DEV)
        return p, p
    if kind == "perm":
        return torch.randperm(Lq, device=DEV) + Lk // 4, torch.randperm(Lk, device=DEV)
    if kind == "batch":  # per-batch positions: batch 1 shifted by 40
        qp = torch.stack([torch.arange(Lq), torch.arange(Lq) + 40]).to(DEV)
        kp = torch.stack([torch.arange(Lk), torch.arange(Lk) + 40]).to(DEV)
        return qp, kp
    if kind == "decode_empty":
        return torch.tensor([-1, Lk // 2, Lk - 1][:Lq], device=DEV), k_pos
    raise ValueError(kind)


def rand(B, H, L, D, dtype, gen):
    return torch.randn(B, H, L, D, device=DEV, dtype=dtype, generator=gen)


def correctness(quick: bool) -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    flash_cases = [  # name, B, Hq, Hkv, Lq, Lk, D, positions, causal
        ("causal-square-gqa", 1, 8, 2, 1037, 1037, 128, "same", True),
        ("query-tail", 1, 8, 2, 300, 2000, 128, "tail", True),
        ("query-middle", 1, 6, 2, 257, 1500, 64, "middle", True),
        ("zigzag", 1, 8, 8, 512, 512, 128, "zigzag", True),
        ("empty-rows", 1, 8, 4, 200, 300, 128, "offset_empty", True),
        ("noncausal-gqa9x3", 1, 9, 3, 300, 517, 128, None, False),
        ("d256-tail", 1, 4, 2, 333, 700, 256, "tail", True),
        ("d80-same", 1, 4, 1, 200, 300, 80, "same", True),
        ("d64-batch-positions", 2, 4, 2, 150, 150, 64, "batch", True),
        ("random-positions", 1, 4, 2, 128, 256, 128, "perm", True),
    ]
    if quick:  # bf16 on the cases that differ in code path, one fp16 case
        flash_cases = [c for c in flash_cases if c[0] in ("causal-square-gqa", "query-tail", "empty-rows", "noncausal-gqa9x3",
                                                           "d64-batch-positions", "random-positions", "d80-same")]
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32):
        for name, B, hq, hkv, lq, lk, d, kind, causal in flash_cases:
            q, k, v = rand(B, hq, lq, d, dtype, gen), rand(B, hkv, lk, d, dtype, gen), rand(B, hkv, lk, d, dtype, gen)
            qp, kp = positions(kind, lq, lk, B)
            ref = reference(q, k, v, qp, kp, causal)
            for tma in (False, True) if dtype == torch.bfloat16 else (False,):
                try:
                    out, lse = flash_attention(q, k, v, q_pos=qp, k_pos=kp, causal=causal, tma=tma)
                    rows.append({"kernel": "flash", "case": name, "dtype": str(dtype), "tma": tma, **compare(out, lse, *ref, dtype)})
                except Exception as e:  # noqa: BLE001 - record and go on
                    rows.append({"kernel": "flash", "case": name, "dtype": str(dtype), "tma": tma, "ok": False, "error": repr(e)[:400]})
    decode_cases = [
        ("last-row-gqa4", 1, 32, 8, 1, 5000, 128, "tail", True),
        ("rows4-b2", 2, 32, 8, 4, 70001, 128, "tail", True),
        ("rows16-gqa7", 1, 28, 4, 16, 3001, 128, "tail", True),
        ("empty-row-d64", 1, 8, 8, 3, 1000, 64, "decode_empty", True),
        ("noncausal-d256", 1, 16, 2, 2, 999, 256, None, False),
    ]
    for dtype in (torch.bfloat16, torch.float16) if quick else (torch.bfloat16, torch.float16, torch.float32):
        for name, B, hq, hkv, lq, lk, d, kind, causal in decode_cases[:3] if quick else decode_cases:
            q, k, v = rand(B, hq, lq, d, dtype, gen), rand(B, hkv, lk, d, dtype, gen), rand(B, hkv, lk, d, dtype, gen)
            qp, kp = positions(kind, lq, lk, B)
            ref = reference(q, k, v, qp, kp, causal)
            try:
                out, lse = decode_attention(q, k, v, q_pos=qp, k_pos=kp, causal=causal)
                rows.append({"kernel": "decode", "case": name, "dtype": str(dtype), **compare(out, lse, *ref, dtype)})
            except Exception as e:  # noqa: BLE001
                rows.append({"kernel": "decode", "case": name, "dtype": str(dtype), "ok": False, "error": repr(e)[:400]})
    dispatch_cases = [
        ("causal-square-gqa", 1, 32, 8, 1037, 1037, 128, "same", True),
        ("causal-square-mha", 1, 8, 8, 700, 700, 128, "same", True),
        ("full-noncausal-gqa", 1, 8, 2, 300, 517, 128, None, False),
        ("query-after-keys", 1, 8, 2, 64, 2048, 128, "after", True),
        ("decode-row", 1, 32, 8, 1, 4099, 128, "tail", True),
        ("query-tail", 1, 32, 8, 64, 2048, 128, "tail", True),
        ("zigzag", 1, 8, 2, 256, 256, 128, "zigzag", True),
        ("empty-rows", 1, 8, 4, 200, 300, 128, "offset_empty", True),
        ("d256-square", 1, 4, 2, 300, 300, 256, "same", True),
    ]
    for dtype in (torch.bfloat16, torch.float16) if quick else (torch.bfloat16, torch.float16, torch.float32):
        for name, B, hq, hkv, lq, lk, d, kind, causal in dispatch_cases:
            q, k, v = rand(B, hq, lq, d, dtype, gen), rand(B, hkv, lk, d, dtype, gen), rand(B, hkv, lk, d, dtype, gen)
            if kind == "after":
                qp, kp = torch.arange(lk, lk + lq, device=DEV), torch.arange(lk, device=DEV)
            else:
                qp, kp = positions(kind, lq, lk, B)
            mode = None if lq <= DECODE_MAX_ROWS else mask_mode(qp, kp, causal)
            ref = reference(q, k, v, qp, kp, causal)
            try:
                out, lse = attention(q, k, v, q_pos=qp, k_pos=kp, causal=causal)
                rows.append({"kernel": "dispatch", "case": name, "dtype": str(dtype), "mode": mode,
                             "backend": cuda_backend(q, lk, mode, sm_count(DEV)), **compare(out, lse, *ref, dtype)})
            except Exception as e:  # noqa: BLE001
                rows.append({"kernel": "dispatch", "case": name, "dtype": str(dtype), "ok": False, "error": repr(e)[:400]})
    return rows


def _cudnn_op(q, k, v, causal):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    return r[0], r[1]


def _flash_op(q, k, v, causal):
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    return r[0], r[1]


def probes() -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows = []
    dt = torch.bfloat16
    for op_name, op in (("cudnn", _cudnn_op), ("flash", _flash_op)):
        # Native GQA and lse layout, plain causal.
        q, k, v = rand(1, 32, 1000, 128, dt, gen), rand(1, 8, 1000, 128, dt, gen), rand(1, 8, 1000, 128, dt, gen)
        p = torch.arange(1000, device=DEV)
        ref = reference(q, k, v, p, p, True)
        try:
            out, lse = op(q, k, v, True)
            row = {"probe": f"{op_name}-native-gqa-causal", "lse_shape": list(lse.shape), "lse_stride": list(lse.stride()),
                   **compare(out, lse.reshape(1, 32, -1)[:, :, :1000].float(), *ref, dt)}
        except Exception as e:  # noqa: BLE001
            row = {"probe": f"{op_name}-native-gqa-causal", "ok": False, "error": repr(e)[:400]}
        rows.append(row)
        # Causal alignment when Lq != Lk: top-left (row i sees keys <= i) or bottom-right.
        q, k, v = rand(1, 8, 256, 128, dt, gen), rand(1, 8, 1024, 128, dt, gen), rand(1, 8, 1024, 128, dt, gen)
        kp = torch.arange(1024, device=DEV)
        try:
            out, lse = op(q, k, v, True)
            lse = lse.reshape(1, 8, -1)[:, :, :256].float()
            for align, qp in (("top-left", torch.arange(256, device=DEV)), ("bottom-right", torch.arange(768, 1024, device=DEV))):
                rows.append({"probe": f"{op_name}-causal-{align}-lq256-lk1024", **compare(out, lse, *reference(q, k, v, qp, kp, True), dt)})
        except Exception as e:  # noqa: BLE001
            rows.append({"probe": f"{op_name}-causal-alignment", "ok": False, "error": repr(e)[:400]})
    # First call at a shape never seen (cuDNN builds a plan per shape; Triton compiles per config).
    for name, fn in (
        ("cudnn", lambda q, k, v, p: _cudnn_op(q, k, v, True)),
        ("flash", lambda q, k, v, p: _flash_op(q, k, v, True)),
        ("triton", lambda q, k, v, p: flash_attention(q, k, v, q_pos=p, k_pos=p, causal=True)),
    ):
        for L in (8192 + 64, 8192 + 192, 8192 + 320):
            q, k, v = rand(1, 32, L, 128, dt, gen), rand(1, 32, L, 128, dt, gen), rand(1, 32, L, 128, dt, gen)
            p = torch.arange(L, device=DEV)
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(q, k, v, p)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                steady = do_bench(lambda: fn(q, k, v, p), warmup=10, rep=50, return_mode="median") / 1e3
                rows.append({"probe": f"{name}-first-call-new-shape", "L": L, "first_s": first, "steady_s": steady})
            except Exception as e:  # noqa: BLE001
                rows.append({"probe": f"{name}-first-call-new-shape", "L": L, "error": repr(e)[:300]})
    return rows


def tflops(B, H, Lq, Lk, D, seconds, causal=True):
    flops = 4 * B * H * Lq * Lk * D * (0.5 if causal else 1.0)
    return flops / seconds / 1e12


def time_ms(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def prefill(quick: bool, native_gqa: dict) -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(2)
    rows = []
    dt = torch.bfloat16
    for hq, hkv in ((32, 8),) if quick else ((32, 8), (32, 32)):
        for L in (8192, 32768):
            q, k, v = rand(1, hq, L, 128, dt, gen), rand(1, hkv, L, 128, dt, gen), rand(1, hkv, L, 128, dt, gen)
            p = torch.arange(L, device=DEV)
            g = hq // hkv
            ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            variants = {
                "triton": lambda: flash_attention(q, k, v, q_pos=p, k_pos=p, causal=True),
                "triton-tma": lambda: flash_attention(q, k, v, q_pos=p, k_pos=p, causal=True, tma=True),
                "cudnn-sdpa(pre-expanded kv)": lambda: _cudnn_op(q, ke, ve, True),
                "flash-sdpa(pre-expanded kv)": lambda: _flash_op(q, ke, ve, True),
                "dispatcher": lambda: attention(q, k, v, q_pos=p, k_pos=p, causal=True),
            }
            if g > 1:
                variants["cudnn-sdpa+expand"] = lambda: _cudnn_op(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), True)
                if native_gqa.get("cudnn", quick):
                    variants["cudnn-sdpa(native gqa)"] = lambda: _cudnn_op(q, k, v, True)
                if native_gqa.get("flash", quick):
                    variants["flash-sdpa(native gqa)"] = lambda: _flash_op(q, k, v, True)
            for name, fn in variants.items():
                try:
                    ms = time_ms(fn)
                    rows.append({"Hq": hq, "Hkv": hkv, "L": L, "variant": name, "ms": ms, "tflops": tflops(1, hq, L, L, 128, ms / 1e3)})
                except Exception as e:  # noqa: BLE001
                    rows.append({"Hq": hq, "Hkv": hkv, "L": L, "variant": name, "error": repr(e)[:400]})
                print(json.dumps(rows[-1]), flush=True)
            del q, k, v, ke, ve
    return rows


def sweep(quick: bool) -> list[dict]:
    """Triton block configs, causal bf16 d128, Hq=32/Hkv=8 at 8K (each checked against cuDNN's
    output); the two fastest then at 32K and without GQA."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    rows = []
    dt = torch.bfloat16

    def run(hq, hkv, L, cfgs, check):
        q, k, v = rand(1, hq, L, 128, dt, gen), rand(1, hkv, L, 128, dt, gen), rand(1, hkv, L, 128, dt, gen)
        p = torch.arange(L, device=DEV)
        ref = _cudnn_op(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1), True)[0].float() if check else None
        for cfg, tma in cfgs:
            row = {"Hq": hq, "Hkv": hkv, "L": L, "config": list(cfg), "tma": tma}
            try:
                fn = lambda: flash_attention(q, k, v, q_pos=p, k_pos=p, causal=True, config=cfg, tma=tma)  # noqa: E731
                if check:
                    row["rel_err_vs_cudnn"] = ((fn()[0].float() - ref).norm() / ref.norm()).item()
                ms = time_ms(fn)
                row.update({"ms": ms, "tflops": tflops(1, hq, L, L, 128, ms / 1e3)})
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)

    if quick:
        run(32, 8, 8192, [((128, 128, 8, 3), False), ((128, 128, 8, 3), True), ((128, 64, 4, 3), True), ((128, 128, 8, 2), True)], check=True)
        best = sorted((r for r in rows if "tflops" in r), key=lambda r: -r["tflops"])[:1]
        run(32, 8, 32768, [(tuple(r["config"]), r["tma"]) for r in best], check=False)
        return rows
    configs = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 4, 4)]
    run(32, 8, 8192, [(c, t) for c in configs for t in (True, False)], check=True)
    best = sorted((r for r in rows if "tflops" in r), key=lambda r: -r["tflops"])[:2]
    top = [(tuple(r["config"]), r["tma"]) for r in best]
    run(32, 8, 32768, top, check=False)
    run(32, 32, 8192, top, check=False)
    run(32, 32, 32768, top, check=False)
    return rows


def masked() -> list[dict]:
    """A ring shard (zigzag chunks 0 and 3 of 4) attending to itself: a position mask, 16K rows."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    rows = []
    L = 16384
    q, k, v = rand(1, 32, L, 128, torch.bfloat16, gen), rand(1, 8, L, 128, torch.bfloat16, gen), rand(1, 8, L, 128, torch.bfloat16, gen)
    p, _ = positions("zigzag", L, L)
    # Visible pairs: each chunk causal on itself, the late chunk sees all of the early one.
    c = L // 2
    pairs = c * (c + 1) + c * c
    flops = 4 * 32 * pairs * 128
    variants = {"triton": lambda: flash_attention(q, k, v, q_pos=p, k_pos=p, causal=True),
                "dispatcher": lambda: attention(q, k, v, q_pos=p, k_pos=p, causal=True)}
    for name, fn in variants.items():
        try:
            ms = time_ms(fn)
            rows.append({"L": L, "variant": name, "ms": ms, "tflops": flops / (ms / 1e3) / 1e12})
        except Exception as e:  # noqa: BLE001
            rows.append({"L": L, "variant": name, "error": repr(e)[:300]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def decode(quick: bool) -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(5)
    rows = []
    hq, hkv, d = 32, 8, 128
    for Lk in (131072, 1 << 20) if quick else (8192, 131072, 1 << 20):
        k, v = rand(1, hkv, Lk, d, torch.bfloat16, gen), rand(1, hkv, Lk, d, torch.bfloat16, gen)
        kp = torch.arange(Lk, device=DEV)
        kv_bytes = 2 * k.numel() * k.element_size()
        for lq in (1, 16):
            q = rand(1, hq, lq, d, torch.bfloat16, gen)
            qp = torch.arange(Lk - lq, Lk, device=DEV)
            variants = {"decode": lambda: decode_attention(q, k, v, q_pos=qp, k_pos=kp, causal=True),
                        "dispatcher": lambda: attention(q, k, v, q_pos=qp, k_pos=kp, causal=True)}
            if lq == 1:  # one row sees every key: flash SDPA with the GQA heads folded into rows
                variants["flash-sdpa(folded, no mask)"] = lambda: _flash_op(q.reshape(1, hkv, hq // hkv, d), k, v, False)
            if not quick and Lk == 131072:
                for ns in (16, 32, 64, 128):
                    variants[f"decode-splits{ns}"] = lambda ns=ns: decode_attention(q, k, v, q_pos=qp, k_pos=kp, num_splits=ns)
                for cfg in ((128, 4, 3), (64, 4, 4), (32, 4, 4)):
                    variants[f"decode-cfg{cfg}"] = lambda cfg=cfg: decode_attention(q, k, v, q_pos=qp, k_pos=kp, config=cfg)
            for name, fn in variants.items():
                try:
                    ms = time_ms(fn)
                    rows.append({"Lq": lq, "Lk": Lk, "variant": name, "us": ms * 1e3, "kv_GBps": kv_bytes / (ms / 1e3) / 1e9})
                except Exception as e:  # noqa: BLE001
                    rows.append({"Lq": lq, "Lk": Lk, "variant": name, "error": repr(e)[:300]})
                print(json.dumps(rows[-1]), flush=True)
        del k, v
    return rows


def query_block() -> list[dict]:
    """Tens to hundreds of query rows at the end of a 32K cache: flash grid vs split-KV."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    rows = []
    Lk = 32768
    k, v = rand(1, 8, Lk, 128, torch.bfloat16, gen), rand(1, 8, Lk, 128, torch.bfloat16, gen)
    kp = torch.arange(Lk, device=DEV)
    for lq in (32, 64, 256):
        q = rand(1, 32, lq, 128, torch.bfloat16, gen)
        qp = torch.arange(Lk - lq, Lk, device=DEV)
        for name, fn in (("triton", lambda: flash_attention(q, k, v, q_pos=qp, k_pos=kp)),
                         ("decode", lambda: decode_attention(q, k, v, q_pos=qp, k_pos=kp)),
                         ("dispatcher", lambda: attention(q, k, v, q_pos=qp, k_pos=kp))):
            try:
                ms = time_ms(fn)
                rows.append({"Lq": lq, "Lk": Lk, "variant": name, "us": ms * 1e3})
            except Exception as e:  # noqa: BLE001
                rows.append({"Lq": lq, "Lk": Lk, "variant": name, "error": repr(e)[:300]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="JSON path (rewritten after every section)")
    p.add_argument("--commit", default=None, help="git commit of the tree (default: git rev-parse HEAD)")
    p.add_argument("--quick", action="store_true", help="the short set (see above): for a short device lease")


def run(args) -> None:
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("error: the kernels benchmark needs a CUDA GPU and the triton package")
    doc = {
        "kind": "kernels",
        "device": torch.cuda.get_device_name(),
        "date": today(),
        "commit": args.commit or commit(short=False),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version()},
        "config": {"dtype": "bfloat16", "head_dim": 128, "batch": 1, "timing": "triton.testing.do_bench median, warmup 25 ms, rep 200 ms",
                   "prefill_flops": "causal 2*2*B*H*L*L*D/2", "flash_default_config(d128)": list(default_config(128)),
                   "decode_max_rows": DECODE_MAX_ROWS},
    }

    def save():
        save_json(args.out, doc)

    def section(name, fn):
        t0 = time.perf_counter()
        try:
            doc[name] = fn()
        except Exception:  # noqa: BLE001 - keep what the other sections measured
            doc[name] = {"error": traceback.format_exc()[-2000:]}
        doc.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        save()
        print(f"== {name} done in {doc['section_seconds'][name]} s", flush=True)

    section("correctness", lambda: correctness(args.quick))
    bad = [r for r in doc["correctness"] if not r.get("ok")] if isinstance(doc["correctness"], list) else ["error"]
    print(json.dumps({"correctness_failures": bad}, indent=None), flush=True)
    native = {}
    if not args.quick:
        section("probes", probes)
        for r in doc["probes"] if isinstance(doc["probes"], list) else []:
            if r["probe"].endswith("native-gqa-causal"):
                native[r["probe"].split("-")[0]] = bool(r.get("ok"))
    section("prefill", lambda: prefill(args.quick, native))
    section("sweep", lambda: sweep(args.quick))
    section("decode", lambda: decode(args.quick))
    if not args.quick:
        section("masked", masked)
        section("query_block", query_block)
    summary = [(r["Hq"], r["Hkv"], r["L"], r["variant"], round(r.get("tflops", 0), 1)) for r in doc["prefill"]] if isinstance(doc["prefill"], list) else doc["prefill"]
    print(json.dumps({"prefill_tflops": summary}, indent=None))


