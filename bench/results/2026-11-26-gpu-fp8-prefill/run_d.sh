#!/bin/bash
# Call D: the committed tree (d8a1df3: fast accumulation) at 8K and 128K, bf16 vs --fp8 linear,kv with fast /
# promoted accumulation, .base (c3525b2) linear,kv as the before; order bf16, fast, promoted, base, fast, bf16.
LOG=run_d.log; source bench/gpu_env.sh; mkdir -p /tmp/ab
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
W="--cp-strategy dense --lengths 8192,131072 --warmup 1 --repeats 2 --decode-steps 0"
run() {  # tree name env-assignment bench-args...
  local tree=$1 name=$2 envs=$3; shift 3
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  PYTHONPATH=/tmp/site:$ROOT T=150 step env $envs python3 $ROOT/launch/bench.py prefill $L8B $W "$@" --out /tmp/ab/d_${name}_${tree}.json
}
run new none1 X=1
run new fast1 X=1 --fp8 linear,kv
run new promoted STARSHARD_FP8_FAST_ACCUM=0 --fp8 linear,kv
run base linear_kv X=1 --fp8 linear,kv
run new fast2 X=1 --fp8 linear,kv
run new none2 X=1
python3 - <<'PY' | tee -a "$LOG" > "$OUT/ab_d.json"
import glob, json
print(json.dumps({p.split("/")[-1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/ab/d_*.json"))}))
PY
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/ab_d.json"))
for k, v in d.items():
    print(k, v["device"], [(r["length"], round(r["prefill_seconds"], 4), [round(x, 4) for x in r["all_seconds"]]) for r in v["results"]])
PY
