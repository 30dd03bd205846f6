#!/bin/bash
# Call F: the prefill KV write into the e4m3 cache in one launch (kernels/kv_write.py write_kv_block) — its bytes
# against the torch path on the GPU (bench/kv_block_write_check.py), then 128K prefill --fp8 linear,kv with
# .base = d8a1df3 (fast accumulation, torch KV write) and this tree, alternated, and bf16 once.
LOG=run_f.log; source bench/gpu_env.sh; mkdir -p /tmp/ab
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=120 step python3 bench/kv_block_write_check.py --out "$OUT/kv_block_write.json"
W="--cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
run() {  # tree name bench-args...
  local tree=$1 name=$2; shift 2
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  PYTHONPATH=/tmp/site:$ROOT T=150 step python3 $ROOT/launch/bench.py prefill $L8B $W "$@" --out /tmp/ab/f_${name}_${tree}.json
}
run base kv1 --fp8 linear,kv
run new kv1 --fp8 linear,kv
run new kv2 --fp8 linear,kv
run base kv2 --fp8 linear,kv
run new none
python3 - <<'PY' > "$OUT/ab_f.json"
import glob, json
print(json.dumps({p.split("/")[-1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/ab/f_*.json"))}))
PY
grep -h "Traceback\|Error" "$LOG" | head
cat "$OUT/kv_block_write.json"
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/ab_f.json"))
for k, v in d.items():
    print(k, v["device"], [(r["length"], round(r["prefill_seconds"], 4), [round(x, 4) for x in r["all_seconds"]]) for r in v["results"]])
PY
