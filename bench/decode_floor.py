"""How fast can a decode step built from one kernel per op be? The step's reads alone, on one GPU.

Issue 20 asks the MoE decode step (Qwen3-30B-A3B shape, one token) to run within 1.5x of the time its
bytes take at HBM bandwidth. Our step launches 11 dependent kernels per layer (two RMSNorms, the wqkv /
wo / router GEMVs, RoPE, the KV write, split-KV attention and its merge, the routed gate/up and the
down GEMVs) in a CUDA graph with programmatic dependent launch (kernels/pdl.py). This bench replaces
every one of them by a kernel that does nothing but read what that op reads -- the same bytes, each
layer's own buffers (no L2 reuse between layers), contiguous (the most favourable layout) -- and
keeps the op's dependency: weights no kernel writes are read before the PDL wait (as our GEMVs
prefetch theirs), everything else (expert rows chosen by the router, the cached keys, activations)
after it. So the chain's time is a floor for this design: real kernels also compute, route and
reduce, and read experts scattered over 128.

    python bench/decode_floor.py [--preset qwen3-30b-a3b] [--context 4096] [--hbm-bandwidth B]
        [--out decode_floor.json]

Timed, each as one CUDA graph replayed (median of --repeats, CUDA events):
  ops        the 11 reads per layer above, then the final norm and LM head: our step's shape
  layer      one read kernel per layer of all its bytes (what a fused decode layer could reach)
  one_read   one kernel reading every byte of the step (the card's read bandwidth for this size)
  ops_nopdl  `ops` launched without PDL (each kernel waits for the one before to end)
  ops_prefetch[_evict_first]  `ops` with the next layer's wqkv and wo read into L2 on a side stream during
             the MLP part (the experts' loads hinted evict_first in the second)
and each against the bytes bound: step bytes / --hbm-bandwidth (default: the card's nominal figure,
H100 SXM 3.35e12, H200 4.8e12). Read kernels: BLOCK elements of int32 per program, one tile, the
fastest of a few (BLOCK, warps) for `one_read`, chosen once and used throughout.
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from starshard.benchmarks.common import commit, nominal_hbm_bandwidth, timed_median
from starshard.kernels.pdl import pdl_enabled, pdl_trigger, pdl_wait
from starshard.presets import preset_config

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--preset", default="qwen3-30b-a3b")
ap.add_argument("--context", type=int, default=4096, help="cached tokens the step attends")
ap.add_argument("--hbm-bandwidth", type=float, default=None,
                help="HBM bytes per second of the bound (default: the card's nominal, benchmarks/common.py)")
ap.add_argument("--repeats", type=int, default=20)
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device("cuda")
assert pdl_enabled(dev), "needs a GPU with PDL (compute capability >= 9) and triton grid dependency control"
args.hbm_bandwidth = args.hbm_bandwidth or nominal_hbm_bandwidth(dev)
assert args.hbm_bandwidth, f"no nominal HBM figure for {torch.cuda.get_device_name(dev)}: pass --hbm-bandwidth"


@triton.jit
def _load(ptr, mask, EVICT: tl.constexpr):
    if EVICT == "first":
        return tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")
    elif EVICT == "last":
        return tl.load(ptr, mask=mask, other=0, eviction_policy="evict_last")
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _read(src, n, out, BLOCK: tl.constexpr, BEFORE_WAIT: tl.constexpr, USE_PDL: tl.constexpr,
          EVICT: tl.constexpr = ""):
    """Sum one BLOCK of int32 per program into out[pid]; BEFORE_WAIT: the load is issued before the PDL
    wait (weights no kernel writes), else after it (what an earlier kernel chose or wrote). EVICT: the
    load's L2 eviction hint ("first", "last" or none)."""
    pdl_trigger(USE_PDL)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if not BEFORE_WAIT:
        pdl_wait(USE_PDL)
    v = _load(src + offs, offs < n, EVICT)
    if BEFORE_WAIT:
        pdl_wait(USE_PDL)
    tl.store(out + pid, tl.sum(v, axis=0))


cfg = preset_config(args.preset)
h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
B = 2  # bf16 bytes
if cfg.num_experts:
    k, f = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    mlp = [("router", cfg.num_experts * h * B, True), ("gate_up", k * 2 * f * h * B, False),
           ("down", k * h * f * B, False)]
else:
    f = cfg.intermediate_size
    mlp = [("w13", 2 * f * h * B, True), ("silu_mul", 2 * f * B, False), ("w2", h * f * B, True)]
# (op, bytes read, read before the wait). Small ops read their activations (a few KB) after the wait.
LAYER_OPS = [("attention_norm", 2 * h * B, False), ("wqkv", (hq + 2 * hkv) * d * h * B, True),
             ("rope_qk_norm", (hq + 2 * hkv) * d * B, False), ("kv_write", 2 * hkv * d * B, False),
             ("split_kv", args.context * 2 * hkv * d * B, False), ("merge", hq * d * 4 * 4, False),
             ("wo", hq * d * h * B, True), ("ffn_norm", 2 * h * B, False)] + mlp
