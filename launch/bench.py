#!/usr/bin/env python
"""Benchmarks -> JSON (+ PNG): end-to-end prefill / decode of any strategy, attention alone, peers.

    python launch/bench.py prefill --random-weights llama-3.1-8b --lengths 8192,32768 --out r.json
    torchrun --nproc-per-node 2 launch/bench.py prefill --cp 2 --cp-strategy ring --random-weights llama-3.1-8b ...
    torchrun --nproc-per-node 2 launch/bench.py attention --cp 2 --strategies ring,ulysses,torch-cp ...
    python launch/bench.py hf --random-weights llama-3.1-8b --lengths 8192     # transformers peer
    python launch/bench.py plot r1.json r2.json --out latency.png

Timings: warm-up, then the median of --repeats runs, CUDA events on GPU. MFU is against a bf16 matmul
peak measured in the same process.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def timed(fn, device, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of fn() (after warm-up), each synchronised."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def matmul_peak(device, dtype=torch.bfloat16, n: int = 8192) -> float:
    """Measured dense matmul FLOP/s (the MFU denominator)."""
    if device.type != "cuda":
        n = 1024
        dtype = torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = statistics.median(timed(lambda: a @ b, device, 10, 3))
    return 2 * n**3 / t


def prefill_flops(cfg, L: int) -> dict[str, float]:
    """Model FLOPs of a causal prefill of L tokens (logits for the last token only)."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer_params = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    linear = 2 * L * per_layer_params * cfg.num_layers + 2 * h * cfg.vocab_size
    attn = 4 * cfg.num_heads * d * L * L / 2 * cfg.num_layers  # QK^T and PV, causal half
    return {"linear": float(linear), "attention": float(attn), "total": float(linear + attn)}


def model_seconds(cfg, strategy, L: int, context: int, peak: float) -> float | None:
    """The strategy's FLOP-model prefill time at the measured matmul peak (parallel/context/flops.py):
    the slowest rank, or the sum over hosts when one device runs them in turn (study mode)."""
    from starshard.parallel.context import flops

    q = L - context
    name, cp = strategy.name, strategy.cp
    if name == "dense":
        ranks = flops.dense_flops(cfg, L)
    elif name in ("ring", "ulysses", "usp"):  # exact strategies split the same work evenly
        ranks = flops.ring_flops(cfg, L, cp)
    elif name == "star":
        block, anchor = strategy.resolved_sizes(context)
        ranks = flops.star_flops(cfg, context, cp, block, anchor, query_len=q)
    elif name == "apb":
        anchor, passing = strategy.resolved_sizes(context)
        ranks = flops.apb_flops(cfg, context, strategy.hosts, anchor, passing, query_len=q,
                                embed_query=strategy.embed_query)
    else:
        return None
    return flops.predicted_seconds(ranks, peak, serial=cp == 1 and len(ranks) > 1)


def median(xs):
    return statistics.median(xs) if xs else None


