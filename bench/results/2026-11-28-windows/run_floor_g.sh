# call G2 (warm host of call G1, which carried the GGUF's first half to /tmp/smol): issue 38's sparse speed floor
# with the floor's sample counted by the split-key count kernel (kernels/anchor.py). SmolLM2-135M-Instruct real
# weights, 128K tokens of the essay text, bf16, warm-up 1, median of 3, side by side: dense | MInference (shipped
# recall-0.99 config) | AnchorAttention (defaults: the per-call floor on 4 sampled groups) | dense again. JSON g_*.
LOG=run_floor_g.log; source bench/gpu_env.sh
if [ ! -f "$SMOL/config.json" ]; then
  cat /tmp/smol/smolpart_aa .s2/smolpart_ab > /tmp/smol/smol.gguf
  echo "$SMOL_SHA  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32 || exit 1
fi
essay
git log -1 --format='commit %h %s' | tee -a "$LOG"
B="python3 launch/bench.py prefill --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=120 step $B --out "$OUT/g_floor_dense.json"
T=120 step $B --sparse anchor --out "$OUT/g_floor_anchor.json"
T=120 step $B --sparse minference --out "$OUT/g_floor_minference.json"
T=120 step $B --out "$OUT/g_floor_dense_after.json"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
r = lambda n: json.load(open(os.path.join(out, f"g_floor_{n}.json")))["results"][0]
d = [r("dense")["prefill_seconds"], r("dense_after")["prefill_seconds"]]
print(f"dense {d[0]:.3f} / {d[1]:.3f} s")
for n in ("anchor", "minference"):
    x = r(n); rep = x.get("sparse_report") or {}
    print(f"{n}: {x['prefill_seconds']:.3f} s, {min(d) / x['prefill_seconds']:.3f}x the faster dense "
          f"({max(d) / x['prefill_seconds']:.3f}x the slower); fallen back {rep.get('calls_fallen_back')} of {rep.get('calls')}")
PY
