#!/bin/bash
# Call B (warm after A): carry the second third of the SmolLM2 GGUF (.smol3/part_ab).
LOG=run_b.log; source bench/gpu_env.sh
keep_smol_part
