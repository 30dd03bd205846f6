#!/usr/bin/env bash
# 2 x H200 (device tool, nvidia-h200-x2), Llama-3.1-8B shape with random bf16 weights: issue 19 item 3,
# FP8 K/V on the wire. With --fp8 kv, ring / Ulysses / APB send their prefill K/V as e4m3 plus one float32
# scale per (KV head, token) (parallel/context/wire.py): 0.52x the bf16 bytes at head_dim 128 (measured on
# CPU, tests/test_fp8_wire.py). Here, per strategy at cp=2, bf16 cache vs --fp8 kv: prefill time at 32K and
# 128K (a first 32K row warms up), kv_bytes_sent per prefill (rank 0), 8 decode steps. NCCL moves the
# e4m3 bytes as uint8. Expect kv_bytes_sent(kv) / kv_bytes_sent(none) ~ 0.516 (ring, ulysses), ~0.523 (apb).
# Run from the repo root with the megatron-core wheel in .whl (carried):
#   bash bench/results/2026-11-23-h200x2-fp8-wire/run.sh      (about 8 minutes)
LOG=run.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
for s in ring ulysses apb; do
  for f in none kv; do
    T=240 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy $s --fp8 $f \
      --lengths 32768,32768,131072 --warmup 0 --repeats 2 --decode-steps 8 --out "$OUT/${s}_${f}.json"
  done
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for s in ["ring", "ulysses", "apb"]:
    rows = {}
    for f in ["none", "kv"]:
        p = out / f"{s}_{f}.json"
        if p.exists():
            rows[f] = {r["length"]: r for r in json.loads(p.read_text())["results"] if "prefill_seconds" in r}
    for L, r in sorted(rows.get("kv", {}).items()):
        b = rows.get("none", {}).get(L)
        if b is None:
            continue
        ratio = r.get("kv_bytes_sent", 0) / max(1, b.get("kv_bytes_sent", 0))
        print(f"{s:>8} {L:>7}: prefill bf16 {b['prefill_seconds']:.3f} s, fp8 kv {r['prefill_seconds']:.3f} s "
              f"({b['prefill_seconds'] / r['prefill_seconds']:.2f}x); K/V sent {b.get('kv_bytes_sent', 0) / 2**30:.2f} -> "
              f"{r.get('kv_bytes_sent', 0) / 2**30:.2f} GiB ({ratio:.3f}x)")
PY
