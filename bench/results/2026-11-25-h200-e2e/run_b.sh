#!/bin/bash
# Device call B (one H200, warm after A; carry .whl and .smol3/part_ab): the GGUF's second third into /tmp.
LOG=run_b.log; source bench/gpu_env.sh
mkdir -p /tmp/smol && cp .smol3/part_ab /tmp/smol/ && ls -la /tmp/smol | tee -a "$LOG"
