# Code 86dceff, measured in h100-b/: the decode step at 128K against its bytes bound with an e4m3 KV cache, and where a
# replayed step's device time goes (kernels per step, bf16 and --fp8 kv).
. bench/results/2026-12-06-step-loop/prelude.sh
timeout 70 $NEW -m starshard bench prefill $L8B --fp8 kv --lengths 131072 --decode-steps 32 --repeats 1 --out $OUT/prefill_fp8kv.json; t prefill_fp8kv
timeout 60 $NEW bench/results/2026-12-06-step-loop/profile_decode.py --length 131072 --out $OUT/prof_bf16.json; t prof_bf16
timeout 60 $NEW bench/results/2026-12-06-step-loop/profile_decode.py --length 131072 --fp8 kv --out $OUT/prof_fp8kv.json; t prof_fp8kv
