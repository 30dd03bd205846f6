#!/bin/bash
# Call P4: check_graph_decode's graph timing includes one-time costs of the measured run (captures for
# the 8K prompt's cache, and with PDL on the first compile of the PDL kernel variants, which the eager
# warm-up no longer compiles): the same check with 512 steps, off / on, so they amortize.
LOG=run_p4.log; source bench/gpu_env.sh
for pdl in 0 1; do
  STARSHARD_PDL=$pdl T=250 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 8000 --steps 512
done
LOG="$LOG" python3 - <<'PY' | tee -a "$LOG"
import json, os
runs = [json.loads(x) for x in open(os.environ["LOG"]) if x.startswith('{"model"')]
for r in runs:
    print({k: v for k, v in r.items() if not k.startswith("tokens")})
if len(runs) == 2:
    print("tokens equal PDL off / on (graphs):", runs[0]["tokens_graphs_True"] == runs[1]["tokens_graphs_True"],
          "(eager):", runs[0]["tokens_graphs_False"] == runs[1]["tokens_graphs_False"])
PY
