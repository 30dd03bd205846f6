#!/bin/bash
# AnchorAttention calibrated at recall 0.99 on SmolLM2-135M real weights at 32K and 128K sample prompts (the
# CPU study 2026-11-26-cpu-anchor-length went to 16K and extrapolated), then 128K essay prefill: dense,
# MInference recall-0.99 (bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json) and
# AnchorAttention with the 128K-calibrated file. After two calls that carry the GGUF's first thirds
# (keep_smol_part); this call carries the last.
LOG=run_a.log; source bench/gpu_env.sh; smol_model || exit 1; essay
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
D=bench/results/2026-11-26-gpu-anchor-128k
for L in 32768 131072; do
  T=240 step python3 -m starshard.tools.anchor_calibrate --model "$SMOL" --length $L --samples 1 --target-recall 0.99 \
    --device cuda --quiet --out "$OUT/anchor_r99_$L.json"
done
python3 bench/results/2026-11-26-cpu-anchor-length/summarize.py "$OUT"/anchor_r99_*.json | tee -a "$LOG" > "$OUT/summary.jsonl"
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=90 step $P --out "$OUT/dense_128k.json"
T=120 step $P --sparse minference --sparse-config $D/smollm2_minference_8k_recall99.json --out "$OUT/mi_r99_128k.json"
T=150 step $P --sparse anchor --sparse-config "$OUT/anchor_r99_131072.json" --out "$OUT/anchor_r99at128k_128k.json"
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for p in sorted(glob.glob(os.environ["OUT"] + "/*_128k.json")):
    d = json.load(open(p)); r = d["results"][0]
    print(p.rsplit("/", 1)[-1], r["prefill_seconds"], r["all_seconds"], {k: r[k] for k in r if "sparse" in k})
PY
