"""Graph vs eager service runs (launch/bench.py serve JSONs): timings side by side, and whether every
concurrent question generated the same tokens."""
import json
import sys

g, e = (json.load(open(f)) for f in sys.argv[1:3])
for rg, re_ in zip(g["results"], e["results"]):
    print(f"{rg['length']}: ttft cached {rg['ttft_cached_s']:.4f} (graphs) / {re_['ttft_cached_s']:.4f} s (eager)")
    for cg, ce in zip(rg["concurrency"], re_["concurrency"]):
        same = cg["tokens"] == ce["tokens"]
        print(f"  {cg['questions']:2d} questions: {cg['decode_tokens_per_second']:7.1f} vs {ce['decode_tokens_per_second']:7.1f} "
              f"tok/s, step {1e3 * cg['step_seconds_median']:.1f} vs {1e3 * ce['step_seconds_median']:.1f} ms, "
              f"same tokens: {same}")
