"""AnchorAttention: anchor_scores, identify_stripes / count_stripes (per head and KV-grouped), sparse_attention."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
from starshard.kernels import anchor as A
A.triton_available = lambda q: True   # CPU tensors: compile as on CUDA
bf = torch.bfloat16
def kv(n, hkv):
    return torch.empty(1, n, hkv, 128, dtype=bf).permute(0, 2, 1, 3)
for model, H, Hkv in (("llama", 32, 8), ("qwen", 12, 2)):
    for cfg in (A.AnchorConfig(), A.AnchorConfig(block_q=64, step=4)):
        for Lq, Lk in ((4096, 8192), (4099, 8195)):
            off = Lk - Lq
            q = torch.empty(1, H, Lq, 128, dtype=bf); k = kv(Lk, Hkv); v = kv(Lk, Hkv)
            tag = f"{model} bq{cfg.block_q} {Lq}x{Lk}"
            xa = attempt(f"anchor_scores {tag}", A.anchor_scores, q, k, cfg, offset=off, backend="triton")
            xa = torch.zeros(1, H, Lq)
            for gh in (False, True):
                attempt(f"identify gh={gh} {tag}", A.identify_stripes, q, k, xa, cfg, offset=off, backend="triton", group_heads=gh)
                attempt(f"count gh={gh} {tag}", A.count_stripes, q, k, xa, cfg, offset=off, backend="triton", group_heads=gh)
            G = A.cdiv(A.cdiv(Lq, cfg.block_q), cfg.step)
            KI = A.index_capacity(cfg, Lq=Lq, Lk=Lk, offset=off)
            index = A.StripeIndex(torch.zeros(1, H, G, max(KI, 1), dtype=torch.int32)[..., :KI], torch.zeros(1, H, G, dtype=torch.int32))
            attempt(f"sparse {tag}", A.sparse_attention, q, k, v, index, cfg, offset=off, backend="triton")
