"""_anchor_sparse_fwd at block_q=128 (the default AnchorConfig): which (num_warps, num_stages) avoid the spills."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
from starshard.kernels import anchor as A
A.triton_available = lambda q: True
bf = torch.bfloat16
H, Hkv, Lq, Lk = 32, 8, 4096, 8192
q = torch.empty(1, H, Lq, 128, dtype=bf); k = torch.empty(1, Lk, Hkv, 128, dtype=bf).permute(0, 2, 1, 3); v = k.clone()
cfg = A.AnchorConfig()
G = A.cdiv(A.cdiv(Lq, cfg.block_q), cfg.step); KI = A.index_capacity(cfg, Lq=Lq, Lk=Lk, offset=Lk - Lq)
index = A.StripeIndex(torch.zeros(1, H, G, KI, dtype=torch.int32), torch.zeros(1, H, G, dtype=torch.int32))
for launch in ((4, 2), (4, 1), (8, 2), (8, 3)):
    attempt(f"sparse bq128 launch{launch}", A.sparse_attention, q, k, v, index, cfg, offset=Lk - Lq, backend="triton", launch=launch)
