#!/bin/bash
# One device call (no carry), issue 18: the sparse kernels' rates with the new default launches (4 warps
# at head dim 128, flat Vertical-Slash runs; kernels/minference/kernel.py default_launch, kernels/anchor.py
# default_launch), the fallback cost model's inputs (plan.KernelRates, anchor.AnchorRates): structured
# inputs, 32K and 128K, Llama-8B heads (32 / 8, d128) and SmolLM2 heads (9 / 3, d64), bf16.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/run_e.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
P="vs:1000,6096;vs:200,1024;ashape:1024,4096;bs:100"
timeout 150 python3 launch/bench.py sparse --device cuda --lengths 32768,131072 --heads 32 --kv-heads 8 --head-dim 128 --patterns "$P" --repeats 3 --out "$OUT/sparse_d128.json" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"
timeout 100 python3 launch/bench.py sparse --device cuda --lengths 32768,131072 --heads 9 --kv-heads 3 --head-dim 64 --patterns "$P" --repeats 3 --out "$OUT/sparse_d64.json" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"
A="launch/bench.py anchor --device cuda --lengths 32768,131072 --thetas 4,8,12 --vs 1000,6096 --repeats 3 --warmup 1"
timeout 150 python3 $A --heads 32 --kv-heads 8 --head-dim 128 --out "$OUT/anchor_d128.json" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"
timeout 100 python3 $A --heads 9 --kv-heads 3 --head-dim 64 --out "$OUT/anchor_d64.json" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys
o = sys.argv[1]
for d in (128, 64):
    s = json.load(open(f"{o}/sparse_d{d}.json"))
    for r in s["results"]:
        for p in r["patterns"]:
            f = p["density"] * r["dense_cudnn_ms"] / p["kernel_ms"]
            print(f"d{d} {r['length']} {p['name']}: density {p['density']:.3f} kernel {p['kernel_ms']:.2f} ms "
                  f"index {p['index_ms']:.2f} ms dense {r['dense_cudnn_ms']:.2f} ms fraction {f:.3f}")
    a = json.load(open(f"{o}/anchor_d{d}.json"))
    for r in a["results"]:
        for p in r["anchor"]:
            f = p["density"] * r["dense_cudnn_ms"] / p["kernel_ms"]
            print(f"anchor d{d} {r['length']} theta {p['theta']}: density {p['density']:.3f} kernel {p['kernel_ms']:.2f} "
                  f"identify {p['identify_ms']:.2f} dense {r['dense_cudnn_ms']:.2f} fraction {f:.3f}")
PY
