#!/usr/bin/env bash
# One H200, 2026-11-24, fifth call: the decode step's KV write as one Triton launch (kernels/kv_write.py):
# (1) bench/kv_write_bench.py, 32 layers' writes from one CUDA graph, old path vs kernel, FP8 and bf16
# caches, and whether both store the same bytes; (2) CUDA-graph vs eager decode, same greedy tokens
# (8B shape, bf16); (3) prefill + 16 decode steps at 8K and 128K, bf16 and --fp8 linear,kv.
LOG=run_e.log; source bench/gpu_env.sh
T=90 step python3 bench/kv_write_bench.py --out "$OUT/kv_write.json"
T=120 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 8000 --steps 32
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 2 --decode-steps 16"
for f in none linear,kv; do
  T=150 step python3 $P --lengths 8192,8192,131072 --fp8 $f --out "$OUT/prefill_e_${f/,/_}.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys, pathlib
rows = {f: {r["length"]: r for r in json.loads((pathlib.Path(sys.argv[1]) / f"prefill_e_{f}.json").read_text())["results"]
            if "prefill_seconds" in r} for f in ["none", "linear_kv"]}
for L in sorted(rows["none"]):
    b, r = rows["none"][L], rows["linear_kv"][L]
    print(f"{L}: prefill {b['prefill_seconds']:.3f} / {r['prefill_seconds']:.3f} s ({b['prefill_seconds'] / r['prefill_seconds']:.2f}x)"
          f"  decode {1e3 * b['decode']['step_seconds']:.2f} / {1e3 * r['decode']['step_seconds']:.2f} ms")
PY
