#!/usr/bin/env bash
# A second phase-A call: run.sh's first call hit the device call limit after the dense and
# AnchorAttention rows, and the device tool returns at most 8 files per call, so the MInference rows it
# had measured were lost and the machine was given back. This call (after `mkdir -p /tmp/smol && cp
# .smol/part_aa /tmp/smol/` in a first call, carrying .smol/part_ab here) rebuilds the checkpoint and the
# essay text, re-runs the MInference rows and Star / APB at 512K with and without MInference inside,
# and returns them as one tarball. Same flags as run.sh.
LOG=run_rest.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
MI=bench/results/2026-11-23-h200-accuracy/smollm2_minference_8k.json
ESSAY=/tmp/essay.txt
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c | tee -a "$LOG" || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
fi
[ -f $ESSAY ] || T=30 step python3 bench/make_essay.py --out $ESSAY --sentences 40000
R=$OUT/rest; mkdir -p $R
P="python3 launch/bench.py prefill --model $SMOL --prompt-file $ESSAY --dtype bfloat16 --decode-steps 0"
T=60 step $P --cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --sparse minference --out "$R/minference_128k.json"
T=60 step $P --cp-strategy dense --lengths 524288 --warmup 0 --repeats 1 --sparse minference --out "$R/minference_512k.json"
T=60 step $P --cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --sparse minference --sparse-config $MI --out "$R/minference_searched_128k.json"
T=60 step $P --cp-strategy dense --lengths 524288 --warmup 0 --repeats 1 --sparse minference --sparse-config $MI --out "$R/minference_searched_512k.json"
S="$P --lengths 524288 --warmup 0 --repeats 1"
for cp in "star --num-blocks 4" "apb --apb-hosts 4"; do
  n=${cp%% *}4
  T=60 step $S --cp-strategy $cp --out "$R/${n}_512k.json"
  T=60 step $S --cp-strategy $cp --sparse minference --out "$R/${n}_minference_512k.json"
done
cp "$LOG" $R/; cd $OUT && tar czf rest.tgz rest && rm -rf rest
grep -h '"prefill_seconds"' "$LOG" | cut -c1-200
