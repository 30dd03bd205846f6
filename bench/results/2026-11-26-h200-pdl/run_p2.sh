#!/bin/bash
# Call P2 (warm after P1): PDL off / on, same machine: the same greedy tokens on the Qwen3-30B-A3B shape
# (random weights, 4K random-token prompt, 64 steps, eager and CUDA graphs); the Llama-3.1-8B shape with
# --fp8 linear,kv at 128K: prefill (warm-up 1) and 128 CUDA-graph decode steps (issue 19's decode target).
LOG=run_p2.log; source bench/gpu_env.sh
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=200 step python3 bench/check_graph_decode.py --random-weights qwen3-30b-a3b --prompt-len 4000 --steps 64
done
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=200 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 \
    --repeats 1 --decode-steps 128 --fp8 linear,kv --out $OUT/l8b_fp8_128k_pdl$pdl.json
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
for f in sorted(glob.glob(os.environ["OUT"] + "/l8b_fp8_128k_pdl*.json")):
    for x in json.load(open(f))["results"]:
        print(os.path.basename(f), x["length"], "prefill", round(x["prefill_seconds"], 3), "decode", x.get("decode"))
PY
