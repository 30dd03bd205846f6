#!/usr/bin/env bash
# AnchorAttention identification, per-head vs KV-grouped stripe kernel (identify_stripes group_heads), on
# one GPU, the tree of the commit that adds this script (carry .whl): SmolLM2's head shape (9 / 3 heads,
# d 64, GQA 3: the grouped kernel pads each KV group to 4 heads) at 32K / 128K / 512K and the Llama-8B
# shape (32 / 8, d 128) at 32K / 128K; structured synthetic q / k / v, theta 12, median of 5. The bench
# checks that both kernels return the same stripe lists ("grouped_same_lists").
LOG=run.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
T=200 step python3 launch/bench.py anchor --lengths 32768,131072,524288 --heads 9 --kv-heads 3 --head-dim 64 --vs "1000,6096" --repeats 5 --group-heads --out "$OUT/anchor_d64.json"
T=150 step python3 launch/bench.py anchor --lengths 32768,131072 --heads 32 --kv-heads 8 --head-dim 128 --vs "1000,6096" --repeats 5 --group-heads --out "$OUT/anchor_d128.json"
grep -h "Traceback\|Error" "$LOG" | head
python3 - "$OUT"/anchor_d*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    d = json.load(open(p)); c = d["config"]
    for r in d["results"]:
        for a in r["anchor"]:
            print(c["heads"], c["kv_heads"], c["head_dim"], r["length"], "identify", round(a["identify_ms"], 3),
                  "grouped", round(a["identify_grouped_ms"], 3), "same", a["grouped_same_lists"],
                  "kernel", round(a["kernel_ms"], 2), "density", round(a["density"], 3))
PY
