#!/usr/bin/env bash
# Ran as bench/run_gpu.sh with the code at commit a3057bf; run it from the repo root (it sources bench/gpu_env.sh).
# One device call on 2 x H200: GPU correctness checks, then the benchmarks; results under $OUT.
# Usage (device tool, carry .whl with the megatron-core wheel): bash bench/run_gpu.sh
LOG=run.log; source bench/gpu_env.sh
nvidia-smi -L | tee -a "$LOG"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$LOG"
T=120 step torchrun --nproc-per-node 2 launch/gpu_check.py --cp
T=200 step torchrun --nproc-per-node 2 launch/bench.py attention --cp 2 --lengths 32768,65536,131072 \
  --strategies dense,sdpa-cudnn,ring,ulysses,torch-cp,torch-cp-flash --out "$OUT/attention_cp2.json"
T=200 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192,32768,65536,131072 --decode-steps 32 --out "$OUT/prefill_dense_1gpu.json"
T=150 step python3 launch/bench.py hf --lengths 8192,32768,65536 --out "$OUT/prefill_hf_1gpu.json"
for s in ring ulysses star; do
  T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy $s --lengths 32768,65536,131072 \
    --decode-steps 32 --out "$OUT/prefill_${s}_cp2.json"
done
grep -h '"ok": false' "$LOG" | head -20
tail -c 3000 "$LOG"
