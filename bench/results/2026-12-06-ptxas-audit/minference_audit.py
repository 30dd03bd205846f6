"""MInference: estimate / runs / columns index kernels and _minference_fwd (A-shape, Vertical-Slash flat / per-run /
wide, Block-Sparse) as the CUDA dispatch launches them (Llama-8B / Qwen2.5-1.5B heads, token-major K/V)."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from harness import *  # noqa
import torch
torch.manual_seed(0)
from starshard.kernels.minference import index, plan, kernel as mk
from starshard.kernels.minference.attend import SparsePattern
from starshard.kernels.minference.patterns import AShape, VerticalSlash, BlockSparse
bf = torch.bfloat16
def kv(n, hkv):
    return torch.randn(1, n, hkv, 128, dtype=bf).permute(0, 2, 1, 3)
for model, H, Hkv in (("llama", 32, 8), ("qwen", 12, 2)):
    for Lq, Lk in ((4096, 4096), (4096, 8192), (4099, 8195)):
        off = Lk - Lq
        q = torch.randn(1, H, Lq, 128, dtype=bf); k = kv(Lk, Hkv); v = kv(Lk, Hkv)
        heads = ([AShape(1024, 2048), VerticalSlash(1000, 2048), BlockSparse(40)] * H)[:H]
        pat = SparsePattern(tuple(heads))
        # 1) index kernels as CUDA runs them (outputs are garbage here: compile only)
        for mod in (index, plan):
            if hasattr(mod, "use_columns_kernel"): mod.use_columns_kernel = lambda *_: True
        index.use_estimate_kernel = lambda *_: True
        attempt(f"mi index {model} {Lq}x{Lk}", plan.build_plan, q, k, pat, offset=off, scale=128 ** -0.5)
        index.use_estimate_kernel = lambda *_: False
        for mod in (index, plan):
            if hasattr(mod, "use_columns_kernel"): mod.use_columns_kernel = lambda *_: False
        # 2) the attention kernel with real (torch-built) indices
        section("mi plan torch")
        groups = plan.build_plan(q, k, pat, offset=off, scale=128 ** -0.5)
        for launch in (None, mk.Launch(flat=False), mk.Launch(flat=False, wide=True)):
            name = "default" if launch is None else launch.name()
            attempt(f"mi fwd {model} {Lq}x{Lk} {name}", mk.attention_triton, q, k, v, groups, offset=off,
                    scale=128 ** -0.5, block_size=64, launch=launch)
