#!/bin/bash
# Call D (final tree 8170716): the split-KV decode kernel's launch (BLOCK_N, warps, stages) at the built-in split
# count, 16-bit caches (the e4m3 kernel has its own launch), 4K-128K, MoE and Llama-8B heads.
LOG=run_d.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=300 step python3 bench/decode_splits.py --out "$OUT/decode_configs_d.json" --splits 32 \
  --configs "64,4,3;64,4,2;128,4,2;128,8,2;32,4,3;64,8,3;128,4,1"
python3 - <<'PY' | tee -a "$LOG"
import json, os
for r in json.load(open(os.environ["OUT"] + "/decode_configs_d.json"))["rows"]:
    if not r["fp8"]:
        print(r["shape"], r["context"], "auto", r["auto_splits"], round(r["auto_us"], 2),
              {c: round(v["us"], 2) for c, v in r["configs"].items()})
PY
