#!/usr/bin/env bash
# One H200 (device tool, nvidia-h200), bf16, issue 18 items 2, 4 and 5: sparse prefill on REAL weights
# (the embedded SmolLM2-135M-Instruct) and natural text (the harness's essay-like filler, written by
# bench/make_essay.py: 40000 sentences, ~564K SmolLM2 tokens, so no length below repeats it), against
# dense; AnchorAttention calibrated per head for this model (starshard.tools.anchor_calibrate); then
# the accuracy of every configuration on the harness. Random weights stay fine for dense and CP
# speed, never for sparse speed (`launch/bench.py prefill --help`).
# The GGUF (98 MB) exceeds one call's tree limit: it comes in two halves, as in
# 2026-11-23-h200-serve-smollm2/run.sh. Three calls on one warm machine, from the repo root:
#   1. mkdir -p /tmp/smol && cp .smol/part_aa /tmp/smol/                                        (seconds)
#   2. PHASE=A bash bench/results/2026-11-23-h200-sparse-realweights/run.sh   (~6-7 min; .smol carried)
#      set-up (GGUF -> checkpoint, essay text, anchor calibration at 8K: two poolings), then prefill
#      at 32K / 128K / 512K: dense, --sparse minference (default Vertical-Slash 1000/6096 and the
#      searched SmolLM2 config of 2026-11-23-h200-accuracy), --sparse anchor (both calibrated files);
#      Star --num-blocks 4 and APB --apb-hosts 4 at 512K, dense and with each sparse method inside.
#   3. PHASE=B bash bench/results/2026-11-23-h200-sparse-realweights/run.sh   (~3 min)
#      accuracy: launch/eval.py on SmolLM2, 1K-8K, 5 tasks x 2 depths (40 prompts per configuration),
#      dense / Star / APB references and every sparse configuration above, run four at a time (the
#      135M model leaves the GPU mostly idle), sparse ones with --sparse-min-length 0
#      --sparse-no-fallback (else every call at <= 64K keys runs dense); then eval.py --compare, and
#      the attention-level recall of the MInference configurations at 8K (launch/fidelity.py; the
#      calibrated anchor files carry each head's measured recall as "score").
# Prefill timing: 32K and 128K take --warmup 1 --repeats 3; 512K one cold run (--warmup 0) in its own
# process, after the 32K/128K process of the same configuration has filled the Triton cache. Lengths
# above SmolLM2's 8K window are a speed measurement only (the weights are real, the positions not).
LOG=run_${PHASE:-A}.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache PYTHON=python3
R=bench/results/2026-11-23-h200-sparse-realweights
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
MI=bench/results/2026-11-23-h200-accuracy/smollm2_minference_8k.json   # searched at 8K, bf16, one H200
A128=/tmp/anchor_smollm2_128x16.json A64=/tmp/anchor_smollm2_64x4.json ESSAY=/tmp/essay.txt

