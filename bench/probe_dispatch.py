"""Where the dispatcher's time goes next to a direct cuDNN call (causal GQA prefill, bf16): the
mask classification (one host sync), the GQA K/V copy, and the call itself. Prints JSON lines."""
import json

import torch
from triton.testing import do_bench

from starshard.kernels.attention import _cudnn_native_gqa, _fused, attention, mask_mode

dev = "cuda"
for L in (8192, 32768):
    q = torch.randn(1, 32, L, 128, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, L, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    p = torch.arange(L, device=dev)
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    ke, ve = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    rows = {
        "native_gqa_ok": _cudnn_native_gqa(q, k),
        "dispatcher": do_bench(lambda: attention(q, k, v, q_pos=p, k_pos=p, causal=True), warmup=25, rep=200),
        "fused(no classification)": do_bench(lambda: _fused(q, k, v, causal=True, scale=None, op="cudnn"), warmup=25, rep=200),
        "mask_mode": do_bench(lambda: mask_mode(p, p, True), warmup=25, rep=200),
        "cudnn pre-expanded": do_bench(lambda: op(q, ke, ve, None, True, 0.0, True, False), warmup=25, rep=200),
    }
    if rows["native_gqa_ok"]:
        ref = op(q, ke, ve, None, True, 0.0, True, False)[0].float()
        got = attention(q, k, v, q_pos=p, k_pos=p, causal=True)[0].float()
        rows["native_vs_expanded_rel_err"] = ((got - ref).norm() / ref.norm()).item()
    print(json.dumps({"L": L, "ms": rows}), flush=True)
