#!/bin/bash
# Device call H (carry .whl and .old_head = 7f7a98c): the MoE residual in the down kernel. CUDA check that
# the fused residual equals expert_down(...) + residual; then the Qwen3-30B-A3B-shaped decode step at 4K /
# 32K, old tree then this one.
LOG=run_h.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$LOG"
T=60 step python3 - <<'PY'
import torch
from starshard.kernels.moe_decode import expert_down, expert_gate_up
g = torch.Generator(device="cuda").manual_seed(0)
E, k, H, F, T = 128, 8, 2048, 768, 1
x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
w13 = (torch.randn(E, 2 * F, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
w2 = (torch.randn(E, H, F, device="cuda", generator=g) / F**0.5).to(torch.bfloat16)
e = torch.randperm(E, device="cuda", generator=g)[:k].view(1, k).int()
w = torch.softmax(torch.randn(1, k, device="cuda", generator=g), -1)
r = (10 * torch.randn(T, H, device="cuda", generator=g)).to(torch.bfloat16)
act = expert_gate_up(x, e, w13)
print("moe residual equal", torch.equal(expert_down(act, e, w, w2, residual=r), expert_down(act, e, w, w2) + r))
PY
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for tree in old new; do
  dir=.; [ $tree = old ] && dir=.old_head
  (cd $dir && export PYTHONPATH=/tmp/site:$PWD && T=150 step python3 $M --out "$OUT/moe_${tree}_h.json")
done
grep -h "Traceback\|Error\|residual equal" "$LOG" | head -5
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/moe_*_h.json")):
    for r in json.load(open(f))["decode"]:
        print(os.path.basename(f), r["context"], "ms", round(1e3 * r["step_seconds"], 3), "x bound", round(r["measured_over_bytes_bound"], 2))
PY
