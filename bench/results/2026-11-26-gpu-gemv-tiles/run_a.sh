#!/bin/bash
# The one-row bf16 GEMV (kernels/gemv.py, the decode path of 16-bit projections) over wider tiles than the
# 2026-11-25 probe: whole-row K tiles (all of a program's weight bytes requested at once) at the Qwen3-30B-A3B and
# Llama-8B decode shapes, against cuBLAS; CUDA graph, each call reading its weight from HBM. Random weights.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=300 step python3 bench/bf16_gemv_probe.py --out "$OUT/gemv_tiles.json" \
  --shapes qwen3moe.wqkv,qwen3moe.wo,qwen3moe.router,qwen3moe.lm_head,llama8b.wqkv,llama8b.wo,llama8b.w13,llama8b.w2 \
  --tiles 4x1024x4,4x2048x4,4x4096x4,4x4096x8,2x2048x2,2x4096x4,8x2048x8,8x4096x8,1x4096x4,2x1024x2
grep -h "Traceback\|Error" "$LOG" | head