HEAD_OPS = [("final_norm", 2 * h * B, False), ("lm_head", cfg.vocab_size * h * B, True)]
layer_bytes = sum(b for _, b, _ in LAYER_OPS)
step_bytes = cfg.num_layers * layer_bytes + sum(b for _, b, _ in HEAD_OPS)
bound = step_bytes / args.hbm_bandwidth


def buffer(nbytes):
    return torch.ones(-(-nbytes // 4), dtype=torch.int32, device=dev)


def launcher(buf, block, warps, before_wait, pdl, evict=""):
    n = buf.numel()
    grid = (triton.cdiv(n, block),)
    out = torch.empty(grid[0], dtype=torch.int32, device=dev)
    kw = {"launch_pdl": True} if pdl else {}
    return lambda: _read[grid](buf, n, out, BLOCK=block, BEFORE_WAIT=before_wait, USE_PDL=pdl, EVICT=evict,
                               num_warps=warps, **kw)


SIDE = torch.cuda.Stream()


def on_side_stream(fns):
    """Launch fns on a side stream forked from the capturing stream here (an L2 prefetch: nothing waits
    for it but the step's end, see graph_time)."""
    def fork():
        main = torch.cuda.current_stream()
        SIDE.wait_stream(main)
        with torch.cuda.stream(SIDE):
            for fn in fns:
                fn()
    return fork


def graph_time(launches) -> float:
    """Seconds per replay of one CUDA graph capturing `launches` in order."""
    for fn in launches:  # compile outside the capture
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        SIDE.wait_stream(s)  # the side stream joins the capture here whether or not a prefetch forks it
        for fn in launches:
            fn()
        s.wait_stream(SIDE)  # the side stream's prefetches rejoin before the capture ends
    torch.cuda.synchronize()
    return timed_median(g.replay, dev, args.repeats, warmup=3)


# Per-layer buffers: every layer reads its own bytes, as a model's layers do.
layers = [[(name, buffer(b), before) for name, b, before in LAYER_OPS] for _ in range(cfg.num_layers)]
head = [(name, buffer(b), before) for name, b, before in HEAD_OPS]
everything = buffer(step_bytes)

tiles = {}
for block, warps in [(1024, 4), (2048, 4), (4096, 8), (8192, 8)]:
    tiles[(block, warps)] = graph_time([launcher(everything, block, warps, False, True)])
block, warps = min(tiles, key=tiles.get)
print("one_read tiles (BLOCK, warps) -> ms:", {f"{b}x{w}": round(1e3 * t, 4) for (b, w), t in tiles.items()})


def chain(pdl):
    ops = [launcher(buf, block, warps, before, pdl) for layer in layers for _, buf, before in layer]
    return ops + [launcher(buf, block, warps, before, pdl) for _, buf, before in head]


def chain_prefetch(evict_experts):
    """`ops`, and at each layer's ffn_norm the next layer's independent weights (wqkv, wo) read on a side
    stream with evict_last while the experts stream (evict_first if evict_experts): does an L2 prefetch
    during the routed phase take them off the chain?"""
    ops = []
    for i, layer in enumerate(layers):
        for name, buf, before in layer:
            if name == "ffn_norm" and i + 1 < len(layers):
                ahead = [launcher(b, block, warps, False, False, "last") for n, b, _ in layers[i + 1]
                         if n in ("wqkv", "wo")]
                ops.append(on_side_stream(ahead))
            evict = "first" if evict_experts and name in ("gate_up", "down", "w13", "w2") else ""
            ops.append(launcher(buf, block, warps, before, True, evict))
    return ops + [launcher(buf, block, warps, before, True) for _, buf, before in head]


layer_bufs = [buffer(layer_bytes) for _ in range(cfg.num_layers)]
times = {
    "ops": graph_time(chain(True)),
    "ops_nopdl": graph_time(chain(False)),
    "ops_prefetch": graph_time(chain_prefetch(False)),
    "ops_prefetch_evict_first": graph_time(chain_prefetch(True)),
    "layer": graph_time([launcher(b, block, warps, False, True) for b in layer_bufs]
                        + [launcher(buf, block, warps, before, True) for _, buf, before in head]),
    "one_read": tiles[(block, warps)],
}
result = {
    "bench": "decode_floor", "commit": commit(), "device": torch.cuda.get_device_name(dev), "preset": args.preset,
    "context": args.context, "layers": cfg.num_layers, "launches_per_layer": len(LAYER_OPS),
    "ops_bytes_per_layer": {name: b for name, b, _ in LAYER_OPS}, "step_bytes": step_bytes,
    "hbm_bandwidth": args.hbm_bandwidth, "bytes_bound_ms": 1e3 * bound, "tile": {"block": block, "warps": warps},
    "ms": {name: 1e3 * t for name, t in times.items()},
    "over_bytes_bound": {name: t / bound for name, t in times.items()},
    "ops_us_per_layer": 1e6 * (times["ops"] - times["one_read"] * sum(b for _, b, _ in HEAD_OPS) / step_bytes)
    / cfg.num_layers,
}
print(json.dumps(result, indent=1))
if args.out:
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
