#!/usr/bin/env bash
# Ran as bench/run_gpu6.sh as of commits 5b7defd / 3dc8974, before the benchmark programs became `launch/bench.py`
# subcommands: launch/bench_anchor.py is now `launch/bench.py anchor`.
# One H200: APB accuracy and the paper's ablations on the embedded default (bench/apb_ablation.sh,
# one device runs what 4 hosts would), reusing the dense and Star runs of bench/run_gpu5.sh (same
# prompts); then (phase B) AnchorAttention's kernel benchmark, attention fidelity at 8K, cold start.
# Staging of the GGUF as in run_gpu5.sh (part aa copied to /tmp by a first call).
LOG=run6.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache PYTHON=python3
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol.gguf.part-aa .stage/smol.gguf.part-ab > /tmp/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c | tee -a "$LOG" || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol.gguf --out "$SMOL" --dtype float32
fi
A=/tmp/apb_runs; mkdir -p $A
R=bench/results/2026-11-23-h200-accuracy
[ -d $A/dense ] || cp -r $R/dense $A/dense
[ -d $A/star ] || cp -r $R/star4 $A/star
if [ "${PHASE:-A}" = A ]; then
  DEVICE=cuda LENGTHS=1024,2048,4096,8192 HOSTS=4 SAMPLES=1 OUT=$A T=560 step bash bench/apb_ablation.sh
else
  DEVICE=cuda LENGTHS=1024,2048,4096,8192 HOSTS=4 SAMPLES=1 OUT=$A T=300 step bash bench/apb_ablation.sh
  T=120 step python3 launch/bench_anchor.py --device cuda --out "$OUT/anchor.json"
  T=150 step python3 launch/fidelity.py --task niah_number --length 8192 --depth 0.5 --device cuda --star cp=4 --apb cp=4 --minference pattern=vs,vertical=1000,slash=6096 --minference pattern=ashape,sink=128,local=1024 --out "$OUT/fid8k"
  T=120 step python3 bench/probe_cold.py
fi
cp $A/compare.md "$OUT/apb_compare.md" 2>/dev/null
cd /tmp && tar czf "$OUT/apb_runs_${PHASE:-A}.tgz" apb_runs
