#!/bin/bash
# Call G: RoPE in place (q, k, v stay views of the projection; attention's output comes in [B, L, H, D] memory and
# feeds wo without a copy). 1) bench/dump_logits.py under .base (65e2dca) and this tree: 2-layer Llama-8B shape,
# 8K random tokens, bf16 / --fp8 linear,kv / --sparse minference (forced): logits and 16 greedy tokens compared;
# 2) 128K prefill --fp8 linear,kv alternated, bf16 once per tree.
LOG=run_g.log; source bench/gpu_env.sh; mkdir -p /tmp/ab /tmp/dl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
for cfg in "none" "fp8 --fp8 linear,kv" "sparse --sparse minference"; do
  set -- $cfg; name=$1; shift
  PYTHONPATH=/tmp/site:$PWD/.base T=120 step python3 .base/dump_logits.py "$@" --out /tmp/dl/${name}_base.pt
  T=120 step python3 bench/dump_logits.py "$@" --out /tmp/dl/${name}_new.pt
  T=60 step python3 bench/dump_logits.py --compare /tmp/dl/${name}_base.pt /tmp/dl/${name}_new.pt
done
W="--cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
run() {  # tree name bench-args...
  local tree=$1 name=$2; shift 2
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  PYTHONPATH=/tmp/site:$ROOT T=150 step python3 $ROOT/launch/bench.py prefill $L8B $W "$@" --out /tmp/ab/g_${name}_${tree}.json
}
run base kv1 --fp8 linear,kv
run new kv1 --fp8 linear,kv
run new none
run base none
run new kv2 --fp8 linear,kv
run base kv2 --fp8 linear,kv
python3 - <<'PY' > "$OUT/ab_g.json"
import glob, json
print(json.dumps({p.split("/")[-1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/ab/g_*.json"))}))
PY
grep -h "Traceback\|Error\|equal" "$LOG" | head -20
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/ab_g.json"))
for k, v in d.items():
    print(k, v["device"], [(r["length"], round(r["prefill_seconds"], 4), [round(x, 4) for x in r["all_seconds"]]) for r in v["results"]])
PY
