#!/bin/bash
# Issue 18's "index build <= 5% of the kernel time" at 128K: bench/minference_index_bench.py now also times the
# sparse kernel the plan feeds and the plan's summed kernel time (its host launches excluded), for the Llama-8B
# (32 / 8 heads, d 128) and SmolLM2 (9 / 3, d 64) shapes, Vertical-Slash 1000 / 6096, random bf16 q / k / v (the
# build's and the kernel's cost on a given index do not depend on the values).
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=200 step python3 bench/minference_index_bench.py --heads 32 --kv-heads 8 --head-dim 128 --out "$OUT/index_l8b.json"
T=200 step python3 bench/minference_index_bench.py --out "$OUT/index_smollm2.json"
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, os
for n in ("index_l8b", "index_smollm2"):
    r = json.load(open(f"{os.environ['OUT']}/{n}.json"))
    print(n, r["shape"], {k: r.get(k) for k in ("plan_ms_gpu", "plan_ms_wall", "plan_kernels_ms", "sparse_kernel_ms_random_index")})
PY
