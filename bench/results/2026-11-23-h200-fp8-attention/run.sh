#!/usr/bin/env bash
# One H200: cuDNN FP8 causal attention (nvidia-cudnn-frontend, carried as a wheel in .whl-cudnn/) vs our
# bf16 attention (torch's cuDNN kernel), Llama-3.1-8B heads (32 q / 8 kv / 128), random inputs, with lse.
# device tool: carry [".whl", ".whl-cudnn"]
LOG=run.log; source bench/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-cudnn/*.whl || exit 1
T=120 step python3 launch/bench.py fp8-attention --lengths 4096 --repeats 2 --out "$OUT/smoke.json"
T=400 step python3 launch/bench.py fp8-attention --lengths 8192,32768,65536,131072 --out "$OUT/fp8_attention.json"
T=200 step python3 launch/bench.py fp8-attention --lengths 32768,131072 --q-scale 1 --out "$OUT/fp8_attention_flat.json"
grep -h "Traceback\|Error" "$LOG" | head
tail -5 "$LOG"
