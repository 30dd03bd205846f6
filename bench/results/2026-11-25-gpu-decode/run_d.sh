#!/bin/bash
# Device call D (carry .whl and .old_head = 7f7a98c's starshard + launch): after the model's projections
# became engine/linear.py Linear (16-bit decode rows on CUDA through kernels/gemv.py, the residual in its
# epilogue): (1) the CUDA checks of the GEMV path against F.linear; (2) Llama-3.1-8B shape, 128K prefill
# (warm-up 1) + 64 CUDA-graph decode steps, bf16 and --fp8 linear,kv, old tree then this one; (3) the
# Qwen3-30B-A3B-shaped MoE decode at 4K / 32K, old then new. (bf16_gemv_probe.json: an earlier call on the
# same day, `python bench/bf16_gemv_probe.py`, cuBLAS vs the GEMV tiles per shape.)
LOG=run_d.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$LOG"
T=120 step python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py -k cuda
T=60 step python3 - <<'PY'
import torch, torch.nn.functional as F
from starshard.engine.linear import Linear, project_add
torch.manual_seed(0)
for N, K in [(5120, 2048), (151936, 2048), (6144, 4096), (4096, 14336)]:
    lin = Linear(K, N, bias=False).cuda().to(torch.bfloat16)
    x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(1, 1, N, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), lin.weight.float())
    y = lin(x)
    print("gemv", N, K, "rel err vs float32", ((y.float() - ref).norm() / ref.norm()).item(),
          "cuBLAS", ((F.linear(x, lin.weight).float() - ref).norm() / ref.norm()).item(),
          "residual equal", torch.equal(project_add(lin, x, r), y + r))
PY
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 --decode-steps 64"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for tree in old new; do
  dir=.; [ $tree = old ] && dir=.old_head
  (cd $dir && export PYTHONPATH=/tmp/site:$PWD && T=150 step python3 $M --out "$OUT/moe_${tree}_d.json")
done
for f in none linear,kv; do
  for tree in old new; do
    dir=.; [ $tree = old ] && dir=.old_head
    (cd $dir && export PYTHONPATH=/tmp/site:$PWD && T=150 step python3 $P --fp8 $f --out "$OUT/l8b_${tree}_${f/,/_}_d.json")
  done
done
grep -h "Traceback\|Error\|passed\|failed\|^gemv" "$LOG" | head -12
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/l8b_*_d.json")):
    x = json.load(open(f))["results"][0]
    print(os.path.basename(f), "prefill", round(x["prefill_seconds"], 3), "decode ms", round(1e3 * x["decode"]["step_seconds"], 3))
for f in sorted(glob.glob(os.environ["OUT"] + "/moe_*_d.json")):
    for r in json.load(open(f))["decode"]:
        print(os.path.basename(f), r["context"], "ms", round(1e3 * r["step_seconds"], 3))
PY
