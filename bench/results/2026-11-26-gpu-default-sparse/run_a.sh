#!/bin/bash
# Call A (warm machine kept for C): carry the first third of the SmolLM2 GGUF (.smol3/part_aa) and .whl.
LOG=run_a.log; source bench/gpu_env.sh
keep_smol_part