def write(out: str | None, result: dict) -> None:
    text = json.dumps(result, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    print(text)


def setup(args):
    from starshard.config import ParallelConfig
    from starshard.parallel.topology import init_topology

    from starshard.parallel.context import APB_OPTIONS

    apb = {k: getattr(args, k) for k in APB_OPTIONS if getattr(args, k, None) is not None}
    parallel = ParallelConfig(cp=args.cp, cp_strategy=args.cp_strategy, ulysses_degree=getattr(args, "ulysses_degree", None),
                              num_blocks=getattr(args, "num_blocks", None), **apb)
    return parallel, init_topology(parallel, args.device)


def header(args, topo, kind: str) -> dict:
    return {"kind": kind, "device": device_name(topo.device), "gpus": topo.world_size,
            "date": datetime.date.today().isoformat(), "commit": commit(), "args": vars(args)}


# ---------------------------------------------------------------------------- end-to-end prefill
def cmd_prefill(args) -> None:
    from starshard.checkpoints.load import load_model
    from starshard.checkpoints.sources import random_model
    from starshard.config import SamplingConfig
    from starshard.runtime.local import LocalRunner
    from starshard.parallel.context import make_strategy
    from starshard.runtime.context_parallel import ContextParallelRunner
    from starshard.presets import preset_config

    parallel, topo = setup(args)
    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        cfg = preset_config(args.random_weights)
        model = random_model(cfg, dtype=dtype, device=topo.device)
    else:
        model = load_model(args.model, dtype=dtype, device=topo.device)
        cfg = model.config
    if args.sparse:
        from starshard.kernels.sparse import SparseConfig, install_sparse, load_sparse_method

        install_sparse(model, load_sparse_method(SparseConfig(args.sparse, args.sparse_config, args.anchor_theta)))
    from starshard.parallel.context import apb_options

    strategy = make_strategy(parallel.cp_strategy, topo.cp_group if args.cp > 1 else None,
                             block_size=args.block_size, anchor_size=args.anchor_size,
                             ulysses_degree=parallel.ulysses_degree, cp_groups=topo.group_ranks("cp"),
                             num_blocks=parallel.num_blocks, **apb_options(parallel))
    runner = ContextParallelRunner(model, strategy) if parallel.cp_strategy != "dense" else None
    peak = matmul_peak(topo.device)
    rows = []
    for L in args.lengths:
        gen = torch.Generator(device="cpu").manual_seed(L)
        ids = torch.randint(0, cfg.vocab_size, (L,), generator=gen).to(topo.device)
        context_len = L - args.query_tokens
        state = {}

        def prefill():
            state["cache"] = cache = (runner or LocalRunner(model)).new_cache(L + args.decode_steps + 8)
            with torch.inference_mode():
                if runner is None:
                    state["logits"] = model(ids[None], cache=cache, last_only=True)
                else:
                    state["logits"], state["owner"] = runner.prefill_logits(ids, context_len, cache)

        stepper = None
        try:
            if topo.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(topo.device)
            times = timed(prefill, topo.device, args.repeats, warmup=args.warmup)
            mem = torch.cuda.max_memory_allocated(topo.device) / 2**30 if topo.device.type == "cuda" else None
            decode = None
            if args.decode_steps:
                tok = torch.zeros(1, 1, dtype=torch.long, device=topo.device)
                stepper = runner or LocalRunner(model, cuda_graphs=not args.no_cuda_graphs)
                stepper.cuda_graphs = not args.no_cuda_graphs

                def step():  # one generated token, as LLM.generate runs it (CUDA graphs on one GPU)
                    with torch.inference_mode():
                        stepper.next_token(tok, state["cache"], SamplingConfig(), None)

                step_times = timed(step, topo.device, args.decode_steps, warmup=2)
                decode = {"step_seconds": median(step_times), "tokens_per_second": 1 / median(step_times)}
            t = median(times)
            flops = prefill_flops(cfg, L)
            row = {"length": L, "prefill_seconds": t, "all_seconds": times, "peak_memory_gib": mem,
                   "model_tflops": flops["total"] / 1e12, "achieved_tflops_per_gpu": flops["total"] / t / topo.world_size / 1e12,
                   "mfu": flops["total"] / t / topo.world_size / peak, "decode": decode}
            model_t = model_seconds(cfg, runner.strategy if runner else make_strategy("dense"), L,
                                    context_len if runner and runner.strategy.query_phase else L, peak)
            if model_t:  # the FLOP model at the matmul peak: what a strategy that wastes nothing takes
                row.update(model_seconds=model_t, measured_over_model=t / model_t)
        except torch.OutOfMemoryError as e:
            row = {"length": L, "error": f"out of memory: {str(e).splitlines()[0]}"}
            state.clear()
            torch.cuda.empty_cache()
        rows.append(row)
        if stepper is not None:
            stepper.end_generation()  # drop the decode graph with this length's cache
        if topo.rank == 0:
            print(json.dumps(row), file=sys.stderr, flush=True)
    result = header(args, topo, "prefill")
    result.update(strategy=parallel.cp_strategy, cp=args.cp, matmul_peak_tflops=peak / 1e12, results=rows)
    if topo.rank == 0:
        write(args.out, result)


# ---------------------------------------------------------------------------- attention only
def cmd_attention(args) -> None:
    """One attention layer (Llama-3.1-8B shape by default): our strategies vs torch's context_parallel."""
    from starshard.kernels.attention import attention
    from starshard.parallel.context import make_strategy

    parallel, topo = setup(args)
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
                if name == "dense":
                    if topo.rank != 0:
                        continue
                    fn = lambda: attention(q, k, v, q_pos=pos, k_pos=pos)  # noqa: E731
                elif name == "sdpa-cudnn":
                    if topo.rank != 0:
                        continue
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    def fn():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                elif name.startswith("torch-cp"):
                    fn = torch_cp_attention(q, k, v, topo, flash=name.endswith("flash"))
                else:
                    s = make_strategy(name, topo.cp_group)
                    seg = s.segments(L, L)[0]
                    idx = seg.index.to(dev)
                    ql, kl, vl, pl = q[:, :, idx], k[:, :, idx], v[:, :, idx], seg.positions.to(dev)
                    attend = s.prefill_attend(seg.to(dev))
                    fn = lambda: attend(ql, kl, vl, pl, None)  # noqa: E731
                t = median(timed(fn, dev, args.repeats, warmup=2))
                gpus = 1 if name in ("dense", "sdpa-cudnn") else topo.world_size
                rows.append({"length": L, "strategy": name, "gpus": gpus, "seconds": t,
                             "tflops_per_gpu": flops / t / gpus / 1e12})
            except Exception as e:  # noqa: BLE001 -- a failing peer must not lose the other rows
                rows.append({"length": L, "strategy": name, "error": f"{type(e).__name__}: {e}"[:300]})
            if topo.rank == 0:
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del q, k, v
    result = header(args, topo, "attention")
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


# ---------------------------------------------------------------------------- transformers peer
def cmd_hf(args) -> None:
    import transformers

    from starshard.presets import PRESETS

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = transformers.LlamaConfig(**{k: v for k, v in PRESETS[args.random_weights].items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).eval()
    peak = matmul_peak(dev)
    rows = []
    for L in args.lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, L), device=dev)

        def run():
            with torch.inference_mode():
                model(ids, use_cache=False, logits_to_keep=1)

        try:
            t = median(timed(run, dev, args.repeats))
            from starshard.presets import preset_config

            flops = prefill_flops(preset_config(args.random_weights), L)["total"]
            rows.append({"length": L, "prefill_seconds": t, "mfu": flops / t / peak})
        except torch.OutOfMemoryError:
            rows.append({"length": L, "error": "out of memory"})
            torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"kind": "hf-prefill", "device": device_name(dev), "gpus": 1, "date": datetime.date.today().isoformat(),
              "commit": commit(), "transformers": transformers.__version__, "args": vars(args),
              "matmul_peak_tflops": peak / 1e12, "results": rows}
    write(args.out, result)


