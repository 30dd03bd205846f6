#!/usr/bin/env bash
# `--fp8 attention` in the ring (8-bit scores in every unmasked call: the local diagonal chunks, the full
# local pair and each remote block, flash_fp8 variant "s" with causal=False for the latter), two GPUs,
# carry .whl; ran on bb2830a with ring_int8.patch applied (`git apply` it first: the library does not keep
# it, see README.md). First the CUDA checks (ring / Ulysses with and
# without 8-bit scores over NCCL against float64 at 4096 / 4109 tokens, the dispatcher, the merges), then
# Llama-3.1-8B shape prefill over the zigzag ring, cp = 2, 128K, random bf16 weights (fine for dense and
# CP speed), `--fp8 linear,kv` against `--fp8 linear,kv,attention`, alternated, warm-up 1, median of 2.
LOG=run.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
T=150 step torchrun --nproc-per-node 2 launch/gpu_check.py --cp
grep -h '"ok": false' "$LOG" | head
W="--lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
for fp8 in linear,kv linear,kv,attention linear,kv,attention linear,kv; do
  T=100 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --fp8 $fp8 $W --out "$OUT/ring_cp2_${fp8//,/_}_$RANDOM.json"
done
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"check": "cp/' "$LOG" | cut -c1-160
python3 - "$OUT"/ring_cp2_*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    d = json.load(open(p))
    print(d["fp8"], [(r["length"], round(r["prefill_seconds"], 3)) for r in d["results"]])
PY
