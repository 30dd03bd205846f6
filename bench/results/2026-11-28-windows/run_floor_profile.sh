# call E (the host of call D, warm; the JSON are e_*): issue 38's sparse floor. AnchorAttention on SmolLM2 at 128K measured 0.936x
# dense with every call sent dense by the per-call floor (2026-11-28-windows, run_sparse_floor.sh): where do its
# ~3 ms per call go? Profiles of dense and anchor (kernels, idle gaps, host ops), then the floor with 1, 2 and 4
# sampled groups, side by side with dense.
LOG=run_floor_profile.log; source bench/gpu_env.sh
if [ ! -f "$SMOL/config.json" ]; then
  cat /tmp/smol/smolpart_aa .s2/smolpart_ab > /tmp/smol/smol.gguf
  echo "$SMOL_SHA  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32 || exit 1
fi
essay
P="python3 bench/profile_prefill.py --model $SMOL --prompt-file /tmp/essay.txt --prompt-len 131072 --repeats 3 --gaps 10 --host 20"
$P --out $OUT/prof_dense.json 2>&1 | grep -v "Warn\|warn" | head -12
$P --sparse anchor --out $OUT/prof_anchor.json 2>&1 | grep -v "Warn\|warn" | head -70
B="python3 launch/bench.py prefill --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=150 step $B --out "$OUT/floor_dense.json"
for n in 1 2 4; do T=150 step $B --sparse anchor --sparse-fallback-sample $n --out "$OUT/floor_anchor_s$n.json"; done
T=150 step $B --out "$OUT/floor_dense_after.json"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
r = lambda n: json.load(open(os.path.join(out, f"floor_{n}.json")))["results"][0]
d = min(r("dense")["prefill_seconds"], r("dense_after")["prefill_seconds"])
print(f"dense {r('dense')['prefill_seconds']:.3f} / {r('dense_after')['prefill_seconds']:.3f} s")
for n in (1, 2, 4):
    x = r(f"anchor_s{n}"); rep = x.get("sparse_report") or {}
    print(f"anchor sample {n}: {x['prefill_seconds']:.3f} s {d / x['prefill_seconds']:.3f}x dense, fallen back {rep.get('calls_fallen_back')} of {rep.get('calls')}")
PY
