#!/usr/bin/env bash
# One H200 (device tool, nvidia-h200), 2026-11-23, Llama-3.1-8B shape with random bf16 weights: issue 19,
# FP8 on Hopper. --fp8 linear = e4m3 projection weights with per-output-channel scales (FP8 GEMM via
# torch._scaled_mm in prefill with per-row activation scales from one Triton pass; a Triton
# weight-only kernel for <= 64 rows); --fp8 kv = e4m3 KV cache with one scale per (KV head, token),
# read by the split-KV decode kernel in e4m3.
#  1. bench/fp8_probe.py: kernels against float64 and bf16 (row quantization, fp8_linear at 1-32K rows
#     on the four projection shapes, e4m3 decode attention at 128K keys), per-layer output error of
#     one decoder layer (bf16 vs --fp8 linear);
#  2. end-to-end prefill at 8K, 32K, 128K (a first 8K row warms the process up) and 16 decode steps
#     after each prefill (CUDA graphs), for bf16, --fp8 linear, --fp8 kv, --fp8 linear,kv;
#  3. bench/fp8_tune.py: the decode kernels timed from CUDA graphs (the weight-only linear at 1 and 16
#     rows vs bf16 F.linear; e4m3 split-KV decode at 128K over block sizes and split counts).
# Targets (issue 19): prefill >= 1.4x bf16 at 8K and >= 1.15x at 128K with linear,kv; decode at 128K
# <= 6.0 ms/step with linear,kv (bf16 10.15 ms).
# QUICK=1: the probe's short version and 8K only (a first check of the kernels); CONFIGS="linear,kv"
# runs only the listed --fp8 settings (none = bf16).
# Run from the repo root with the megatron-core wheel in .whl (carried): bash bench/results/2026-11-23-h200-fp8/run.sh
LOG=run.log; source bench/gpu_env.sh
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 2 --decode-steps 16"
LENGTHS=8192,8192,32768,131072
PROBE=""
if [ "${QUICK:-0}" = 1 ]; then LENGTHS=8192,8192; PROBE=--quick; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
T=200 step python3 bench/fp8_probe.py $PROBE --out "$OUT/probe.json"
for f in ${CONFIGS:-none linear kv linear,kv}; do
  T=240 step python3 $P --lengths $LENGTHS --fp8 $f --out "$OUT/prefill_${f/,/_}.json"
done
T=150 step python3 bench/fp8_tune.py --out "$OUT/tune.json"
grep -h "Traceback\|Error" "$LOG" | head
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys, pathlib
rows = {}
for f in ["none", "linear", "kv", "linear_kv"]:
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
