#!/usr/bin/env bash
# One H200 (device tool, nvidia-h200), bf16, Llama-3.1-8B shape with random weights: issue 19 item 2,
# "the converter can write FP8 checkpoints (half the disk and load time)". bench/fp8_checkpoint.py writes
# a random-weight HF dir (16 GB), converts it twice (bf16, --fp8 linear), loads each twice with
# --fp8 linear (bf16: quantized at load time by the Triton kernel; fp8: e4m3 read as stored) and checks
# that the two give the same tensors bit for bit. Expected: disk 16.06 GB -> 9.09 GB (planner counts,
# tests/test_fp8_checkpoint.py), ~41 GB of scratch under /tmp, ~6-9 minutes in all.
# Run from the repo root with the megatron-core wheel in .whl (carried): bash bench/results/2026-11-23-h200-fp8-checkpoint/run.sh
LOG=run.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
df -h /tmp | tee -a "$LOG"
T=570 step python3 bench/fp8_checkpoint.py --preset llama-3.1-8b --work /tmp/fp8ckpt --out "$OUT/fp8_checkpoint.json"
grep -h "Traceback\|Error" "$LOG" | head
cat "$OUT/fp8_checkpoint.json"
rm -rf /tmp/fp8ckpt
