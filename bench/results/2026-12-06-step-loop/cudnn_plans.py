"""The first call (plan build) and second call of torch's cuDNN SDPA on six new shapes, for each Q layout (head- or
token-major) and K/V layout (contiguous head-major, a view of a longer head-major cache as the parent had, a
token-major view as this tree has): does the build cost depend on the layout? (h100-c/cudnn.json: no, ~34.5 ms)

    python bench/results/2026-12-06-step-loop/cudnn_plans.py OUT.json
"""
import json, sys, time, torch
from starshard.kernels.attention import _fused
dev = "cuda"; Hq, Hkv, D = 32, 8, 128
def mk(layout, n, cap, H, L=None):
    if layout == "head_major":  # contiguous [1, H, n, D]
        return torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16)
    if layout == "head_major_cap":  # view of [1, H, cap, D] (the parent's cache)
        return torch.randn(1, H, cap, D, device=dev, dtype=torch.bfloat16)[:, :, :n]
    if layout == "token_major":  # view of [1, cap, H, D] as [1, H, n, D]
        return torch.randn(1, cap, H, D, device=dev, dtype=torch.bfloat16)[:, :n].transpose(1, 2)
res = {}
for qi, qlay in enumerate(["head_major", "token_major"]):
    for li, lay in enumerate(["head_major", "head_major_cap", "token_major"]):
        first, second = [], []
        for s in range(6):
            Lq = 4096 - 97 * s - 13 * (3 * qi + li); Lk = 30000 + 4096 * s + 7 * (3 * qi + li) + Lq
            q = mk(qlay, Lq, Lq + 100, Hq); k = mk(lay, Lk, Lk + 5000, Hkv); v = mk(lay, Lk, Lk + 5000, Hkv)
            torch.cuda.synchronize(); t0 = time.perf_counter(); _fused(q, k, v, causal=True, scale=None, op="cudnn"); torch.cuda.synchronize(); t1 = time.perf_counter()
            _fused(q, k, v, causal=True, scale=None, op="cudnn"); torch.cuda.synchronize(); t2 = time.perf_counter()
            first.append(t1 - t0); second.append(t2 - t1)
        res[f"q_{qlay}/kv_{lay}"] = {"first_ms": [round(1e3 * x, 1) for x in first], "second_ms": [round(1e3 * x, 1) for x in second]}
        print(f"q_{qlay}/kv_{lay}", res[f"q_{qlay}/kv_{lay}"], flush=True)
json.dump(res, open(sys.argv[1], "w"))
print(torch.__version__, torch.backends.cudnn.version())