if [ "${PHASE:-A}" = A ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
  if [ ! -f "$SMOL/manifest.json" ]; then
    cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/smol.gguf
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c | tee -a "$LOG" || exit 1
    T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
  fi
  T=30 step python3 bench/make_essay.py --out $ESSAY --sentences 40000
  # per-head thresholds at the 0.95 recall target, harness prompts of 8K (3: multikey, niah_essay, multiquery)
  C="python3 -m starshard.tools.anchor_calibrate --model $SMOL --length 8192 --samples 3 --target-recall 0.95 --device cuda --quiet"
  T=90 step $C --block-q 128 --step 16 --out $A128
  T=90 step $C --block-q 64 --step 4 --out $A64
  cp $A128 $A64 "$OUT/"
  P="python3 launch/bench.py prefill --model $SMOL --prompt-file $ESSAY --dtype bfloat16 --decode-steps 0"
  run_cfg() {  # NAME [flags...]: 32K + 128K (warm, 3 repeats), then 512K (one cold run)
    local name=$1; shift
    T=90 step $P --cp-strategy dense --lengths 32768,131072 --warmup 1 --repeats 3 "$@" --out "$OUT/${name}_32k_128k.json"
    T=120 step $P --cp-strategy dense --lengths 524288 --warmup 0 --repeats 1 "$@" --out "$OUT/${name}_512k.json"
  }
  run_cfg dense
  run_cfg minference --sparse minference
  run_cfg minference_searched --sparse minference --sparse-config $MI
  run_cfg anchor_128x16 --sparse anchor --sparse-config $A128
  run_cfg anchor_64x4 --sparse anchor --sparse-config $A64
  S="$P --lengths 524288 --warmup 0 --repeats 1"
  for cp in "star --num-blocks 4" "apb --apb-hosts 4"; do
    n=${cp%% *}4
    T=90 step $S --cp-strategy $cp --out "$OUT/${n}_512k.json"
    T=90 step $S --cp-strategy $cp --sparse minference --out "$OUT/${n}_minference_512k.json"
    T=90 step $S --cp-strategy $cp --sparse anchor --sparse-config $A128 --out "$OUT/${n}_anchor_128x16_512k.json"
  done
else  # phase B: the same warm machine (checkpoint and calibrated files in /tmp)
  test -f "$SMOL/manifest.json" -a -f $A128 -a -f $A64 || { echo "phase B needs phase A's /tmp files" | tee -a "$LOG"; exit 1; }
  ACC=$OUT/acc; mkdir -p $ACC
  E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.25,0.75 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --no-progress"
  SP="--sparse-min-length 0 --sparse-no-fallback"
  ev() {  # NAME [flags...], in the background; its own log
    local name=$1; shift
    echo "=== eval $name: $* ($(date +%T))" | tee -a "$LOG"
    (timeout 150 $E --strategy-name "$name" --out "$ACC/$name" "$@" >"$ACC/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$LOG") &
  }
  ev dense; ev mi-default --sparse minference $SP; ev mi-searched --sparse minference --sparse-config $MI $SP
  ev anchor-128x16 --sparse anchor --sparse-config $A128 $SP; wait
  ev anchor-64x4 --sparse anchor --sparse-config $A64 $SP; ev star4 --cp-strategy star --num-blocks 4
  ev star4-mi-default --cp-strategy star --num-blocks 4 --sparse minference $SP
  ev star4-anchor-128x16 --cp-strategy star --num-blocks 4 --sparse anchor --sparse-config $A128 $SP; wait
  ev apb4 --cp-strategy apb --apb-hosts 4; ev apb4-mi-default --cp-strategy apb --apb-hosts 4 --sparse minference $SP
  ev apb4-anchor-128x16 --cp-strategy apb --apb-hosts 4 --sparse anchor --sparse-config $A128 $SP
  (T=120 step python3 launch/fidelity.py --model $SMOL --task multikey --length 8192 --device cuda --dtype bfloat16 --quiet \
     --minference config=$MI,name=mi-searched --minference pattern=vs,vertical=1000,slash=6096,name=mi-default --out "$OUT/fid8k") &
  wait
  T=60 step python3 launch/eval.py --compare $ACC/dense $ACC/mi-default $ACC/mi-searched $ACC/anchor-128x16 $ACC/anchor-64x4 --out $ACC
  cp $ACC/compare.md "$OUT/compare_sparse.md"
  T=60 step python3 launch/eval.py --compare $ACC/star4 $ACC/star4-mi-default $ACC/star4-anchor-128x16 --out $ACC
  cp $ACC/compare.md "$OUT/compare_star4.md"
  T=60 step python3 launch/eval.py --compare $ACC/apb4 $ACC/apb4-mi-default $ACC/apb4-anchor-128x16 --out $ACC
  cp $ACC/compare.md "$OUT/compare_apb4.md"
  cd "$OUT" && tar czf acc.tgz acc && rm -rf acc
fi
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"prefill_seconds"' "$LOG" | cut -c1-300
