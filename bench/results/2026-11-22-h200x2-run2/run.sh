#!/usr/bin/env bash
# Ran as bench/run_gpu2.sh with the code at commit 53d4bfe; run it from the repo root (it sources bench/gpu_env.sh).
# Second 2 x H200 call: dense 1-GPU prefill/decode after the decode/elementwise fixes, the HF peer
# re-measured in the same run, Star at 128K with 32K blocks, exact CP decode; results under $OUT.
LOG=run2.log; source bench/gpu_env.sh
T=60 step python3 - <<'PY'
import torch
q = torch.randn(1, 32, 4096, 128, dtype=torch.bfloat16, device="cuda")
k = torch.randn(1, 8, 4096, 128, dtype=torch.bfloat16, device="cuda")
v = torch.randn_like(k)
try:
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    print("cudnn native GQA: ran, rel err", ((r[0].float() - ref.float()).norm() / ref.float().norm()).item())
except Exception as e:
    print("cudnn native GQA: refused:", type(e).__name__, str(e)[:200])
PY
T=150 step python3 launch/gpu_check.py
T=200 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192,32768,65536,131072 --decode-steps 32 --out "$OUT/prefill_dense_1gpu.json"
T=150 step python3 launch/bench.py hf --lengths 8192,32768,65536 --out "$OUT/prefill_hf_1gpu.json"
T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy star --block-size 32768 \
  --lengths 131072 --decode-steps 32 --out "$OUT/prefill_star_cp2_block32k.json"
T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --lengths 131072 \
  --decode-steps 32 --out "$OUT/prefill_ring_cp2.json"
grep -h '"ok": false' "$LOG" | head -20
grep -h "cudnn native" "$LOG"
tail -c 2500 "$LOG"
