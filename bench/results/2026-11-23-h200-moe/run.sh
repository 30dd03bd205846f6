#!/usr/bin/env bash
# One H200 (device tool, nvidia-h200), bf16, Qwen3-30B-A3B shape (preset qwen3-30b-a3b: 48 layers,
# 128 experts of width 768, 8 per token) with random weights: issue 20's MoE speed targets.
#  1. launch/bench.py moe (starshard/benchmarks/moe.py): prefill at 32K, starshard vs transformers'
#     Qwen3MoeForCausalLM holding the same random tensors (SDPA, its own experts implementation,
#     logits_to_keep=1; one model on the GPU at a time); decode step at 4K and 32K context (CUDA
#     graph) with the bytes it reads (attention + routers + 8 active experts per layer + one
#     embedding row + LM head, + KV) against 4.8e12 B/s. Targets: speedup_vs_hf > 1 at 32K;
#     measured_over_bytes_bound <= 1.5 in every decode row.
#  2. the same decode steps eagerly (no CUDA graph), starshard only: how much of a step is host time.
# Expected: ~2 min for 1 (two 61 GB models built in turn), ~1 min for 2; under 6 min in all.
# Run from the repo root with the megatron-core wheel in .whl (carried): bash bench/results/2026-11-23-h200-moe/run.sh
LOG=run.log; source bench/gpu_env.sh
B="launch/bench.py moe --random-weights qwen3-30b-a3b"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
T=270 step python3 $B --prefill-lengths 32768 --decode-contexts 4096,32768 --repeats 3 --decode-steps 32 --out "$OUT/moe.json"
T=120 step python3 $B --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32 --no-cuda-graphs --out "$OUT/moe_eager_decode.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"prefill_seconds"\|"step_seconds"\|speedup_vs_hf\|measured_over_bytes_bound\|experts_implementation' "$LOG" | cut -c1-300
