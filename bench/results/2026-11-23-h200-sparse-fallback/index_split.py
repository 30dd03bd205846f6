"""Where the time of MInference's dense-or-sparse choice goes, one attention layer of the 8B shape
(32 query heads, 8 KV heads, d128, bf16), Vertical-Slash (1000, 6096) on every head, random and
structured inputs (`launch/bench.py sparse`'s): the estimate (`vs_select`; also with the
estimate's old step size, index._ESTIMATE_BUDGET = 1 << 26), the diagonal runs' cost
and the sync (`vs_segments` + `slash_cost`), the column lists (`vs_index`, the index work still ahead
when a head survives the first check: KernelRates.vs_index), the whole choice (`plan_with_fallback`
with the H200 rates), the call with the fallback, the call without it (every head sparse, as before
the fallback existed), and the dense dispatcher.

    python3 bench/results/2026-11-23-h200-sparse-fallback/index_split.py --out index_split.json
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, device_name, timed_median, utc_now
from starshard.benchmarks.sparse import make_inputs
from starshard.kernels import minference as mi
from starshard.kernels.attention import attention
from starshard.kernels.minference import index as mi_index


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="65536,131072")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    H, Hkv, D = (int(x) for x in args.heads.split(","))
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        for kind in ("random", "structured"):
            q, k, v = make_inputs(kind, L=L, H=H, Hkv=Hkv, D=D, dtype=dtype, device=dev, seed=0)
            pos = torch.arange(L, device=dev)
            pat = mi.SparsePattern((mi.VerticalSlash(1000, 6096),))
            scale = D**-0.5

            def select():
                return mi.vs_select(q, k, offset=0, vertical=1000, slash=6096, scale=scale)

            v_idx, s_idx = select()

            def runs():
                seg, cnt = mi.vs_segments(s_idx, L, 64)
                return mi.slash_cost(seg, cnt, Lq=L, Lk=L, offset=0, block_size=64).tolist()

            def columns():
                return mi.vs_index(v_idx, s_idx, Lq=L, Lk=L, offset=0, block_size=64)

            def plan():
                return mi.plan_with_fallback(q, k, pat, offset=0, scale=scale, rates=mi.H200_RATES)

            def fallback():
                return mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pat, rates=mi.H200_RATES)

            def forced():
                return mi.minference_attention(q, k, v, q_pos=pos, k_pos=pos, pattern=pat)

            def dense():
                return attention(q, k, v, q_pos=pos, k_pos=pos)

            p = plan()
            budget = mi_index._ESTIMATE_BUDGET
            mi_index._ESTIMATE_BUDGET = 1 << 26  # the estimate's step before it grew (8 steps of 4 heads at 128K)
            select_small_steps = timed_median(select, dev, args.repeats, 1) * 1e3
            mi_index._ESTIMATE_BUDGET = budget
            ms = {name: timed_median(fn, dev, args.repeats, 1) * 1e3 for name, fn in (
                ("dense", dense), ("select", select), ("runs_cost", runs), ("column_index", columns), ("plan", plan),
                ("fallback", fallback), ("forced", forced))}
            row = {"length": L, "inputs": kind, **{f"{k}_ms": v for k, v in ms.items()},
                   "select_budget_1_26_ms": select_small_steps,
                   "heads_dense": len(p.dense), "heads": H,
                   "density_min": min(p.density), "density_mean": sum(p.density) / H, "density_max": max(p.density),
                   "column_index_s_per_head_key": ms["column_index"] / 1e3 / (H * L),
                   "fallback_over_dense": ms["fallback"] / ms["dense"], "forced_over_dense": ms["forced"] / ms["dense"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del q, k, v, v_idx, s_idx, p
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    result = {"kind": "sparse_fallback_index_split", "device": device_name(dev), "date": utc_now(), "commit": commit(),
              "torch": torch.__version__, "config": {"heads": H, "kv_heads": Hkv, "head_dim": D, "dtype": args.dtype,
                                                     "pattern": "vertical_slash 1000 6096", "block_size": 64,
                                                     "repeats": args.repeats, "warmup": 1},
              "results": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
