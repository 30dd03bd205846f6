#!/usr/bin/env bash
# One H200 (device tool, nvidia-h200), 2026-11-24: this session's kernels, then end-to-end.
#  1. bench/rope_bench.py: fused (q/k norm +) RoPE vs the torch path, decode and prefill shapes;
#  2. bench/fp8_prefill_fused.py: one Llama-8B layer's projections, bf16 vs FP8 (separate quantization
#     pass) vs FP8 with the quantization fused into RMSNorm / SiLU-mul, 8K and 32K rows;
#  3. tests/test_fp8_prefix_attention.py on CUDA (the e4m3-prefix flash kernel, its memory check);
#  4. bench/moe_decode_fused.py: one Qwen3-MoE layer's decode expert side, before / after the fused routing;
#  5. launch/bench.py prefill, Llama-3.1-8B shape, random weights: bf16 vs --fp8 linear,kv at 8K (twice:
#     the first row warms up), 32K, 128K, with 16 CUDA-graph decode steps after each prefill.
# Run from the repo root with the megatron-core wheel in .whl (carried).
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
git log -1 --format=%H 2>/dev/null | tee -a "$LOG"
T=90 step python3 bench/rope_bench.py --out "$OUT/rope.json"
T=90 step python3 bench/fp8_prefill_fused.py --out "$OUT/fp8_prefill_fused.json"
T=120 step python3 -m pytest -q -x tests/test_fp8_prefix_attention.py
T=90 step python3 bench/moe_decode_fused.py --out "$OUT/moe_decode_fused.json"
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 2 --decode-steps 16"
for f in none linear,kv; do
  T=200 step python3 $P --lengths 8192,8192,32768,131072 --fp8 $f --out "$OUT/prefill_${f/,/_}.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys, pathlib
rows = {}
for f in ["none", "linear_kv"]:
    p = pathlib.Path(sys.argv[1]) / f"prefill_{f}.json"
    if p.exists():
        rows[f] = {r["length"]: r for r in json.loads(p.read_text())["results"] if "prefill_seconds" in r}
base = rows.get("none", {})
for f, by in rows.items():
    for L, r in sorted(by.items()):
        b = base.get(L)
        d = (r.get("decode") or {}).get("step_seconds")
        bd = ((b or {}).get("decode") or {}).get("step_seconds")
        print(f"{f:>10} {L:>7}: prefill {r['prefill_seconds']:.3f} s ({b['prefill_seconds'] / r['prefill_seconds'] if b else 0:.2f}x bf16)"
              f"  decode {1e3 * d if d else 0:.2f} ms/step ({bd / d if d and bd else 0:.2f}x)  peak {r.get('peak_memory_gib') or 0:.1f} GiB")
PY
