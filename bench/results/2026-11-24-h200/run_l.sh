#!/usr/bin/env bash
# One H200, 2026-11-24, twelfth call: the FP8 decode GEMV with its tile picked by weight shape
# (kernels/fp8.py gemv_tile_for, from the 2026-11-23 sweep): prefill + 16 decode steps at 8K and 128K,
# bf16 and --fp8 linear,kv.
LOG=run_l.log; source bench/gpu_env.sh
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 1 --decode-steps 16"
for f in none linear,kv; do
  T=150 step python3 $P --lengths 8192,131072 --fp8 $f --out "$OUT/prefill_l_${f/,/_}.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys, pathlib
rows = {f: {r["length"]: r for r in json.loads((pathlib.Path(sys.argv[1]) / f"prefill_l_{f}.json").read_text())["results"]
            if "prefill_seconds" in r} for f in ["none", "linear_kv"]}
for L in sorted(rows["none"]):
    b, r = rows["none"][L], rows["linear_kv"][L]
    print(f"{L}: decode {1e3 * b['decode']['step_seconds']:.2f} / {1e3 * r['decode']['step_seconds']:.2f} ms")
PY
