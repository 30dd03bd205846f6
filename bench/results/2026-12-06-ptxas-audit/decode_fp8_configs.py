"""fp8 decode alternatives: which (BLOCK_N, warps, stages) avoid the spills (Llama-8B heads, e4m3 token-major cache)."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
from starshard.kernels.decode import decode_attention
bf, f8 = torch.bfloat16, torch.float8_e4m3fn
H, Hkv, cap = 32, 8, 4096
k = torch.empty(1, cap, Hkv, 128, dtype=f8).permute(0, 2, 1, 3); v = torch.empty_like(k)
ks, vs = torch.empty(1, Hkv, cap), torch.empty(1, Hkv, cap); L = torch.tensor([4000], dtype=torch.int32)
kp = torch.arange(cap)
for Lq in (1, 16):
    q = torch.empty(1, H, Lq, 128, dtype=bf); qp = torch.arange(4000 - Lq, 4000)
    for cfg in [(128, 4, 3), (64, 4, 3), (128, 4, 2), (128, 8, 3), (64, 4, 4), (32, 4, 3)]:
        for causal, even in ((True, True), (False, True)):
            attempt(f"dec8 Lq{Lq} c={causal} even={even} cfg{cfg}", decode_attention, q, k, v, q_pos=qp, k_pos=kp,
                    causal=causal, use_triton=True, length=L, k_scale=ks, v_scale=vs, options={"even": even, "config": cfg},
                    config=cfg)
