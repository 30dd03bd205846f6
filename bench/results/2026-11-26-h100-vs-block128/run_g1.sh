#!/bin/bash
# Call G1 (warm machine): carry the first third of the SmolLM2 GGUF (.smol3/part_aa), kept in /tmp for G3.
LOG=run_g1.log; source bench/gpu_env.sh
keep_smol_part
