#!/bin/bash
# Device call F (one H200, carry .whl and .smol3/part_aa or part_ab, PART=aa|ab): a third of the SmolLM2 GGUF
# into /tmp (the machine of calls C-D was given back before call E could run).
LOG=run_f_${PART}.log; source bench/gpu_env.sh
mkdir -p /tmp/smol && cp .smol3/part_$PART /tmp/smol/ && ls -la /tmp/smol | tee -a "$LOG"
