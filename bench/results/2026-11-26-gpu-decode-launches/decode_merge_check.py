"""The split-KV decode with its merge inside the split kernel (decode_attention(counters=)) against the two
launches (split, then merge) on one GPU: bit equality eager and over many CUDA-graph replays (a lost or
early count would show as a wrong row in some replay), and microseconds per call from a CUDA graph, each
call reading its own copy of the cache from HBM (as every layer of a decode step does).

    python bench/decode_merge_check.py --out decode_merge.json

Shapes: Qwen3-30B-A3B (32 / 4 heads, d 128), Llama-3.1-8B (32 / 8, d 128), SmolLM2-135M (9 / 3, d 64);
bf16 caches and the e4m3 cache (Llama); one query token, no mask, the valid count on the device (the graph
decode's call). Random inputs: the time does not depend on the values. Exits 1 if any output differs.
"""
import argparse
import json
import sys

import torch

from starshard.benchmarks.common import commit, graph_time_us
from starshard.kernels.decode import decode_attention, decode_counters
from starshard.kernels.fp8 import quantize_rows
from starshard.kernels.pdl import pdl_enabled

SHAPES = {"qwen3moe": (32, 4, 128), "llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--replays", type=int, default=200, help="graph replays checked bit for bit per row")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
           "pdl": pdl_enabled(dev), "rows": []}
    bad = 0
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
                        (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
                        kvs.append(dict(k=k8, v=v8, k_scale=ks.reshape(1, Hkv, cap), v_scale=vs.reshape(1, Hkv, cap)))
                    else:
                        kvs.append(dict(k=k, v=v))
                length = torch.tensor([ctx], dtype=torch.int32, device=dev)
                pos, qpos = torch.arange(cap, device=dev), torch.tensor([ctx - 1], device=dev)
                counters = decode_counters(dev)

                def call(i, merge):
                    return decode_attention(q, q_pos=qpos, k_pos=pos, causal=False, length=length,
                                            counters=counters if merge else None, **kvs[i])

                want = [call(i, False) for i in range(copies)]
                eager_equal = all(torch.equal(call(i, True)[j], want[i][j]) for i in range(copies) for j in (0, 1))
                # Graph of one call per copy, replayed: every replay's outputs checked
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    [call(i, True) for i in range(copies)]
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = [call(i, True) for i in range(copies)]
                wrong = 0
                for _ in range(args.replays):
                    graph.replay()
                    wrong += sum(not (torch.equal(outs[i][0], want[i][0]) and torch.equal(outs[i][1], want[i][1]))
                                 for i in range(copies))
                row = {"shape": name, "fp8": fp8, "context": ctx, "copies": copies, "eager_equal": eager_equal,
                       "graph_replays": args.replays, "graph_calls_wrong": wrong, "counters_zero": not counters.any().item(),
                       "two_launches_us": graph_time_us(lambda i: call(i, False), 20, best=True, copies=copies),
                       "merge_in_kernel_us": graph_time_us(lambda i: call(i, True), 20, best=True, copies=copies)}
                bad += (not eager_equal) + wrong + (not row["counters_zero"])
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                del graph, outs
                kvs.clear()
                torch.cuda.empty_cache()
    res["failures"] = bad
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
