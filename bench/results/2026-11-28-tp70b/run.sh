# Issue 39's four-GPU part (4 x H200): the 70B shape (random weights) at 128K, tp=4 and tp=2 x cp=2 ring, bf16
# and --fp8 linear,kv (Star tp=2 x cp=2 fp8 only if time is left), each with its memory plan; every run
# measures its GEMM / attention / all-reduce rates in its own process (benchmarks/rates.py) and reports
# measured / FLOP model (`measured_over_flop_model`). Budget: under 9 minutes (timeouts below).
# Expected per run: ~25 s start (torchrun, NCCL, random weights made on each GPU, FP8 quantization) + 2 x the
# 128K prefill (one warm-up, one timed; tp=4 bf16 ~17 s each: 1.8e16 linear + 2.25e16 attention FLOPs / 4
# ranks at ~750 / ~550 TFLOP/s, + 344 GB all-reduced per rank) + probes and 8 decode steps ~5 s => ~65-75 s.
. bench/results/2026-11-28-group-service/prelude.sh
P70="--random-weights llama-3.1-70b --lengths 131072 --decode-steps 8"
RUNF="--warmup 1 --repeats 1"
LAYOUTS=(
  "tp4_bf16|4|--tp 4 --cp-strategy dense"
  "tp4_fp8|4|--tp 4 --cp-strategy dense --fp8 linear,kv"
  "tp2cp2_ring_bf16|4|--tp 2 --cp 2 --cp-strategy ring"
  "tp2cp2_ring_fp8|4|--tp 2 --cp 2 --cp-strategy ring --fp8 linear,kv"
  "tp2cp2_star_fp8|4|--tp 2 --cp 2 --cp-strategy star --fp8 linear,kv"
)
# the memory plans first (nothing loaded): against an 80 GB card (72 GiB usable) and against this GPU
for row in "${LAYOUTS[@]}"; do
  IFS='|' read -r name n flags <<< "$row"
  timeout 30 python3 launch/bench.py prefill $P70 $flags --plan-only --memory-limit-gb 72 --device cpu \
    --out $OUT/plan80_$name.json > /dev/null 2>> $OUT/all.log
done
t plans
for row in "${LAYOUTS[@]}"; do
  IFS='|' read -r name n flags <<< "$row"
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi  # ONLY="name name": those layouts alone
  if [ "$name" = tp2cp2_star_fp8 ] && [ $(( $(date +%s)-S )) -gt 380 ]; then echo "skip $name (time)"; continue; fi
  timeout -k 10 120 torchrun --standalone --nproc-per-node $n launch/bench.py prefill $P70 $RUNF $flags \
    --out $OUT/$name.json >> $OUT/all.log 2>&1; t $name
done
grep -h "Traceback\|Error\|error:" $OUT/all.log | head -20
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'layout':18} {'plan GiB':>8} {'80GB':>5} {'meas s':>7} {'model s':>7} {'ratio':>6} {'gemm':>5} {'attn':>5} {'ar':>5} "
      f"{'GEMM TF':>7} {'attn TF':>7} {'AR GB/s':>7} {'peak GiB':>8} {'dec ms':>6}")
for p in sorted(out.glob("plan80_*.json")):
    name = p.stem[len("plan80_"):]
    plan = json.loads(p.read_text())["plans"][0]
    f = out / f"{name}.json"
    r = json.loads(f.read_text())["results"][0] if f.exists() else {"error": "no result"}
    head = f"{name:18} {plan['peak_bytes'] / 2**30:8.1f} {str(plan['fits']):>5}"
    if "flop_model" not in r:
        print(head, r.get("error", "?"))
        continue
    m, rt = r["flop_model"], r["flop_model"]["rates"]
    ar = rt["allreduce_bytes_per_s"]
    print(head, f"{r['prefill_seconds']:7.2f} {m['seconds']:7.2f} {r['measured_over_flop_model']:6.3f} "
          f"{m['gemm_seconds']:5.2f} {m['attention_seconds']:5.2f} {m['allreduce_seconds']:5.2f} "
          f"{rt['gemm_flops_per_s'] / 1e12:7.0f} {rt['attention_flops_per_s'] / 1e12:7.0f} "
          f"{(ar or 0) / 1e9:7.0f} {r['peak_memory_gib'] or 0:8.1f} "
          f"{1e3 * r['decode']['step_seconds'] if r.get('decode') else 0:6.2f}")
PY
t done
