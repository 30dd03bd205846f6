"""Tensor x pipeline parallel benchmark: prefill time per prompt length and decode tokens/s for the
layout this job was launched with, the model and runner built by starshard.LLM; one JSON object
(rank 0 writes it).

    torchrun --nproc-per-node 1 launch/bench.py tp --random-weights llama-3.1-8b --out tp1.json
    torchrun --nproc-per-node 2 launch/bench.py tp --tp 2 --random-weights llama-3.1-8b --out tp2.json
    torchrun --nproc-per-node 4 launch/bench.py tp --tp 2 --pp 2 --random-weights llama-3.1-8b --out tp2pp2.json
    python launch/bench.py tp --random-weights tiny --device cpu --dtype float32 --lengths 64,128 --decode-steps 4

Timing: warm-up runs first, then the median of --repeats runs; CUDA events on GPU (perf_counter on
CPU), every rank starting together after a barrier. Prefill = the whole prompt to the first token
(pipelined in --prefill-chunk chunks when pp > 1); decode = --decode-steps tokens after it.
"""
from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.distributed as dist

from starshard.benchmarks.common import commit, device_name, ints, save_json, timed, today
from starshard.config import ParallelConfig, SamplingConfig
from starshard.partition import partition_layers
from starshard.llm import LLM
from starshard.runtime.prompt import Prompt

HELP = "tensor x pipeline parallel prefill and decode tokens/s (launch tp*pp ranks)"


def peak_memory_gib(topo) -> float | None:
    """Largest peak allocation over all ranks (the GPU that limits the layout)."""
    if topo.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(topo.device) / 2**30], device=topo.device)
    if topo.world_group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=topo.world_group)
    return float(peak)


def add_arguments(ap) -> None:
    ap.add_argument("--random-weights", default="llama-3.1-8b", metavar="CONFIG",
                    help="preset name (starshard/presets.py) or HF config.json: random weights of that shape")
    ap.add_argument("--model", default=None, help="a real checkpoint instead of --random-weights")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--pp-layers", type=ints, default=None, metavar="N,N,..", help="layers per stage (default even)")
    ap.add_argument("--lengths", type=ints, default=[8192, 32768], help="prompt lengths in tokens, comma separated")
    ap.add_argument("--decode-steps", type=int, default=64, help="decode tokens timed per repeat (0 = no decode)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point; the median is reported")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill chunk in tokens (default: whole prompt for pp=1, ~4 chunks per stage for pp>1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weights / compute dtype")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--dist-timeout", type=float, default=1800.0, help="collective timeout in seconds")
    ap.add_argument("--out", default=None, help="write the JSON here too (rank 0; rewritten after every length)")


def run(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, pp_layers=args.pp_layers, timeout_s=args.dist_timeout)
    llm = LLM(args.model, dtype=getattr(torch, args.dtype), device=device, parallel=parallel, progress=False,
              random_weights=None if args.model else args.random_weights)
    topo, runner, cfg = llm.topology, llm.runner, llm.config
    lead = topo.rank == 0
    greedy = SamplingConfig()
    result = {
        "kind": "tp_pp", "device": device_name(topo.device),
        "gpus": topo.world_size if topo.device.type == "cuda" else 0, "world_size": topo.world_size,
        "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
        "pp_layers": [len(s) for s in partition_layers(cfg.num_layers, parallel.pp, parallel.pp_layers)],
        "model": args.model or args.random_weights, "dtype": args.dtype,
        "date": today(), "commit": commit(), "args": vars(args), "results": [],
    }
    for L in args.lengths:
        ids = torch.randint(0, cfg.vocab_size, (L,), generator=torch.Generator().manual_seed(L)).tolist()
        prompt = Prompt(ids, L)
        state = {}

        def prefill():
            state.pop("cache", None)  # free the previous run's KV before allocating the next
            state["cache"] = cache = runner.new_cache(L + args.decode_steps * (args.repeats + 1) + 1)
            with torch.inference_mode():
                state["tok"] = runner.prefill(prompt, cache, greedy, None, args.prefill_chunk)

        def decode():
            with torch.inference_mode():
                tok = state["tok"]
                for _ in range(args.decode_steps):
                    tok = runner.next_token(tok.view(1, 1), state["cache"], greedy, None)
                state["tok"] = tok

        if topo.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(topo.device)
        times = timed(prefill, topo.device, args.repeats, args.warmup, barrier=topo.barrier)
        chunk = args.prefill_chunk or (runner.default_chunk(L) if hasattr(runner, "default_chunk") else None)
        row = {"length": L, "prefill_chunk": chunk, "prefill_seconds": statistics.median(times),
               "prefill_all_seconds": times, "prefill_tokens_per_second": L / statistics.median(times)}
        if args.decode_steps:
            dtimes = timed(decode, topo.device, args.repeats, warmup=1, barrier=topo.barrier)
            t = statistics.median(dtimes)
            row.update(decode_steps=args.decode_steps, decode_seconds=t, decode_all_seconds=dtimes,
                       decode_tokens_per_second=args.decode_steps / t, decode_step_ms=1e3 * t / args.decode_steps)
        row["peak_memory_gib"] = peak_memory_gib(topo)
        result["results"].append(row)
        if lead:
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.out:
                save_json(args.out, result)
        state.clear()
        runner.end_generation()  # drop the decode graph (it holds the cache and captured collectives)
    if lead:
        print(json.dumps(result))
    if dist.is_initialized():
        topo.barrier()
        dist.destroy_process_group()
    return 0
