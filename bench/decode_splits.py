"""Split count of the split-KV decode attention (kernels/decode.py) at decode shapes: microseconds per call
(split kernel + merge) replayed from a CUDA graph, each call reading its own copy of the cache from HBM (as
every layer of a step does), for the built-in count (`_num_splits`: _PROGRAMS_PER_SM programs per multiprocessor, no split under
_MIN_CHUNK keys) and forced counts. One query token, no mask, cache of `context` keys given
as capacity + `length` (the graph decode's call).

    python bench/decode_splits.py --out decode_splits.json

Shapes: Qwen3-30B-A3B (32 / 4 heads, d 128) and Llama-3.1-8B (32 / 8, d 128), bf16 caches and the e4m3
cache (Llama). Random inputs: the time does not depend on the values; every forced count's output is
checked against the built-in one's (they differ only in float32 summation order).
"""
import argparse
import json

import torch

from starshard.benchmarks.common import commit, graph_time_us
from starshard.kernels import decode as dk
from starshard.kernels.fp8 import quantize_rows

SHAPES = {"qwen3moe": (32, 4, 128), "llama8b": (32, 8, 128)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--splits", default="4,8,16,32,64,128,256,512")
    ap.add_argument("--configs", default="", help="also time these launches at the built-in split count, "
                    "';'-separated BLOCK_N,warps,stages (e.g. '64,4,3;128,4,2')")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
           "sm_count": torch.cuda.get_device_properties(dev).multi_processor_count, "rows": []}
    for name, (Hq, Hkv, D) in SHAPES.items():
        for fp8 in (False, True) if name == "llama8b" else (False,):
            for ctx in (int(c) for c in args.contexts.split(",")):
                cap = ctx + 64
                per = 2 * Hkv * cap * D * (1 if fp8 else 2)
                copies = max(2, -(-512 * 2**20 // per))
                q = torch.randn(1, Hq, 1, D, device=dev, generator=g, dtype=torch.bfloat16)
                kvs = []
                for _ in range(copies):
                    k = torch.randn(1, Hkv, cap, D, device=dev, generator=g, dtype=torch.bfloat16)
                    v = torch.randn(1, Hkv, cap, D, device=dev, generator=g, dtype=torch.bfloat16)
                    if fp8:
                        k8, ks = quantize_rows(k)
                        v8, vs = quantize_rows(v)
                        kvs.append((k8, v8, ks.reshape(1, Hkv, cap), vs.reshape(1, Hkv, cap)))
                    else:
                        kvs.append((k, v, None, None))
                length = torch.tensor([ctx], dtype=torch.int32, device=dev)
                pos = torch.arange(cap, device=dev)
                qpos = torch.tensor([ctx - 1], device=dev)

                def call(i, n=None, config=None):
                    k, v, ks, vs = kvs[i]
                    return dk.decode_attention(q, k, v, q_pos=qpos, k_pos=pos, causal=False, num_splits=n,
                                               length=length, k_scale=ks, v_scale=vs, config=config)

                auto = dk._num_splits(dev, Hkv, cap, fp8)
                ref = call(0)[0].float()
                row = {"shape": name, "Hq": Hq, "Hkv": Hkv, "D": D, "fp8": fp8, "context": ctx,
                       "kv_bytes": per * ctx // cap, "auto_splits": auto,
                       "auto_us": graph_time_us(lambda i: call(i), 20, best=True, copies=copies), "forced": {}}
                for n in (int(s) for s in args.splits.split(",")):
                    if n * 64 > cap:
                        continue
                    err = ((call(0, n)[0].float() - ref).abs().max() / ref.abs().max()).item()
                    row["forced"][n] = {"us": graph_time_us(lambda i: call(i, n), 20, best=True, copies=copies),
                                        "max_rel_diff": err}
                row["configs"] = {}
                for c in filter(None, args.configs.split(";")):
                    cfg = tuple(int(x) for x in c.split(","))
                    err = ((call(0, None, cfg)[0].float() - ref).abs().max() / ref.abs().max()).item()
                    row["configs"][c] = {"us": graph_time_us(lambda i: call(i, None, cfg), 20, best=True, copies=copies),
                                         "max_rel_diff": err}
                best = min(row["forced"].items(), key=lambda kv: kv[1]["us"])
                row["best_splits"], row["best_us"] = best[0], best[1]["us"]
                row["auto_tb_s"] = row["kv_bytes"] / row["auto_us"] / 1e6
                row["best_tb_s"] = row["kv_bytes"] / row["best_us"] / 1e6
                print(json.dumps({k: row[k] for k in ("shape", "fp8", "context", "auto_splits", "auto_us",
                                                      "best_splits", "best_us", "auto_tb_s", "best_tb_s")}), flush=True)
                res["rows"].append(row)
                kvs.clear()
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
