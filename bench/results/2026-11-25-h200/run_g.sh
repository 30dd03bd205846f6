#!/bin/bash
# Device call G (one H200): first half of the SmolLM2 GGUF to /tmp/smol (for call H), then issue 19 item 2:
# FP8 checkpoint disk bytes, load time and bit identity (bench/fp8_checkpoint.py, as
# 2026-11-23-h200-fp8-checkpoint/run.sh; its first try, call 7 of this session, stopped in the converter:
# the random HF dir's config had no model_type, which transformers 5.17's tokenizer lookup needs).
# Carries only .smol/part_aa (with .whl the tree passes the 64 MiB carry limit); nothing here imports
# megatron-core, so bench/gpu_env.sh's wheel install is replaced by its other settings.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/run_g.log
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; timeout "${T:-300}" "$@" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"; }
mkdir -p /tmp/smol && cp .smol/part_aa /tmp/smol/
df -h /tmp | tee -a "$LOG"
T=540 step python3 bench/fp8_checkpoint.py --preset llama-3.1-8b --work /tmp/fp8ckpt --out "$OUT/fp8_checkpoint.json"
grep -h "Traceback\|Error" "$LOG" | head
cat "$OUT/fp8_checkpoint.json" | tee -a "$LOG"
rm -rf /tmp/fp8ckpt
