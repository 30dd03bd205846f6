#!/bin/bash
# Call P3: PDL only while capturing CUDA graphs (eager launches stay plain: P1 / P2 showed eager decode
# slower with PDL launches). Off / on, same machine: Llama-3.1-8B shape greedy tokens and decode ms (8K
# random-token prompt, 64 steps, eager and graphs); Qwen3-30B-A3B-shaped decode step at 4K / 32K; the
# Llama-8B --fp8 linear,kv 128K prefill (warm-up 1) + 128 CUDA-graph decode steps.
LOG=run_p3.log; source bench/gpu_env.sh
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=200 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 8000 --steps 64
done
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=200 step python3 $M --out "$OUT/p3_moe_pdl$pdl.json"
done
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=200 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 \
    --repeats 1 --decode-steps 128 --fp8 linear,kv --out $OUT/p3_l8b_fp8_128k_pdl$pdl.json
done
grep -h "Traceback\|Error" "$LOG" | head -10
LOG="$LOG" python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
runs = [json.loads(x) for x in open(os.environ["LOG"]) if x.startswith('{"model"')]
for r in runs:
    print({k: v for k, v in r.items() if not k.startswith("tokens")})
if len(runs) == 2:
    print("tokens equal PDL off / on (graphs):", runs[0]["tokens_graphs_True"] == runs[1]["tokens_graphs_True"],
          "(eager):", runs[0]["tokens_graphs_False"] == runs[1]["tokens_graphs_False"])
for f in sorted(glob.glob(os.environ["OUT"] + "/p3_moe_pdl*.json")):
    for r in json.load(open(f))["decode"]:
        print(os.path.basename(f), r["context"], "ms", round(1e3 * r["step_seconds"], 3), "x bound", round(r["measured_over_bytes_bound"], 2))
for f in sorted(glob.glob(os.environ["OUT"] + "/p3_l8b_fp8_128k_pdl*.json")):
    for x in json.load(open(f))["results"]:
        print(os.path.basename(f), x["length"], "prefill", round(x["prefill_seconds"], 3), "decode", x.get("decode"))
PY
