#!/usr/bin/env bash
# One H200: AnchorAttention accuracy on the embedded default (same prompts as run_gpu5.sh) and its
# kernel benchmark at 32K / 128K. Staging of the GGUF as in run_gpu5.sh.
LOG=run7.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol.gguf.part-aa .stage/smol.gguf.part-ab > /tmp/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c | tee -a "$LOG" || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol.gguf --out "$SMOL" --dtype float32
fi
E="python3 launch/eval.py --lengths 1024,2048,4096,8192 --num-depths 5 --device cuda --no-progress"
T=200 step $E --sparse anchor --anchor-theta 12 --anchor-block-q 16 --anchor-step 1 --strategy-name anchor-t12-q16 --out /tmp/acc/anchor
T=100 step python3 launch/bench_anchor.py --device cuda --lengths 131072 --thetas 4,12 --vs "1000,6096" --out "$OUT/anchor.json"
cd /tmp && tar czf "$OUT/anchor_acc.tgz" acc
