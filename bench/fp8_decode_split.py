"""The e4m3-cache split-KV decode attention (issue 19, decode at 128K): kernels/decode.py's kernels and
tile choices against the kernel of before (commit db1bcd2: K^T and V e4m3 -> fp16 in registers, fp16
products with 16 query rows as the small operand, merge in two dependent rounds), at the Llama-3.1-8B
shape: 32 query / 8 KV heads, d 128, one query row, batch 1, as the CUDA-graph decode step calls it
(causal=False, the valid key count read on the device).

Variants:
- `before`: the split kernel (unchanged, the default) with a copy of the old merge kernel;
- `default`: decode_attention as it runs by default: the same split kernel, the one-pass merge;
- `even ...`: `_decode_split_fp8_kernel` (options "even": whole key blocks without masks, the key
  scale folded into the score scale, one masked block at most per split); `tma`: its loads through
  tensor descriptors;
  `splitsN`: N splits per KV head;
- `L2 ...`: every KV head reads one head's 64K keys (17 MB, in L2): the kernels' own rate, as on a
  GPU with faster memory (the H200, where the kernel of before runs at ~3.0 TB/s);
- `stream`: a kernel that only reads the same bytes with the same grid and tiles (a ceiling);
- `merge ...`: the merge kernels alone.

Times: each call reads a different cache copy (each far over L2) in a CUDA graph of `calls` calls;
median over replays, microseconds per call (one layer). TB/s counts the K, V and scale bytes read.
Errors: ||out - ref|| / ||ref|| against float64 attention over the dequantized cache.

    python bench/fp8_decode_split.py --out fp8_decode_split.json [--keys 131072 32768] [--quick] [--check]
"""
import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from starshard.benchmarks.common import commit, graph_replay_us
from starshard.kernels import decode as dk
from starshard.kernels.decode import decode_attention
from starshard.kernels.fp8 import quantize_rows

HQ, HKV, D = 32, 8, 128


