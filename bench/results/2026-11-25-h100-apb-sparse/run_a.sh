#!/bin/bash
# Device calls A and B (one GPU, warm between them; carry .whl and .smol3/part_aa, then part_ab): keep the
# carried third of the SmolLM2 GGUF in /tmp for call C (a call carries 64 MiB at most).
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
keep_smol_part
