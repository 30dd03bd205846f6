#!/bin/bash
# Call C1 (carries the SmolLM2 GGUF's first two thirds; .whl is still on the warm machine from call B).
LOG=run_c1.log; source bench/gpu_env.sh; keep_smol_part
