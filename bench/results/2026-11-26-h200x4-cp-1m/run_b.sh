#!/usr/bin/env bash
# Second call on the same x4 machine (carry .whl, .base = 98e69c0): the merges and AnchorAttention
# identification changed since 98e69c0 and were untimed. A / B against .base at 128K over cp = 4: ring
# (its in-place accumulate) in the order base, new, new, base; Star and APB (their two-partial merge) once
# each; then APB at 512K without passing blocks (the exposed all-gather), and on one GPU AnchorAttention
# identification at d128 128K (GQA 4) with the per-head and the KV-grouped stripe kernels. Llama-3.1-8B
# shape, random bf16 weights; structured synthetic q / k / v for the kernel bench.
LOG=run_b.log; source bench/gpu_env.sh; mkdir -p /tmp/ab
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
W="--lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
run() {  # tree name strategy-args...
  local tree=$1 name=$2; shift 2
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  PYTHONPATH=/tmp/site:$ROOT T=60 step torchrun --nproc-per-node 4 $ROOT/launch/bench.py prefill $L8B --cp 4 "$@" $W --out /tmp/ab/${name}_${tree}_$RANDOM.json
}
for tree in base new new base; do run $tree ring --cp-strategy ring; done
for tree in base new; do
  run $tree star --cp-strategy star --block-size 32768 --anchor-size 32768
  run $tree apb --cp-strategy apb --anchor-size 4096 --passing-size 2048
done
T=80 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy apb --anchor-size 4096 --passing-size 0 --lengths 131072,524288 --warmup 0 --repeats 1 --decode-steps 0 --out /tmp/ab/apb_nopass.json
A="--lengths 131072 --heads 32 --kv-heads 8 --head-dim 128 --repeats 5"
PYTHONPATH=/tmp/site:$PWD/.base T=90 step python3 .base/launch/bench.py anchor $A --out /tmp/ab/anchor_base.json
T=120 step python3 launch/bench.py anchor $A --group-heads --out /tmp/ab/anchor_new.json
python3 - <<'PY' > "$OUT/ab.json"
import glob, json
print(json.dumps({p.split("/")[-1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/ab/*.json"))}))
PY
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^{"length"' "$LOG" | grep -o '"prefill_seconds": [0-9.]*' | head -40
grep -h "identify" "$LOG" | cut -c1-600 | head
