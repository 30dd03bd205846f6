#!/bin/bash
# FP8 decode: the e4m3 GEMV applies its projection's RMSNorm / silu-mul itself (kernels/gemv.py norm_weight,
# silu_mul; parallel/fp8.py Fp8Linear.gemv_forward): three launches fewer per layer. .base = 2266bf1.
# 1) the kernel on CUDA against the separate launches (bf16); 2) dump_logits --fp8 linear,kv under both trees
# (16 greedy tokens; decode takes the new path); 3) Llama-3.1-8B shape, random weights, 128K prompt, 128
# CUDA-graph decode steps with --fp8 linear,kv, trees alternated.
LOG=run_a.log; source bench/gpu_env.sh; mkdir -p /tmp/ab /tmp/dl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import torch
from starshard.kernels.fp8 import quantize_rows, gemv_tile_for
from starshard.kernels.gemv import gemv
from starshard.kernels.norm import rms_norm
from starshard.kernels.activation import silu_mul
from starshard.benchmarks.common import graph_time_us
g = torch.Generator(device="cuda").manual_seed(0)
for N, K in ((6144, 4096), (28672, 4096), (4096, 14336)):
    w8, s = quantize_rows(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5)
    t = gemv_tile_for(N, K)
    if K == 4096:
        x = torch.randn(1, K, device="cuda", generator=g).bfloat16() * 3
        nw = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16()
        sep = lambda: gemv(rms_norm(x, nw, 1e-5), w8, s, tile=t)
        fused = lambda: gemv(x, w8, s, tile=t, norm_weight=nw, eps=1e-5)
    else:
        x = torch.randn(1, 2 * K, device="cuda", generator=g).bfloat16() * 2
        sep = lambda: gemv(silu_mul(x), w8, s, tile=t)
        fused = lambda: gemv(x, w8, s, tile=t, silu_mul=True)
    a, b = sep().float(), fused().float()
    print(dict(N=N, K=K, rel_diff=((a - b).norm() / a.norm()).item(), equal_share=(a == b).float().mean().item(),
               separate_us=graph_time_us(sep), fused_us=graph_time_us(fused)))
PY
PYTHONPATH=/tmp/site:$PWD/.base T=120 step python3 .base/dump_logits.py --fp8 linear,kv --new-tokens 32 --out /tmp/dl/base.pt
T=120 step python3 bench/dump_logits.py --fp8 linear,kv --new-tokens 32 --out /tmp/dl/new.pt
T=60 step python3 bench/dump_logits.py --compare /tmp/dl/base.pt /tmp/dl/new.pt
W="--cp-strategy dense --lengths 131072 --warmup 0 --repeats 1 --decode-steps 128 --fp8 linear,kv"
run() {  # tree name
  local tree=$1 name=$2
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  PYTHONPATH=/tmp/site:$ROOT T=150 step python3 $ROOT/launch/bench.py prefill $L8B $W --out /tmp/ab/${name}_${tree}.json
}
run base a; run new a; run new b; run base b
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
d = {p.split("/")[-1][:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/ab/*.json"))}
json.dump(d, open(os.environ["OUT"] + "/decode_ab.json", "w"))
for k, v in d.items():
    r = v["results"][0]
    print(k, v["device"], r["prefill_seconds"], json.dumps(r["decode"])[:300])
PY
grep -h "Traceback\|Error\|equal" "$LOG" | head