# ---------------------------------------------------------------------------- plot
def cmd_plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in args.files:
        r = json.loads(Path(f).read_text())
        if r["kind"] == "attention":
            series = {}
            for row in r["results"]:
                if "seconds" in row:
                    series.setdefault(f"{row['strategy']} ({row['gpus']} GPU)", []).append((row["length"], row["seconds"]))
        else:
            label = f"{r.get('strategy', r['kind'])} ({r['gpus']} GPU)"
            series = {label: [(x["length"], x["prefill_seconds"]) for x in r["results"] if "prefill_seconds" in x]}
        for label, pts in series.items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("seconds")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")

# ---------------------------------------------------------------------------- the service
def cmd_serve(args) -> None:
    """The long-document service's engine in this process (no HTTP): time to first token for a
    question on a new document (prefill) and on a cached one (a follow-up), then aggregate decode
    tokens/s with N concurrent questions on one cached document."""
    import threading

    import numpy as np

    from starshard import LLM
    from starshard.config import ParallelConfig
    from starshard.runtime.service import SamplingParams, Service

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype if device.type == "cuda" else "float32")
    llm = LLM(args.model, dtype=dtype, device=str(device), random_weights=args.random_weights, progress=False,
              parallel=ParallelConfig())
    budget = int(args.cache_gib * 2**30)
    svc = Service(llm, cache_bytes=budget, max_batch=max(args.concurrency), max_queue=4 * max(args.concurrency),
                  max_extend=args.question_tokens + 8)
    svc.start()
    vocab = llm.config.vocab_size
    rng = np.random.default_rng(0)

    def tokens(n):  # random ids (random weights have no tokenizer; real weights: still a valid prompt)
        return [int(x) for x in rng.integers(100, vocab - 100, n)]

    def ask(ids, max_tokens):
        """Submit; -> (done event, record with arrival, first-token and per-token times)."""
        rec = {"t0": time.perf_counter(), "times": [], "finish": None, "cached": 0}
        done = threading.Event()

        def on_event(ev):
            if ev.token_id is not None:
                rec["times"].append(time.perf_counter())
            if ev.finish_reason is not None:
                rec["finish"], rec["cached"] = ev.finish_reason, ev.cached_tokens
                done.set()

        svc.submit(svc.text_prompt(ids), max_tokens=max_tokens, sampling=SamplingParams(), on_event=on_event)
        return done, rec

    def wait(done):
        if not done.wait(args.timeout):
            raise SystemExit(f"error: a request did not finish within --timeout {args.timeout} s")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for L in args.lengths:
        doc = tokens(L - args.question_tokens)
        first = ask(doc + tokens(args.question_tokens), 2)  # a new document: prefill
        wait(first[0])
        follow = ask(doc + tokens(args.question_tokens), 2)  # another question on it: cached
        wait(follow[0])
        ttft = lambda r: r["times"][0] - r["t0"]  # noqa: E731
        row = {"length": L, "ttft_uncached_s": ttft(first[1]), "ttft_cached_s": ttft(follow[1]),
               "cached_tokens": follow[1]["cached"], "concurrency": []}
        row["cached_over_uncached"] = row["ttft_cached_s"] / row["ttft_uncached_s"]
        for n in args.concurrency:
            sync()
            reqs = [ask(doc + tokens(args.question_tokens), args.decode_tokens) for _ in range(n)]
            for d, _ in reqs:
                wait(d)
            recs = [r for _, r in reqs]
            # Steady state: from the moment every request has its first token to the last token.
            start = max(r["times"][0] for r in recs)
            end = max(r["times"][-1] for r in recs)
            decoded = sum(sum(1 for t in r["times"] if t > start) for r in recs)
            steps = [b - a for r in recs for a, b in zip(r["times"], r["times"][1:]) if a >= start]
            row["concurrency"].append({"questions": n, "decode_tokens_per_second": decoded / (end - start),
                                       "step_seconds_median": statistics.median(steps) if steps else None,
                                       "all_cached": all(r["cached"] > 0 for r in recs)})
        one = row["concurrency"][0]["decode_tokens_per_second"]
        for c in row["concurrency"]:
            c["speedup_vs_first"] = c["decode_tokens_per_second"] / one
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    stats = svc.stats()
    svc.shutdown()
    result = {"kind": "serve", "device": device_name(device), "gpus": 1, "date": datetime.date.today().isoformat(),
              "commit": commit(), "args": vars(args), "inputs": "random token ids" + (
                  f", random weights {args.random_weights}" if args.random_weights else f", weights {args.model or 'SmolLM2'}"),
              "results": rows, "engine_stats": stats}
    write(args.out, result)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def ints(s):
        return [int(x) for x in s.split(",")]

    def common(p):
        p.add_argument("--lengths", type=ints, default=[8192], help="comma-separated prompt lengths in tokens")
        p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median reported)")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="compute dtype")
        p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
        p.add_argument("--out", default=None, help="write the JSON here (also printed)")
        p.add_argument("--cp", type=int, default=1, help="context-parallel size (launch that many ranks)")

    p = sub.add_parser("prefill", help="end-to-end prefill (+ decode steps) of one strategy")
    common(p)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed prefills per length before the timed ones (0 at long lengths: list a short "
                        "length first to warm the process up instead)")
    p.add_argument("--random-weights", default=None, help="preset name (llama-3.1-8b, tiny) or config.json")
    p.add_argument("--model", default=None, help="real checkpoint instead of --random-weights")
    p.add_argument("--cp-strategy", default="ring", choices=["dense", "ring", "ulysses", "usp", "star", "apb"],
                   help="context strategy")
    p.add_argument("--num-blocks", type=int, default=None, help="star / apb: hosts simulated on one device (cp 1)")
    p.add_argument("--ulysses-degree", type=int, default=None, help="usp: Ulysses ranks inside each ring rank")
    p.add_argument("--sparse", default=None, choices=["minference", "anchor"], help="sparse prefill inside each shard")
    p.add_argument("--anchor-theta", type=float, default=12.0, help="--sparse anchor: score threshold")
    p.add_argument("--sparse-config", default=None, help="--sparse minference: per-head patterns JSON")
    p.add_argument("--block-size", type=int, default=None, help="star: block size")
    p.add_argument("--anchor-size", type=int, default=None, help="star: anchor size")
    p.add_argument("--query-tokens", type=int, default=64, help="star: prompt tokens treated as the query")
    from starshard.cli import add_apb_arguments

    add_apb_arguments(p.add_argument_group("APB (--cp-strategy apb)"))
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps timed after the prefill (0 = none)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="time decode steps eagerly (default: replay a CUDA graph on one rank)")
    p = sub.add_parser("attention", help="one attention layer per strategy (and torch's context_parallel)")
    common(p)
    p.add_argument("--strategies", type=lambda s: s.split(","), default=["dense", "ring", "ulysses"],
                   help="dense, sdpa-cudnn (1 GPU), ring, ulysses, torch-cp, torch-cp-flash (CP group)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="head dim")
    p.set_defaults(cp_strategy="ring")
    p = sub.add_parser("hf", help="Hugging Face transformers prefill (SDPA), the single-GPU peer")
    common(p)
    p.add_argument("--random-weights", default="llama-3.1-8b", help="preset name")
    p = sub.add_parser("serve", help="the service engine: cached vs uncached time to first token, concurrent decode")
    p.add_argument("--random-weights", default=None, help="preset name (llama-3.1-8b, tiny); default: --model")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2 when no --random-weights)")
    p.add_argument("--lengths", type=ints, default=[32768, 131072], help="document + question lengths in tokens")
    p.add_argument("--question-tokens", type=int, default=64, help="tokens of each question after the document")
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16], help="concurrent questions on one document")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens each concurrent question generates")
    p.add_argument("--cache-gib", type=float, default=40.0, help="context cache budget")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one request may take")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype on CUDA (CPU runs float32)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")
    p = sub.add_parser("plot", help="latency vs length from result JSON files")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--title", default="prefill latency", help="plot title")
    args = ap.parse_args(argv)
    if args.cmd == "prefill" and not (args.random_weights or args.model):
        ap.error("prefill needs --random-weights NAME or --model PATH")
    return args


def main(argv=None):
    args = parse_args(argv)
    {"prefill": cmd_prefill, "attention": cmd_attention, "hf": cmd_hf, "serve": cmd_serve, "plot": cmd_plot}[args.cmd](args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
