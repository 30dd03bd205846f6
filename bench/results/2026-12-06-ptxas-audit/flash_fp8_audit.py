import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
from starshard.kernels.flash_fp8 import flash_fp8_attention, quantize_keys
bf = torch.bfloat16
for model, H, Hkv in (("llama", 32, 8), ("qwen", 12, 2)):
    for L in (4096, 4099):
        q = torch.empty(1, H, L, 128, dtype=bf)               # rope_qk output: contiguous head-major
        k = torch.empty(1, Hkv, L, 128, dtype=bf)
        qkv = torch.empty(1, L, (H + 2 * Hkv) * 128, dtype=bf)
        v = qkv[..., (H + Hkv) * 128:].view(1, L, Hkv, 128).transpose(1, 2)  # projection layout (strided)
        attempt(f"fp8quant {model} L{L}", quantize_keys, k, use_triton=True)
        keys = quantize_keys(k, use_triton=False)
        for tma in (True, False):
            attempt(f"flash_fp8 {model} L{L} tma={tma}", flash_fp8_attention, q, k, v, keys=keys, tma=tma)
