#!/usr/bin/env bash
# The service benchmark on this project's CPU machine (2 cores, float32), the embedded SmolLM2-135M-Instruct,
# random token ids, nothing else running.
OMP_NUM_THREADS=2 python launch/bench.py serve --device cpu --lengths 2048,8000 --concurrency 1,4,16 \
    --decode-tokens 16 --cache-gib 2 --out bench/results/2026-11-23-cpu-serve-smollm2/serve_smollm2_cpu.json
