"""One attention layer (Llama-3.1-8B shape by default) per context strategy, and torch's
context_parallel (its ring over SDPA) as a user would run it.

    torchrun --nproc-per-node 2 launch/bench.py attention --cp 2 --strategies ring,ulysses,torch-cp ...

dense and sdpa-cudnn run on rank 0 alone; the strategies and torch-cp over the CP group. Each point is
the median of --repeats runs after 2 warm-up runs.
"""
from __future__ import annotations

import json
import sys

import torch

from starshard.benchmarks.common import add_common_arguments, header, median, timed, write
from starshard.config import ParallelConfig
from starshard.kernels.attention import attention
from starshard.parallel.context import make_strategy
from starshard.parallel.topology import init_topology
from starshard.strategies import CP_DEFAULT, DENSE, RING, SPECS, ULYSSES

HELP = "one attention layer per strategy (and torch's context_parallel)"
ONE_GPU = ("sdpa-cudnn",)  # besides the one-rank strategy (dense): rank 0 alone
TORCH_CP = ("torch-cp", "torch-cp-flash")  # torch's context_parallel over the CP group


def add_arguments(p) -> None:
    add_common_arguments(p)
    p.add_argument("--strategies", type=lambda s: s.split(","), default=[DENSE.name, RING.name, ULYSSES.name],
                   help=f"comma-separated, from {', '.join(SPECS)} (the registry's; {DENSE.name} runs on rank 0 "
                   f"alone, the others over the CP group), {', '.join(ONE_GPU)} (1 GPU), {', '.join(TORCH_CP)} (CP "
                   "group)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dim")
    p.set_defaults(cp_strategy=CP_DEFAULT)


def check(args) -> str | None:
    bad = [n for n in args.strategies if n not in (*SPECS, *ONE_GPU, *TORCH_CP)]
    if bad:
        return f"--strategies: unknown {', '.join(bad)}; choose from {', '.join((*SPECS, *ONE_GPU, *TORCH_CP))}"
    return None


def on_one_gpu(name: str) -> bool:
    """Runs on rank 0 alone: the one-rank strategy, or a single-GPU kernel."""
    return name in ONE_GPU or (name in SPECS and SPECS[name].single_rank)


def run(args) -> None:
    topo = init_topology(ParallelConfig(cp=args.cp, cp_strategy=args.cp_strategy), args.device)
    dev, dtype = topo.device, getattr(torch, args.dtype)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    rows = []
    for L in args.lengths:
        flops = 4 * H * D * L * L / 2
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, H, L, D, dtype=dtype, device=dev, generator=gen)
        k = torch.randn(1, Hkv, L, D, dtype=dtype, device=dev, generator=gen)
        v = torch.randn(1, Hkv, L, D, dtype=dtype, device=dev, generator=gen)
        pos = torch.arange(L, device=dev)
        for name in args.strategies:
            try:
                if on_one_gpu(name) and topo.rank != 0:
                    continue
                if name in SPECS and SPECS[name].single_rank:
                    fn = lambda: attention(q, k, v, q_pos=pos, k_pos=pos)  # noqa: E731
                elif name in ONE_GPU:
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    def fn():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                elif name in TORCH_CP:
                    fn = torch_cp_attention(q, k, v, topo, flash=name.endswith("flash"))
                else:
                    s = make_strategy(name, topo.cp_group)
                    seg = s.segments(L, L)[0]
                    idx = seg.index.to(dev)
                    ql, kl, vl, pl = q[:, :, idx], k[:, :, idx], v[:, :, idx], seg.positions.to(dev)
                    attend = s.prefill_attend(seg.to(dev))
                    fn = lambda: attend(ql, kl, vl, pl, None)  # noqa: E731
                t = median(timed(fn, dev, args.repeats, warmup=2))
                gpus = 1 if on_one_gpu(name) else topo.world_size
                rows.append({"length": L, "strategy": name, "gpus": gpus, "seconds": t,
                             "tflops_per_gpu": flops / t / gpus / 1e12})
            except Exception as e:  # noqa: BLE001 -- a failing peer must not lose the other rows
                rows.append({"length": L, "strategy": name, "error": f"{type(e).__name__}: {e}"[:300]})
            if topo.rank == 0:
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del q, k, v
    result = header("attention", topo.device, topo.world_size, args)
    result.update(shape={"heads": H, "kv_heads": Hkv, "head_dim": D, "dtype": args.dtype}, results=rows)
    if topo.rank == 0:
        write(args.out, result)


def torch_cp_attention(q, k, v, topo, flash: bool = False):
    """torch.distributed.tensor.experimental.context_parallel (its ring over SDPA), as a user would run it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh(topo.device.type, (topo.world_size,))
    g = q.shape[1] // k.shape[1]
    qc, kc, vc = q.clone(), k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # it takes equal heads
    backend = SDPBackend.MATH
    if topo.device.type == "cuda":
        backend = SDPBackend.FLASH_ATTENTION if flash else SDPBackend.CUDNN_ATTENTION

    def fn():
        with context_parallel(mesh, buffers=[qc, kc, vc], buffer_seq_dims=[2, 2, 2]), sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True)

    return fn
