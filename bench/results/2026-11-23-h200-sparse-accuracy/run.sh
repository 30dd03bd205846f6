#!/usr/bin/env bash
# Issue 18 item 5 on one H200: harness accuracy of every sparse configuration of
# 2026-11-23-h200-sparse-realweights (its run.sh PHASE=B: SmolLM2-135M real weights, bf16, 1K-8K,
# 5 tasks x 2 depths; dense / Star 4 / APB 4 references, MInference default and searched, the two
# calibrated AnchorAttention files committed there; plus the attention-level recall at 8K).
# Run from a tree with the SmolLM2 GGUF halves (.smol/part_ab carried, part_aa copied to /tmp/smol by
# a first call: see the sparse-realweights run.sh). Set-up here: assemble + convert the GGUF, put the
# committed calibrated files where PHASE=B reads them, then PHASE=B.
set -u
R=bench/results/2026-11-23-h200-sparse-realweights
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
mkdir -p "${OUT:-/tmp/out}"
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:$PWD python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" \
    --dtype float32 > "${OUT:-/tmp/out}/convert.log" 2>&1 || exit 1
fi
cp $R/anchor_smollm2_128x16.json /tmp/anchor_smollm2_128x16.json
cp $R/anchor_smollm2_64x4.json /tmp/anchor_smollm2_64x4.json
PHASE=B bash $R/run.sh
