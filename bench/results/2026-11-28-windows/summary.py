"""Issue 38's figures from `bench prefill --all-global` JSON files (run_speed.sh): per file and length, the
speedup of windows over every layer global against the FLOP model's prediction, KV per token against
all-global, and over a ring the K/V bytes per local layer against per global layer, each with its target."""
import json
import sys


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


for path in sys.argv[1:]:
    try:
        res = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: no result ({e})")
        continue
    print(f"{path}: {res['strategy']} cp={res['cp']} on {res['device']}")
    for row in res["results"]:
        L = row["length"]
        if "error" in row or "error" in row.get("all_global", {}):
            print(f"  {L}: {row.get('error') or row['all_global']['error']}")
            continue
        base = row["all_global"]
        s, p = row["speedup"], row["predicted_speedup"]
        print(f"  {L}: windows {row['prefill_seconds']:.2f} s, all-global {base['prefill_seconds']:.2f} s: "
              f"speedup {s:.2f}x, FLOP model {p:.2f}x, ratio {s / p:.2f} ({verdict(s / p >= 0.85)} >= 0.85)")
        kv = row["kv_per_token"]
        print(f"  {L}: KV per token {kv['windowed_trimmed'] / 1024:.1f} KiB vs {kv['all_global'] / 1024:.1f} KiB "
              f"all-global (planner, one device): {kv['ratio']:.3f} ({verdict(kv['ratio'] <= 0.30)} <= 0.30); "
              f"this run's cache {row['kv_cache_over_all_global']:.3f} of the baseline's (trimmed={row['kv_cache']['trimmed']})")
        rb = row.get("ring_bytes")
        if rb:
            print(f"  {L}: ring bytes per local layer {rb['local_per_layer'] / 2**20:.1f} MiB, per global layer "
                  f"{rb['global_per_layer'] / 2**20:.1f} MiB: {rb['ratio']:.4f} ({verdict(rb['ratio'] <= 0.10)} <= 0.10)")
