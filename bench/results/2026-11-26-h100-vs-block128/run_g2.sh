#!/bin/bash
# Call G2 (warm after G1): carry the second third of the SmolLM2 GGUF (.smol3/part_ab), kept in /tmp for G3.
LOG=run_g2.log; source bench/gpu_env.sh
keep_smol_part
