"""The 16-question step through the kept graphs was 1.17x the parent's per-batch graph at 132K (h100-i/): is it the
kernel? The shared part of one layer's decode attention, token-major bf16 K / V of the 8B shape (8 KV heads, 32
query heads, head_dim 128), B questions as one query block, through `table=` (the kept graphs) and through the
general launch with the cache's length known on the host (the per-batch graphs), same inputs, outputs compared.
Usage: python table_probe.py OUT.json [lengths, default 100003,132445]"""
import json
import sys

import torch
from triton.testing import do_bench

from starshard.kernels import decode as dk
from starshard.kernels.decode import decode_attention

HQ, HKV, D = 32, 8, 128
dev = torch.device("cuda")
lengths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "100003,132445").split(",")]
g = torch.Generator(device=dev).manual_seed(5)


def token_major(n):  # [1, n, Hkv, D] memory handed out as [1, Hkv, n, D] (engine/kv_cache.py)
    return torch.randn(1, n, HKV, D, generator=g, device=dev, dtype=torch.bfloat16).permute(0, 2, 1, 3)


anchors = (token_major(1), token_major(1), torch.zeros(1, dtype=torch.long, device=dev))
rows = []
for n in lengths:
    k, v, kp = token_major(n), token_major(n), torch.arange(n, device=dev)
    table = torch.tensor(dk.table_row(k, v, kp, n, anchors), device=dev)
    for b in (1, 4, 16):
        q = torch.randn(1, HQ, b, D, generator=g, device=dev, dtype=torch.bfloat16)
        qp = torch.full((1, b), n - 1, device=dev)
        general = lambda: decode_attention(q, k, v, q_pos=qp, k_pos=kp, causal=True)  # noqa: E731
        tabled = lambda: decode_attention(q, *anchors[:2], q_pos=qp, k_pos=anchors[2], causal=True,  # noqa: E731
                                          table=table)
        (o1, l1), (o2, l2) = general(), tabled()
        t1, t2 = do_bench(general, warmup=50, rep=300), do_bench(tabled, warmup=50, rep=300)
        rows.append({"length": n, "questions": b, "general_ms": t1, "table_ms": t2, "table_over_general": t2 / t1,
                     "max_abs_diff": (o1.float() - o2.float()).abs().max().item(),
                     "read_gbps_general": 2 * n * HKV * D * 2 / t1 / 1e6})
        print(rows[-1])
json.dump({"device": torch.cuda.get_device_name(), "lengths": lengths, "results": rows}, open(sys.argv[1], "w"),
          indent=1)
