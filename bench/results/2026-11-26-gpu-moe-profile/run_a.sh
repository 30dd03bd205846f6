#!/bin/bash
# The Qwen3-30B-A3B decode step kernel by kernel on the final tree (8170716), PDL off so that each kernel's time is
# its own (with PDL a kernel's span includes its wait): 4K context, CUDA graph, 5 profiled steps. Random weights.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
STARSHARD_PDL=0 T=200 step python3 bench/profile_decode.py --random-weights qwen3-30b-a3b --prompt-len 4000 --sort cuda_time_total
STARSHARD_PDL=0 T=200 step python3 bench/profile_decode.py --random-weights llama-3.1-8b --prompt-len 8000 --sort cuda_time_total
grep -h "Traceback\|Error" "$LOG" | head
