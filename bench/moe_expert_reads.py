"""Where the MoE decode's expert kernels lose against their bytes: routing, the GEMV, or the expert layout?

Qwen3-30B-A3B shape, one token, 8 of 128 experts, each call routed to its own experts (router logits drawn
per copy, as bench/moe_gate_up_tiles.py), microseconds per call from a CUDA graph (PDL as in a decode step):

  routed_gate_up   the engine's gate/up launch (routes its token in every program, then the GEMVs)
  expert_gate_up   the same GEMVs with the experts chosen beforehand (no routing in the kernel)
  read_gate_up     a kernel that only reads the chosen experts' gate/up rows (8 x 6.3 MB), after the PDL wait
  expert_down      the engine's down launch (8 experts' rows summed per output column, weights applied)
  read_down        only reading the chosen experts' down rows (8 x 3.1 MB)

    python bench/moe_expert_reads.py --out expert_reads.json
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from starshard.benchmarks.common import commit, graph_time_us
from starshard.kernels.moe_decode import expert_down, expert_gate_up, routed_gate_up
from starshard.kernels.pdl import pdl_launch, pdl_trigger, pdl_wait

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", required=True)
ap.add_argument("--copies", type=int, default=16, help="routes cycled through (each its own 8 experts)")
args = ap.parse_args()
dev, E, k, H, Fw = torch.device("cuda"), 128, 8, 2048, 768


@triton.jit
def _read_experts(w_ptr, exp_ptr, out_ptr, per_expert, stride_we, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (j, c): the c-th BLOCK of elements of expert exp_ptr[j]'s rows, summed into out."""
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)
    j = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(exp_ptr + j).to(tl.int64)
    offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(w_ptr + e * stride_we + offs, mask=offs < per_expert, other=0.0)
    tl.store(out_ptr + j * tl.num_programs(1) + c, tl.sum(v.to(tl.float32), axis=0))


def read_experts(w, experts, block=4096, warps=8):
    per = w[0].numel()
    grid = (experts.numel(), triton.cdiv(per, block))
    out = torch.empty(grid, dtype=torch.float32, device=w.device)
    _read_experts[grid](w, experts, out, per, w.stride(0), BLOCK=block, num_warps=warps, **pdl_launch(w))
    return out


g = torch.Generator(device=dev).manual_seed(0)
w13 = (torch.randn(E, 2 * Fw, H, device=dev, generator=g) * 0.02).bfloat16()
w2 = (torch.randn(E, H, Fw, device=dev, generator=g) * 0.02).bfloat16()
x = torch.randn(1, H, device=dev, generator=g).bfloat16()
logits = [torch.randn(1, E, device=dev, generator=g).bfloat16() for _ in range(args.copies)]
routed = [routed_gate_up(x, lg, w13, k, True) for lg in logits]  # (act, weights, experts) per route
flat = [r[2].reshape(-1).contiguous() for r in routed]
gate_up_bytes, down_bytes = k * 2 * Fw * H * 2, k * H * Fw * 2
calls = {
    "routed_gate_up": (lambda i: routed_gate_up(x, logits[i], w13, k, True), gate_up_bytes),
    "expert_gate_up": (lambda i: expert_gate_up(x, routed[i][2], w13), gate_up_bytes),
    "read_gate_up": (lambda i: read_experts(w13, flat[i]), gate_up_bytes),
    "read_gate_up_2048x4": (lambda i: read_experts(w13, flat[i], 2048, 4), gate_up_bytes),
    "expert_down": (lambda i: expert_down(routed[i][0], routed[i][2], routed[i][1], w2, out_dtype=x.dtype), down_bytes),
    "read_down": (lambda i: read_experts(w2, flat[i]), down_bytes),
    "read_down_2048x4": (lambda i: read_experts(w2, flat[i], 2048, 4), down_bytes),
}
res = {"bench": "moe_expert_reads", "device": torch.cuda.get_device_name(), "commit": commit(), "rows": []}
for name, (fn, nbytes) in calls.items():
    us = graph_time_us(fn, 16, best=True, copies=args.copies)
    row = {"kernel": name, "us": us, "tb_per_s": nbytes / us / 1e6}
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
