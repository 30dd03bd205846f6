#!/bin/bash
# Device call H (one H200, warm after call G): issue 18 item 3, each sparse component on real inputs:
# bench/sparse_components.py on SmolLM2-135M real weights, q / k / v of layers 4, 15, 27 captured from one
# 128K forward over the essay filler; MInference default and the searched config, AnchorAttention default and
# the calibrated 128 x 16 file; estimate / index build / kernel timed apart, against cuDNN dense; small launch sweeps.
LOG=run_h.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
fi
T=420 step python3 bench/sparse_components.py --model $SMOL --length 131072 --layers 4,15,27 \
  --minference-config bench/results/2026-11-23-h200-accuracy/smollm2_minference_8k.json \
  --anchor-config bench/results/2026-11-23-h200-sparse-realweights/anchor_smollm2_128x16.json --anchor-default \
  --mi-launch "4,3;4,4;8,2;8,3" --anchor-launch "8,3;4,2;4,3;8,2,128;8,3,32" \
  --out $OUT/sparse_components_128k.json
grep -h "Traceback\|Error" "$LOG" | head
