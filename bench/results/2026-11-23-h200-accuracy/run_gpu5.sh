#!/usr/bin/env bash
# Ran as bench/run_gpu5.sh with the code at commit 0d553cd; run it from the repo root (it sources bench/gpu_env.sh).
# One H200: the accuracy tables on the embedded default (SmolLM2-135M-Instruct, bf16) for dense,
# Star (4 blocks on one device = what 4 hosts run), MInference (searched per-head config, and the
# published default Vertical-Slash 1000/6096), plus a dispatcher overhead probe.
# The GGUF (98 MB) exceeds one call's 64 MiB tree limit: a first call carries .stage/smol.gguf.part-aa
# and copies it to /tmp (a warm machine keeps /tmp between calls), this one .stage/smol.gguf.part-ab.
LOG=run5.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
if [ "${PHASE:-A}" = A ]; then
  cat /tmp/smol.gguf.part-aa .stage/smol.gguf.part-ab > /tmp/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c | tee -a "$LOG" || exit 1
fi
E="python3 launch/eval.py --lengths ${LENGTHS:-1024,2048,4096,8192} --num-depths 5 --device cuda --no-progress"
mkdir -p "$OUT/acc"
if [ "${PHASE:-A}" = A ]; then
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol.gguf --out "$SMOL" --dtype float32
  T=60 step python3 bench/check_graph_decode.py
  T=90 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 32768 --steps 32
  T=120 step python3 -m starshard.tools.minference_search --length 8192 --device cuda --dtype bfloat16 --out "$OUT/smollm2_minference_8k.json" --quiet
  cp "$OUT/smollm2_minference_8k.json" /tmp/  # phase B reads it
  T=200 step $E --out "$OUT/acc/dense"
  T=200 step $E --cp-strategy star --num-blocks 4 --strategy-name star-4blocks --out "$OUT/acc/star4"
else  # phase B: the next call on the same warm machine (converted model and searched config in /tmp)
  test -f "$SMOL/manifest.json" || { echo "phase B needs phase A's converted model on this machine" | tee -a "$LOG"; exit 1; }
  T=200 step $E --sparse minference --sparse-config /tmp/smollm2_minference_8k.json --strategy-name minference-searched --out "$OUT/acc/mi_searched"
  T=200 step $E --sparse minference --strategy-name minference-vs-1000-6096 --out "$OUT/acc/mi_default"
  T=200 step $E --cp-strategy star --num-blocks 4 --strategy-name star-4blocks --out "$OUT/acc/star4"
fi
cd "$OUT" && tar czf "acc_${PHASE:-A}.tgz" acc && rm -rf acc
