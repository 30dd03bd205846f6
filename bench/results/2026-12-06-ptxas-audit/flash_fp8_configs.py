import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
from starshard.kernels.flash_fp8 import flash_fp8_attention, quantize_keys
bf = torch.bfloat16
H, Hkv, L = 32, 8, 4096
q = torch.empty(1, H, L, 128, dtype=bf); k = torch.empty(1, Hkv, L, 128, dtype=bf); v = torch.empty(1, Hkv, L, 128, dtype=bf)
keys = quantize_keys(k, use_triton=False)
for cfg in [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 128, 4, 3), (128,128,4,3)]:
    for tma in (True, False):
        attempt(f"flash_fp8 cfg{cfg} tma={tma}", flash_fp8_attention, q, k, v, keys=keys, tma=tma, config=cfg)
