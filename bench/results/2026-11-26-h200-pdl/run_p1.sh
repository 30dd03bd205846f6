#!/bin/bash
# Call P1: programmatic dependent launch (kernels/pdl.py) on the decode kernels, off (STARSHARD_PDL=0) vs
# on, same machine: does this triton launch with PDL, and under CUDA graphs; the same greedy tokens
# (Llama-3.1-8B shape, random weights, 8K random-token prompt, 64 steps, eager and CUDA graphs); then
# the Qwen3-30B-A3B-shaped decode step at 4K / 32K (launch/bench.py moe, random weights).
LOG=run_p1.log; source bench/gpu_env.sh
step python3 -c "import torch, triton; from starshard.kernels.pdl import pdl_enabled; print('triton', triton.__version__, 'pdl', pdl_enabled(torch.device('cuda')))"
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=200 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 8000 --steps 64
done
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=200 step python3 $M --out "$OUT/moe_pdl$pdl.json"
done
grep -h "Traceback\|Error\|^triton" "$LOG" | head -10
LOG="$LOG" python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
runs = [json.loads(x) for x in open(os.environ["LOG"]) if x.startswith('{"model"')]
for r in runs:
    print({k: v for k, v in r.items() if not k.startswith("tokens")})
if len(runs) == 2:
    print("tokens equal PDL off / on (graphs):", runs[0]["tokens_graphs_True"] == runs[1]["tokens_graphs_True"],
          "(eager):", runs[0]["tokens_graphs_False"] == runs[1]["tokens_graphs_False"])
for f in sorted(glob.glob(os.environ["OUT"] + "/moe_pdl*.json")):
    for r in json.load(open(f))["decode"]:
        print(os.path.basename(f), r["context"], "ms", round(1e3 * r["step_seconds"], 3), "x bound", round(r["measured_over_bytes_bound"], 2))
PY
