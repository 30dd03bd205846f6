#!/bin/bash
# Call B: 128K prefill end to end, Llama-3.1-8B shape, random bf16 weights (fine for dense speed), one GPU.
# .base = c3525b2 (the session's start); new = fast accumulation in the e4m3 GEMM + rope outputs in
# [B, L, H, D] memory (attention's output then feeds wo without a copy). STARSHARD_FP8_FAST_ACCUM=0
# separates the two changes. Trees alternated; warm-up 1, 2 timed prefills each.
LOG=run_b.log; source bench/gpu_env.sh; mkdir -p /tmp/ab
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
W="--cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
run() {  # tree name env-assignment bench-args...
  local tree=$1 name=$2 envs=$3; shift 3
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  PYTHONPATH=/tmp/site:$ROOT T=150 step env $envs python3 $ROOT/launch/bench.py prefill $L8B $W "$@" --out /tmp/ab/${name}_${tree}.json
}
[ "${SKIP_NONE:-0}" = 1 ] || run base none X=1
run base linear_kv X=1 --fp8 linear,kv
run new linear_kv X=1 --fp8 linear,kv
run new linear_kv_slowacc STARSHARD_FP8_FAST_ACCUM=0 --fp8 linear,kv
[ "${SKIP_NONE:-0}" = 1 ] || run new none X=1
T=120 step python3 bench/fp8_fast_accum.py --rows 131072 --attn-len 65536 --out /tmp/ab/probe.json
python3 - <<'PY' > "$OUT/ab_b.json"
import glob, json
print(json.dumps({p.split("/")[-1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/ab/*.json"))}))
PY
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^{"length"' "$LOG" | grep -o '"prefill_seconds": [0-9., \[]*' | head -40