@triton.jit
def _merge_before(OP, LP, O, LSE, s_ob, s_oh, s_om, s_od, Hq, Lq, n_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """The merge kernel of db1bcd2 (max over all splits first, then the weighted sum: two rounds)."""
    row = tl.program_id(0)
    qi = row % Lq
    bh = row // Lq
    b = bh // Hq
    hq = bh % Hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = row.to(tl.int64) * n_splits
    m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        m = tl.maximum(m, tl.load(LP + base + s0 + offs_s, mask=s0 + offs_s < n_splits, other=float("-inf")))
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    den = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        s_ok = s0 + offs_s < n_splits
        w = tl.math.exp2(tl.load(LP + base + s0 + offs_s, mask=s_ok, other=float("-inf")) - m_use)
        o = tl.load(OP + (base + s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        den += w
        acc += tl.sum(w[:, None] * o, 0)
    total = tl.sum(den, 0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), m_use + tl.math.log2(tl.where(total == 0.0, 1.0, total))) * 0.6931471805599453
    tl.store(O + b.to(tl.int64) * s_ob + hq.to(tl.int64) * s_oh + qi * s_om + offs_d * s_od, out.to(O.dtype.element_ty),
             mask=d_ok)
    tl.store(LSE + row, lse)


@triton.jit
def _stream(K, V, KS, VS, OUT, LK_PTR, s_kh, s_sh, chunk, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Reads what the split kernel reads (K, V tiles and their scales), with the same grid; sums bytes."""
    split = tl.program_id(0)
    kvh = tl.program_id(2)
    Lk = tl.load(LK_PTR)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kb = K + kvh.to(tl.int64) * s_kh + offs_n[:, None] * D + offs_d[None, :]
    vb = V + kvh.to(tl.int64) * s_kh + offs_n[:, None] * D + offs_d[None, :]
    acc = tl.zeros([BLOCK_N, D], dtype=tl.int8)
    sacc = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, Lk)
    for start in range(lo, hi, BLOCK_N):
        k = tl.load(kb + start * D).to(tl.int8, bitcast=True)
        v = tl.load(vb + start * D).to(tl.int8, bitcast=True)
        acc = tl.maximum(acc, k ^ v)
        sacc += tl.load(KS + kvh * s_sh + start + offs_n) + tl.load(VS + kvh * s_sh + start + offs_n)
    tl.store(OUT + (kvh * tl.num_programs(0) + split), tl.max(tl.max(acc, 1), 0).to(tl.float32) + tl.sum(sacc, 0))


def split_count(factor):
    return max(1, round(factor * torch.cuda.get_device_properties(0).multi_processor_count / HKV))


def launch_before(q, c, length, splits=None):
    """The split + merge as db1bcd2 ran them: old split kernel (128 keys, 4 warps, 3 stages), old merge."""
    k8, ks, v8, vs = c
    B, Hq, Lq, _ = q.shape
    Lk = k8.shape[2]
    G = Hq // HKV
    n = splits or dk._num_splits(q.device, B * HKV, Lk, True)
    chunk = -(-(-(-Lk // n)) // 128) * 128
    n = -(-Lk // chunk)
    op = torch.empty(B, Hq, Lq, n, D, dtype=torch.float32, device=q.device)
    lp = torch.empty(B, Hq, Lq, n, dtype=torch.float32, device=q.device)
    pos = torch.zeros(1, dtype=torch.long, device=q.device)
    dk._decode_split_kernel[(n, 1, B * HKV)](
        q, k8, v8, op, lp, pos, pos, length, ks, vs, D**-0.5 * dk.LOG2E,
        *q.stride(), *k8.stride(), *v8.stride(), 0, 0, ks.stride(0), ks.stride(1), HKV, G, Lq, Lk, chunk, n,
        HEAD_DIM=D, BLOCK_D=D, BLOCK_M=16, BLOCK_N=128, CAUSAL=False, IEEE=False, HAS_LK=True, FP8=True,
        num_warps=4, num_stages=3)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    _merge_before[(B * Hq * Lq,)](op, lp, out, lse, *out.stride(), Hq, Lq, n, HEAD_DIM=D, BLOCK_D=D,
                                  BLOCK_S=min(16, triton.next_power_of_2(n)), num_warps=4)
    return out


def time_us(fn, copies, calls=16, replays=15):
    """(median, fastest) microseconds per call; call i reads copy i % copies."""
    ts = graph_replay_us(fn, calls, replays, warmup=copies + 1, copies=copies)
    return statistics.median(ts), min(ts)


def kernel_info(fn):
    """Registers, spills and whether wgmma is in the PTX of the kernel `fn` compiled last."""
    try:
        cache = fn.device_caches[torch.cuda.current_device()][0]
        k = list(cache.values())[-1]
        ptx = k.asm.get("ptx", "")
        return {"regs": k.n_regs, "spills": k.n_spills, "wgmma": "wgmma.mma_async" in ptx,
                "mma_sync": "mma.sync" in ptx, "shared": k.metadata.shared}
    except Exception as e:  # introspection is best effort
        return {"info_error": str(e)[:200]}


def launch_shared(q, c1, kind, cfg, n, length):
    """Every KV head reads the keys of one (head strides 0): the 64K-key cache (17 MB) stays in L2, so
    the time shows the kernel's own rate, as a faster memory (an H200's) would let it run."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    k1, ks1, v1, vs1 = c1
    _, Hq, Lq, _ = q.shape
    Lk = k1.shape[2]
    bn, w, st = cfg
    chunk = -(-(-(-Lk // n)) // bn) * bn
    n = -(-Lk // chunk)
    op = torch.empty(1, Hq, Lq, n, D, dtype=torch.float32, device=q.device)
    lp = torch.empty(1, Hq, Lq, n, dtype=torch.float32, device=q.device)
    kstr = (0, 0, D, 1)
    if kind == "stream":
        _stream[(n, 1, HKV)](k1, v1, ks1, vs1, lp, length, 0, 0, chunk, BLOCK_N=bn, D=D, num_warps=w, num_stages=st)
        return None
    if kind == "before":
        dk._decode_split_kernel[(n, 1, HKV)](
            q, k1, v1, op, lp, length, length, length, ks1, vs1, D**-0.5 * dk.LOG2E, *q.stride(), *kstr, *kstr,
            0, 0, 0, 0, HKV, Hq // HKV, Lq, Lk, chunk, n, HEAD_DIM=D, BLOCK_D=D, BLOCK_M=16, BLOCK_N=bn,
            CAUSAL=False, IEEE=False, HAS_LK=True, FP8=True, num_warps=w, num_stages=st)
    else:
        tma = kind == "tma"
        if tma:
            args = (TensorDescriptor(k1, [Lk, D], [D, 1], [bn, D]), TensorDescriptor(v1, [Lk, D], [D, 1], [bn, D]),
                    TensorDescriptor(ks1, [Lk], [1], [bn]), TensorDescriptor(vs1, [Lk], [1], [bn]))
        else:
            args = (k1, v1, ks1, vs1)
        dk._decode_split_fp8_kernel[(n, 1, HKV)](
            q, args[0], args[1], op, lp, length, args[2], args[3], D**-0.5 * dk.LOG2E, *q.stride(), *kstr, *kstr,
            0, 0, HKV, Hq // HKV, Lq, Lk, 0, chunk, n, HEAD_DIM=D, BLOCK_D=D, BLOCK_M=16, BLOCK_N=bn,
            HAS_LK=True, TMA=tma, num_warps=w, num_stages=st)
    out = torch.empty_like(q)
    lse = torch.empty(1, Hq, Lq, dtype=torch.float32, device=q.device)
    dk._decode_merge_kernel[(Hq * Lq,)](op, lp, out, lse, *out.stride(), Hq, Lq, n, HEAD_DIM=D, BLOCK_D=D,
                                        BLOCK_S=min(64, triton.next_power_of_2(n)), num_warps=4)
    return out


def l2_proxy(q, length, args, Lk=65536):
    dev = q.device
    gen = torch.Generator(device=dev).manual_seed(3)
    k8, ks = quantize_rows(torch.randn(1, 1, Lk, D, device=dev, generator=gen))
    v8, vs = quantize_rows(torch.randn(1, 1, Lk, D, device=dev, generator=gen))
    c1 = (k8, ks.view(1, 1, Lk), v8, vs.view(1, 1, Lk))
    length = torch.tensor([Lk], dtype=torch.int32, device=dev)
    nbytes = 2 * HKV * Lk * (D + 4)
    n2 = split_count(2)
    rows = []
    for kind, cfg, n in [("stream", (128, 4, 3), n2), ("before", (128, 4, 3), n2), ("even", (128, 4, 3), n2),
                         ("tma", (128, 4, 3), n2), ("even", (128, 4, 4), n2)]:
        name = f"L2 {kind} bn{cfg[0]} w{cfg[1]} s{cfg[2]} splits{n}"
        row = {"keys": Lk, "variant": name}
        try:
            fn = lambda i, kind=kind, cfg=cfg, n=n: launch_shared(q, c1, kind, cfg, n, length)
            fn(0)
            med, best = time_us(fn, 1)
            row.update(us=med, us_min=best, tb_per_s=nbytes / med / 1e6)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def run_keys(Lk, args, res):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    copies = 2 if Lk >= 65536 else 4  # each copy >= 67 MB, over L2
    caches = []
    for _ in range(copies):
        k = torch.randn(1, HKV, Lk, D, device=dev, generator=gen)
        v = torch.randn(1, HKV, Lk, D, device=dev, generator=gen)
        k8, ks = quantize_rows(k)
        v8, vs = quantize_rows(v)
        caches.append((k8, ks.view(1, HKV, Lk), v8, vs.view(1, HKV, Lk)))
        del k, v
    k8, ks, v8, vs = caches[0]
    kd = k8.double() * ks.double()[..., None]
    vd = v8.double() * vs.double()[..., None]
    # A peaked softmax as real heads have: q along one key's direction (scores up to ~20).
    q = (torch.randn(1, HQ, 1, D, device=dev, generator=gen, dtype=torch.float64)
         + 2.0 * kd[:, :, 777:778].repeat_interleave(HQ // HKV, 1)).to(torch.bfloat16)
    s = (q.double() @ kd.repeat_interleave(HQ // HKV, 1).transpose(-1, -2)) * D**-0.5
    ref = torch.softmax(s, -1) @ vd.repeat_interleave(HQ // HKV, 1)
    del kd, vd, s
    length = torch.tensor([Lk], dtype=torch.int32, device=dev)
    pos = torch.arange(Lk, device=dev)
    qp = torch.tensor([Lk - 1], device=dev)
    nbytes = 2 * HKV * Lk * (D + 4)

    def prod(options=None, config=None, splits=None):
        return lambda i: decode_attention(q, caches[i][0], caches[i][2], q_pos=qp, k_pos=pos, causal=False,
                                          length=length, k_scale=caches[i][1], v_scale=caches[i][3],
                                          num_splits=splits, config=config, options=options)[0]

    E = dk._decode_split_fp8_kernel
    variants = [("before", lambda i: launch_before(q, caches[i], length), None),
                ("default", prod(), dk._decode_split_kernel)]
    variants.append(("even bn128 w4 s3", prod({"even": True}, (128, 4, 3)), E))
    variants.append(("even tma bn128 w4 s3", prod({"even": True, "tma": True}, (128, 4, 3)), E))
    if not args.quick:
        for bn, w, st in [(128, 4, 4), (64, 4, 3)]:
            variants.append((f"even bn{bn} w{w} s{st}", prod({"even": True}, (bn, w, st)), E))
        variants.append(("before (again)", lambda i: launch_before(q, caches[i], length), None))
        variants.append(("default (again)", prod(), dk._decode_split_kernel))
    # stream ceiling, same grid as the default split count
    n = dk._num_splits(dev, HKV, Lk, True)
    for bn, w, st in [(128, 4, 3)]:
        chunk = -(-(-(-Lk // n)) // bn) * bn
        ns = -(-Lk // chunk)
        sink = torch.empty(HKV * ns, device=dev)

        def stream(i, bn=bn, w=w, st=st, chunk=chunk, ns=ns, sink=sink):
            c = caches[i]
            _stream[(ns, 1, HKV)](c[0], c[2], c[1], c[3], sink, length, c[0].stride(1), c[1].stride(1), chunk,
                                  BLOCK_N=bn, D=D, num_warps=w, num_stages=st)
            return None
        variants.append((f"stream bn{bn} w{w} s{st}", stream, _stream))

    rows = []
    for name, fn, kern in variants:
        row = {"keys": Lk, "variant": name}
        try:
            t0 = time.time()
            o = fn(0)
            torch.cuda.synchronize()
            row["compile_s"] = round(time.time() - t0, 2)
            if kern is not None:
                row.update(kernel_info(kern))
            if o is not None:
                row["rel_err"] = rel(o, ref)
            med, best = time_us(fn, copies)
            row.update(us=med, us_min=best, tb_per_s=nbytes / med / 1e6)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.quick:
        rows += l2_proxy(q, length, args)
    # the merge kernels alone, on partials of the default split count
    n = dk._num_splits(dev, HKV, Lk, True)
    op = torch.randn(1, HQ, 1, n, D, device=dev)
    lp = torch.randn(1, HQ, 1, n, device=dev)
    out = torch.empty(1, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(1, HQ, 1, device=dev)
    for name, f in [("merge before", lambda i: _merge_before[(HQ,)](op, lp, out, lse, *out.stride(), HQ, 1, n, HEAD_DIM=D,
                                                                      BLOCK_D=D, BLOCK_S=16, num_warps=4)),
                    ("merge1", lambda i: dk._decode_merge_kernel[(HQ,)](op, lp, out, lse, *out.stride(), HQ, 1, n,
                                                                        HEAD_DIM=D, BLOCK_D=D,
                                                                        BLOCK_S=min(64, triton.next_power_of_2(n)),
                                                                        num_warps=4))]:
        med, best = time_us(f, 1)
        rows.append({"keys": Lk, "variant": f"{name} splits{n}", "us": med, "us_min": best})
        print(json.dumps(rows[-1]), flush=True)
    res["rows"].extend(rows)
    del caches


def cuda_checks(res):
    """decode_attention's e4m3 kernels on CUDA against float64 over the dequantized cache: GQA groups,
    several query rows and row blocks, causal, a device-side key count with garbage after it, d 64."""
    from starshard.kernels.reference import attention_math
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    cases = [(8, 2, 1, 5000, 128, False, None), (32, 8, 1, 70000, 128, False, 65537), (8, 2, 3, 3000, 128, True, None),
             (16, 1, 2, 4000, 128, True, None), (8, 2, 1, 9000, 64, True, None), (4, 2, 16, 2000, 128, True, None)]
    for Hq, Hkv, Lq, Lk, d, causal, n in cases:
        k = torch.randn(1, Hkv, Lk, d, device=dev, generator=g)
        v = torch.randn(1, Hkv, Lk, d, device=dev, generator=g)
        k8, ks = quantize_rows(k)
        v8, vs = quantize_rows(v)
        kd, vd = k8.double() * ks.double()[..., None], v8.double() * vs.double()[..., None]
        q = (torch.randn(1, Hq, Lq, d, device=dev, generator=g, dtype=torch.float64)
             + 2.0 * kd[:, :, 5:6].repeat_interleave(Hq // Hkv, 1)).to(torch.bfloat16)
        kp = torch.arange(Lk, device=dev)
        qp = torch.arange(Lk - Lq, Lk, device=dev) - (Lk // 3 if causal else 0)
        nv = n or Lk
        length = torch.tensor([nv], dtype=torch.int32, device=dev) if n else None
        if n:
            v8[:, :, n:] = float("nan")
            vs[:, :, n:] = float("nan")
        ref, ref_lse = attention_math(q.double(), kd[:, :, :nv], vd[:, :, :nv], q_pos=qp, k_pos=kp[:nv],
                                      causal=causal, scale=None)
        for opts in ({}, {"even": True}, {"even": True, "tma": True}):
            out, lse = decode_attention(q, k8, v8, q_pos=qp, k_pos=kp, causal=causal, length=length, k_scale=ks,
                                        v_scale=vs, options=opts)
            row = {"check": f"Hq{Hq} Hkv{Hkv} Lq{Lq} Lk{Lk} d{d} causal{int(causal)} length{n}", "options": opts,
                   "rel_err": rel(out, ref), "lse_err": (lse.double() - ref_lse).abs().max().item(),
                   "finite": bool(torch.isfinite(out).all())}
            res["checks"].append(row)
            print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--keys", type=int, nargs="+", default=[131072, 32768])
    ap.add_argument("--quick", action="store_true", help="before / default / even / even tma / stream only")
    ap.add_argument("--check", action="store_true", help="first the CUDA checks against float64")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "commit": commit(), "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "query_rows": 1, "batch": 1},
           "fp8_options": dk._FP8_OPTIONS, "rows": [], "checks": []}
    # device copy bandwidth (read + write), the ceiling for reference
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    med, _ = time_us(lambda i: y.copy_(x), 1, calls=4, replays=5)
    res["copy_tb_per_s"] = 2 * x.numel() / med / 1e6
    del x, y
    print("copy TB/s", res["copy_tb_per_s"], flush=True)
    if args.check:
        cuda_checks(res)
    for Lk in args.keys:
        run_keys(Lk, args if Lk == args.keys[0] else argparse.Namespace(quick=True), res)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
