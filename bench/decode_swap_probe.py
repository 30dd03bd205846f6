"""Probe (issue 19): e4m3 split-KV decode with the products transposed ("swap AB").

The library kernel (kernels/decode.py) computes S = Q K^T with the few query rows of a KV head as the
MMA's M dimension, padded to 16. Here S^T = K Q^T and O^T = V^T P^T put the keys (128 per tile) on M,
so that on Hopper the converted e4m3 -> fp16 K / V tiles can feed the tensor cores from registers
(wgmma's A operand) instead of a second trip through shared memory. Non-causal, one query row per
head (decode), partial results merged by kernels/decode.py's merge kernel. If it wins it moves into
kernels/decode.py; this script times both on one GPU at 128K keys, JSON out.

    python bench/decode_swap_probe.py --out swap.json          # GPU
    TRITON_INTERPRET=1 python bench/decode_swap_probe.py --check  # CPU: correctness vs float64 only
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from starshard.benchmarks.common import graph_time_us
from starshard.kernels.decode import _decode_merge_kernel, decode_attention
from starshard.kernels.fp8 import dequantize, quantize_rows
from starshard.kernels.online_softmax import LOG2E


@triton.jit
def _split_t_kernel(Q, K, V, KS, VS, OP, LP, qk_scale,
                    s_qh, s_kh, s_kn, s_vh, s_vn, s_sh,
                    G, Lk, chunk, n_splits,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + (kvh * G + rows)[:, None] * s_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if IEEE:
        qt = tl.trans(q)
    else:
        qt = tl.trans(tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_t = tl.zeros([D, BLOCK_M], dtype=tl.float32)
    k_base = K + kvh.to(tl.int64) * s_kh
    v_base = V + kvh.to(tl.int64) * s_vh
    s_base = kvh.to(tl.int64) * s_sh
    lo = split * chunk
    hi = tl.minimum(lo + chunk, Lk)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        ok = cols < hi
        k = tl.load(k_base + cols[:, None] * s_kn + offs_d[None, :], mask=ok[:, None], other=0.0)
        vt = tl.load(v_base + cols[None, :] * s_vn + offs_d[:, None], mask=ok[None, :], other=0.0)
        ks = tl.load(KS + s_base + cols, mask=ok, other=0.0)
        vs = tl.load(VS + s_base + cols, mask=ok, other=0.0)
        if IEEE:
            st = tl.dot(k.to(tl.float32), qt, input_precision="ieee")
        else:
            st = tl.dot(k.to(tl.float16), qt)
        st = tl.where(ok[:, None], st * (ks * qk_scale)[:, None], float("-inf"))  # [BLOCK_N, BLOCK_M]
        m_new = tl.maximum(m_i, tl.max(st, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(st - m_use[None, :])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 0)
        s_max = tl.max(vs, 0)
        s_max = tl.where(s_max > 0.0, s_max, 1.0)
        pv = p * (vs / s_max)[:, None]
        if IEEE:
            prod = tl.dot(vt.to(tl.float32), pv, input_precision="ieee")
        else:
            prod = tl.dot(vt.to(tl.float16), pv.to(tl.float16))
        acc_t = acc_t * alpha[None, :] + prod * s_max
        m_i = m_new
    out_t = acc_t / tl.where(l_i == 0.0, 1.0, l_i)[None, :]
    lse2 = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    part = (kvh * G + rows).to(tl.int64) * n_splits + split  # [BLOCK_M] rows of (head, split), Lq = 1
    tl.store(OP + part[None, :] * D + offs_d[:, None], out_t, mask=row_ok[None, :])
    tl.store(LP + part, lse2, mask=row_ok)


def decode_swapped(q, k8, v8, ks, vs, num_splits=33, block_n=128, warps=4, stages=3):
    """q [1, Hq, 1, D]; k8, v8 [1, Hkv, Lk, D] e4m3; scales [1, Hkv, Lk]. Non-causal. -> (out, lse)."""
    _, Hq, _, D = q.shape
    Hkv, Lk = k8.shape[1], k8.shape[2]
    G = Hq // Hkv
    per = -(-Lk // num_splits)
    chunk = -(-per // block_n) * block_n
    n_splits = -(-Lk // chunk)
    op = torch.empty(1, Hq, 1, n_splits, D, dtype=torch.float32, device=q.device)
    lp = torch.empty(1, Hq, 1, n_splits, dtype=torch.float32, device=q.device)
    _split_t_kernel[(n_splits, Hkv)](q, k8, v8, ks, vs, op, lp, D**-0.5 * LOG2E,
                                     q.stride(1), k8.stride(1), k8.stride(2), v8.stride(1), v8.stride(2), ks.stride(1),
                                     G, Lk, chunk, n_splits, D=D, BLOCK_M=max(16, triton.next_power_of_2(G)),
                                     BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages)
    out = torch.empty_like(q)
    lse = torch.empty(1, Hq, 1, dtype=torch.float32, device=q.device)
    _decode_merge_kernel[(Hq,)](op, lp, out, lse, *out.stride(), Hq, 1, n_splits, HEAD_DIM=D, BLOCK_D=D,
                                BLOCK_S=min(16, triton.next_power_of_2(n_splits)), num_warps=4)
    return out, lse


def inputs(Hq, Hkv, Lk, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, Hq, 1, D, generator=g).to(device, dtype)
    k, v = (torch.randn(1, Hkv, Lk, D, generator=g).to(device) for _ in range(2))
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    return q, k8, v8, ks, vs


def check():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
        q, k8, v8, ks, vs = inputs(8, 2, 301, 32, dtype, "cpu")
        ref = torch.softmax((q.double() @ dequantize(k8, ks, torch.float64).repeat_interleave(4, 1).transpose(-1, -2))
                            * 32**-0.5, -1) @ dequantize(v8, vs, torch.float64).repeat_interleave(4, 1)
        out, _ = decode_swapped(q, k8, v8, ks, vs, num_splits=3, block_n=64)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(dtype, "rel err vs float64", err)
        assert err < tol, err


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file to write (GPU run)")
    ap.add_argument("--check", action="store_true", help="correctness only (CPU under TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.check:
        return check()
    dev = torch.device("cuda")
    q, k8, v8, ks, vs = inputs(32, 8, 131072, 128, torch.bfloat16, dev)
    pos = torch.arange(131072, device=dev)
    qp = torch.tensor([131072], device=dev)
    lib = lambda: decode_attention(q, k8, v8, q_pos=qp, k_pos=pos, causal=False, k_scale=ks, v_scale=vs)  # noqa: E731
    ref = lib()[0].float()
    res = {"device": torch.cuda.get_device_name(dev), "keys": 131072, "heads": [32, 8], "d": 128,
           "library_us": graph_time_us(lib, calls=20, replays=5, best=True, warmup=1), "swapped": {}}
    print("library", res["library_us"], flush=True)
    for bn, w, st in [(128, 4, 3), (128, 4, 2), (64, 4, 3), (128, 8, 3), (256, 8, 2)]:
        for splits in (33, 66):
            f = lambda: decode_swapped(q, k8, v8, ks, vs, splits, bn, w, st)  # noqa: E731
            try:
                err = ((f()[0].float() - ref).norm() / ref.norm()).item()
                t = graph_time_us(f, calls=20, replays=5, best=True, warmup=1)
            except Exception as e:  # a config that does not compile / fit
                print(bn, w, st, splits, "failed", str(e)[:200], flush=True)
                continue
            res["swapped"][f"bn{bn}_w{w}_s{st}_splits{splits}"] = {"us": t, "rel_diff_vs_library": err}
            print(bn, w, st, splits, t, err, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
