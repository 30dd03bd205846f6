#!/usr/bin/env bash
# The standing cp = 4 task (developers' guide): run on the nvidia-h200-x4 kind whenever `status` lists it. The
# whole-model rows of docs/results.md (Context parallel strategies): Llama-3.1-8B shape, random bf16 weights (fine for
# dense and CP speed); dense on one GPU and torch context_parallel (one attention layer, 32K / 64K) as peers; each
# prefill list starts with a 128K run that warms its process (dropped by bench/cp_summary.py); 32 CUDA-graph decode
# steps per length. The kind has come as 4 x H100 every time so far (three such runs are in docs/results.md): the script
# runs only on H200s unless FORCE=1, so a probe costs the machine's start and nothing more.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || [ "${FORCE:-0}" = 1 ] || { echo "not H200s: nothing run" | tee -a "$LOG"; exit 0; }
W="--warmup 0 --repeats 1 --decode-steps 32"
T=90 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072,131072 $W --out "$OUT/dense_1gpu.json"
T=60 step torchrun --nproc-per-node 4 launch/bench.py attention --cp 4 --strategies dense,ring,ulysses,torch-cp --lengths 32768,65536 --repeats 3 --out "$OUT/attention_cp4_short.json"
T=110 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy ring --lengths 131072,131072,524288 $W --out "$OUT/ring_cp4.json"
T=110 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy ulysses --lengths 131072,131072,524288 $W --out "$OUT/ulysses_cp4.json"
T=60 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy usp --ulysses-degree 2 --lengths 131072,131072 $W --out "$OUT/usp_cp4.json"
T=90 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy star --block-size 32768 --anchor-size 32768 --lengths 131072,131072,524288 $W --out "$OUT/star_cp4.json"
T=90 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy apb --anchor-size 4096 --passing-size 2048 --lengths 131072,131072,524288 $W --out "$OUT/apb_cp4.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^{"length"' "$LOG" | cut -c1-300
