import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
from starshard.kernels.flash import flash_attention
bf = torch.bfloat16
def cache(n, hkv, cap=None, dt=bf):
    cap = cap or n
    return torch.empty(1, cap, hkv, 128, dtype=dt).permute(0, 2, 1, 3)[:, :, :n]
only = sys.argv[1:]  # filters
for model, H, Hkv in (("llama", 32, 8), ("qwen", 12, 2)):
    for Lq, Lk in ((4096, 8192), (4099, 4099)):
        q = torch.empty(1, H, Lq, 128, dtype=bf)
        k, v = cache(Lk, Hkv, Lk + 64), cache(Lk, Hkv, Lk + 64)
        qp = torch.arange(Lk - Lq, Lk); kp = torch.arange(Lk)
        for tag, kw in (("causal", dict(causal=True)), ("full", dict(causal=False)),
                        ("causal tma", dict(causal=True, tma=True)),
                        ("window", dict(causal=True, window=1024)), ("softcap", dict(causal=True, softcap=50.0)),
                        ("sinks", dict(causal=True, sinks=torch.zeros(H)))):
            if only and not any(o in tag for o in only): continue
            attempt(f"flash {model} {Lq}x{Lk} {tag}", flash_attention, q, k, v, q_pos=qp, k_pos=kp, **kw)
    # TMA needs contiguous K/V: head-major contiguous copy
    if not only or "tma" in only:
        kc = torch.empty(1, Hkv, 8192, 128, dtype=bf)
        attempt(f"flash {model} contigKV tma", flash_attention, torch.empty(1, H, 4096, 128, dtype=bf), kc, kc,
                q_pos=torch.arange(4096, 8192), k_pos=torch.arange(8192), causal=True, tma=True)
