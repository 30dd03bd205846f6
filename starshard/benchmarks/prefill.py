"""End-to-end prefill (+ decode steps) of one context strategy, the model and runner built by
starshard.LLM (the runner chosen in llm.choose_runner, random weights seeded in checkpoints/sources.py).

    python launch/bench.py prefill --random-weights llama-3.1-8b --cp-strategy dense --lengths 8192,32768 --out r.json
    torchrun --nproc-per-node 2 launch/bench.py prefill --cp 2 --cp-strategy ring --random-weights llama-3.1-8b ...
    torchrun --nproc-per-node 4 launch/bench.py prefill --tp 2 --cp 2 --fp8 linear,kv --random-weights llama-3.1-70b ...
    python launch/bench.py prefill --tp 4 --cp-strategy dense --random-weights llama-3.1-70b --lengths 131072 --plan-only
    python launch/bench.py prefill --prompt-file essay.txt --sparse minference --lengths 131072   # the embedded SmolLM2

Per length: the prefill (--warmup untimed, then the median of --repeats; the local runner runs the model
on the whole prompt, logits for the last token only; a context strategy's runner its prefill_logits with
the last --query-tokens as the query), then --decode-steps single-token steps as LLM.generate runs them
(runner.next_token, from a CUDA graph unless --no-cuda-graphs). MFU is against a bf16 matmul peak
measured in the same process; model_seconds is the strategy's FLOP model at that peak (split over tp).
`flop_model` is the layout's FLOP model read at rates measured in the same process (benchmarks/rates.py):
the GEMM FLOPs of this rank at the GEMM rate of the model's own projection shapes (the FP8 GEMM with
--fp8 linear), its attention FLOPs at the causal attention rate of its heads and rows, and its tp
all-reduce bytes (two per layer of rows x hidden) at the measured all-reduce rate; `measured_over_flop_model`
is the ratio. `memory_plan` is the planner's per-rank plan of each length (as `starshard plan --json`;
--plan-only prints it and loads nothing). With --sparse,
`sparse_report` is what the method ran in the last timed prefill (kernels.sparse.SparseReport: heads
run sparse and the density they kept, heads the cost model sent to the dense kernel, heads of calls
below the minimum length).

Windows (issue 38): a model with sliding-window layers (Gemma 2 / 3, `--random-weights gemma-3-4b`)
runs them; on one device (--cp-strategy dense) the cache is the engine's trimmed one (local layers keep
their last window keys, engine/kv_cache.py), as LLM.generate runs it. `--all-global` then times the same
weights with every layer global (Transformer.drop_windows) in the same process, after the windowed
lengths, and each row gets `speedup` (all-global seconds / windowed seconds), the FLOP model's
`predicted_speedup` (strategies/flops.py prefill_flops, windows vs none) and `speedup_over_predicted`.
Each windowed row also gives `kv_per_token`: the planner's KV bytes per token of one device's trimmed
cache against the all-global one, and `kv_cache`: the bytes the timed run's cache allocated. Over a
ring (--cp N --cp-strategy ring) `ring_bytes` splits the K/V bytes the whole CP group sent in one
prefill by layer kind: per local layer, per global layer, and their ratio.

New lengths (`--fresh N`): the timed runs above repeat the warm-up's length, so every shape is warm; a served
prompt or a harness sample is nearly always a length unequal to any warm-up, and its first run meets new shapes
(a cuDNN plan each, ~35-68 ms). After each length, N lengths drawn from the 1/16 below it run twice each;
`fresh_first_over_second` is the median first / second.

GPU idle time (`--idle`): one more prefill per length under torch.profiler, recording the device only;
`device_idle` is its busy time (the union of kernels, copies and sets), its idle time between the first and the
last of them (`idle_s`, `gaps`) and the longest gaps with the kernels either side: where the host made the GPU
wait (a launch-bound stretch, a sync). The profiler slows the host's launches a little, so idle reads high, never low.

Inputs: random token ids by default; `--prompt-file PATH` instead tokenizes a natural-text file with
the model's tokenizer and repeats it (a blank line between copies) or truncates it to each length; the
JSON names the file and, per length, whether it was repeated. Random weights (and random token ids)
are fine for dense and context-parallel speed, whose work does not depend on the values, but never
for sparse speed: a sparse method's work is set by the attention pattern, and random weights have
none (every head is dense-like and falls back), so measure --sparse with --model real weights and
--prompt-file natural text. `bench/make_essay.py` writes the harness's essay-like filler to a file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch

from starshard.benchmarks.common import (add_common_arguments, back_to_back, copy_bandwidth, device_idle, header,
                                        median, nominal_hbm_bandwidth, timed, write)
from starshard.benchmarks.rates import allreduce_rate, attention_rate, gemm_rate, probe_rows
from starshard.checkpoints.rope import with_rope_scaling
from starshard.cli import (add_fp8_arguments, add_rope_scaling_argument, add_sparse_arguments, add_strategy_arguments,
                           fp8_config, layout_error, parallel_config, plan_features, plan_layout,
                           sparse_config)
from starshard.config import SamplingConfig
from starshard.kernels.sparse import sparse_report
from starshard.llm import LLM
from starshard.parallel.topology import LayoutError
from starshard.planner import Layout, Workload, plan_json, plan_memory, usable_bytes
from starshard.presets import preset_config
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.strategies import CP_DEFAULT, SINGLE_RANK, STRATEGIES, get_spec
from starshard.strategies.flops import linear_flops_per_token, predicted_seconds, prefill_flops, tp_flops

HELP = "end-to-end prefill (+ decode steps) of one strategy"


def matmul_peak(device, dtype=torch.bfloat16, n: int = 8192) -> float:
    """Measured dense matmul FLOP/s (the MFU denominator)."""
    if device.type != "cuda":
        n = 1024
        dtype = torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = statistics.median(timed(lambda: a @ b, device, 10, 3))
    return 2 * n**3 / t


def all_global(cfg):
    """The same shape with every layer global (what --all-global's baseline runs)."""
    return dataclasses.replace(cfg, sliding_window=None, layer_types=None)


def kv_per_token(cfg, L: int, dtype_bytes: int) -> dict:
    """The planner's KV bytes per token of an L-token prompt on one device: local layers trimmed to their
    window (planner.layer_kv_tokens, as the engine allocates them) against every layer keeping every key."""
    trimmed, full = (plan_memory(cfg, Layout(), Workload(prompt_tokens=L, dtype_bytes=dtype_bytes, trim_local=t))
                     .stages[0].kv_cache / L for t in (True, False))
    return {"windowed_trimmed": trimmed, "all_global": full, "ratio": trimmed / full}


def ring_bytes(strategy, cfg, device, windowed: bool) -> dict:
    """K/V bytes the whole CP group sent in the last prefill, per local and per global layer (each rank
    counts its sends on the host, wire.py; summed here, after the timing)."""
    sent = torch.tensor([strategy.wire.kv_bytes, strategy.wire.local_kv_bytes], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(sent, group=strategy.group)
    total, local = sent.tolist()
    n_local = sum(cfg.layer_window(i) is not None for i in range(cfg.num_layers)) if windowed else 0
    n_global = cfg.num_layers - n_local
    lp = local / n_local if n_local else None
    gp = (total - local) / n_global if n_global else None
    return {"local_per_layer": lp, "global_per_layer": gp, "ratio": lp / gp if lp is not None and gp else None,
            "local_layers": n_local, "global_layers": n_global, "summed_over_ranks": strategy.cp}


def layout_flops(cfg, strategy, L: int, context: int, tp: int = 1, dtype_bytes: int = 2):
    """(per-rank PrefillFlops of this layout, serial): the strategy's FLOP model (its registry entry's
    prefill_flops) split over tp (flops.tp_flops); serial when one device runs the hosts in turn (study
    mode). strategy None: the whole model on one CP rank (dense)."""
    if strategy is None:
        ranks, cp = get_spec(SINGLE_RANK).prefill_flops(cfg, L, context, None), 1
    else:
        ranks, cp = get_spec(strategy.name).prefill_flops(cfg, L, context, strategy), strategy.cp
    return tp_flops(cfg, ranks, tp, dtype_bytes), cp == 1 and len(ranks) > 1


def model_seconds(cfg, strategy, L: int, context: int, peak: float, tp: int = 1) -> float:
    """The layout's FLOP model of this prefill at the measured matmul peak: the slowest rank, or the sum
    over hosts in study mode (collectives not counted)."""
    ranks, serial = layout_flops(cfg, strategy, L, context, tp)
    return predicted_seconds(ranks, peak, serial=serial)


def flop_model(cfg, strategy, L: int, context: int, tp: int, dtype_bytes: int, rates: dict) -> dict:
    """The layout's FLOP model read at the measured rates (benchmarks/rates.py), the slowest rank's parts."""
    ranks, serial = layout_flops(cfg, strategy, L, context, tp, dtype_bytes)
    g, a, ar = rates["gemm_flops_per_s"], rates["attention_flops_per_s"], rates["allreduce_bytes_per_s"]
    slow = max(ranks, key=lambda r: r.seconds(g, a, ar))
    return {"seconds": predicted_seconds(ranks, g, a, serial=serial, allreduce_bytes_per_s=ar),
            "gemm_seconds": (slow.linear + slow.compressor) / g, "attention_seconds": slow.attention / a,
            "allreduce_seconds": slow.tp_bytes / ar if ar and slow.tp_bytes else 0.0,
            "gemm_flops": slow.linear + slow.compressor, "attention_flops": slow.attention,
            "allreduce_bytes": slow.tp_bytes, "rates": rates}


def memory_plan(cfg, args, L: int, context_len: int | None, query_phase: bool, limit: int | None) -> dict:
    """The planner's per-rank plan of this run (its cache holds L + decode steps + 8 tokens)."""
    study = args.num_blocks is not None or args.apb_hosts is not None  # cp = 1: N blocks / hosts in turn
    # one CP rank outside a study: the whole sequence's plan
    strategy = args.cp_strategy if args.cp > 1 or study else SINGLE_RANK
    lay = plan_layout(args, strategy)
    work = Workload(L, context_len if query_phase else None, args.decode_steps + 8, None, 4 if args.dtype == "float32"
                    else 2, **plan_features(args))
    return plan_json(plan_memory(cfg, lay, work), limit, None)


def decode_bound(model, cache, device, step_seconds: float) -> dict:
    """A decode step's bytes bound: this rank's weights (the embedding table aside: one row is read) and
    its KV as stored (FP8: e4m3 bytes and their scales), over the card's nominal bandwidth and over the
    read rate of one large copy measured now (half its read-and-write bandwidth)."""
    embed, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    skip = {id(p) for p in embed.parameters()} if embed is not None else set()
    skip -= {id(p) for p in head.parameters()} if head is not None else set()  # tied: the head reads it all
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    weights += sum(b.numel() * b.element_size() for b in model.buffers() if b.dim() >= 2)  # FP8 weights kept as buffers
    kv = 0
    for layer in cache.layers.values():
        s = layer.stored()
        kv += sum(t.numel() * t.element_size() for t in (s.k, s.v, s.k_scale, s.v_scale) if t is not None)
    out = {"weight_bytes": weights, "kv_bytes": kv}
    nominal, copy = nominal_hbm_bandwidth(device), copy_bandwidth(device)
    rate = copy / 2 if copy else None
    if nominal:
        out |= {"bytes_bound_s": (weights + kv) / nominal, "step_over_bound": step_seconds / ((weights + kv) / nominal)}
    if rate:
        out |= {"copy_read_bytes_per_s": rate, "step_over_copy_bound": step_seconds / ((weights + kv) / rate)}
    return out


def add_arguments(p) -> None:
    add_common_arguments(p)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: heads and MLP columns split over this many ranks; composes with --cp "
                   "(launch tp*cp ranks; tp groups are consecutive ranks); --tp N with --cp 1 needs --cp-strategy dense")
    p.add_argument("--plan-only", action="store_true",
                   help="print the planner's per-rank memory plan of each length as JSON (and write --out) and exit, "
                   "loading nothing (no launcher needed); --memory-limit-gb sets the limit it is checked against")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="the per-rank limit the memory plan is checked against (default: 90%% of this GPU; none on CPU)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed prefills per length before the timed ones (0 at long lengths: list a short "
                        "length first to warm the process up instead)")
    p.add_argument("--fresh", type=int, default=0, metavar="N",
                   help="after each length, N prefills at lengths drawn (--fresh-seed) from the 1/16 below it, none "
                        "run before in this process, each timed twice: its first run meets new shapes (cuDNN plans, "
                        "compiles) as a prompt unequal to any warm-up does, its second is warm; the row gets `fresh` "
                        "and `fresh_first_over_second` (median; 1.0: a new length costs nothing extra)")
    p.add_argument("--fresh-seed", type=int, default=0, help="seed of the --fresh lengths")
    p.add_argument("--idle", action="store_true",
                   help="after each length's timed runs, one more prefill under torch.profiler (the device's "
                        "activity only): the row gets `device_idle`, the GPU's busy and idle seconds within that "
                        "prefill, its gaps and the longest with the kernels either side (host launches and syncs "
                        "show as idle). CUDA only")
    p.add_argument("--random-weights", default=None,
                   help="preset name (llama-3.1-8b, tiny) or config.json: fine for dense and CP speed, never for "
                   "sparse speed (no attention structure: every head is dense-like; use --model and --prompt-file)")
    p.add_argument("--model", default=None,
                   help="real checkpoint instead of --random-weights (neither: the embedded SmolLM2, as `bench.py serve`)")
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="natural text, tokenized with --model's tokenizer and repeated (blank line between copies) or "
                   "truncated to each length; the JSON names the file and whether it was repeated (default: random "
                   "token ids). Sparse speed needs natural text; `python bench/make_essay.py --out FILE` writes the "
                   "harness's essay-like filler")
    p.add_argument("--cp-strategy", default=CP_DEFAULT, choices=STRATEGIES,
                   help=f"context strategy (default {CP_DEFAULT}, at --cp 1 too)")
    add_strategy_arguments(p, p, without=("query_rank",))  # the query is the last --query-tokens
    p.add_argument("--query-tokens", type=int, default=64, help="star: prompt tokens treated as the query")
    add_sparse_arguments(p)
    add_fp8_arguments(p)
    add_rope_scaling_argument(p)
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps timed after the prefill (0 = none)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="time decode steps eagerly (default: replay a CUDA graph on one rank)")
    p.add_argument("--all-global", action="store_true",
                   help="a model with sliding-window layers: after the windowed lengths, time the same weights with "
                   "every layer global in the same process (the baseline); each row gets speedup, the FLOP model's "
                   "predicted_speedup and speedup_over_predicted")


def check(args) -> str | None:
    if args.prompt_file is not None and args.random_weights:
        return "--prompt-file needs --model PATH or the embedded SmolLM2 (no --random-weights): a real tokenizer reads the text"
    if args.prompt_file is not None and not Path(args.prompt_file).is_file():
        return f"--prompt-file {args.prompt_file} does not exist"
    if args.tp < 1:
        return f"--tp must be >= 1, got {args.tp}"
    if args.fresh < 0:
        return f"--fresh must be >= 0, got {args.fresh}"
    if args.idle and (str(args.device).startswith("cpu") or not torch.cuda.is_available()):
        return "--idle measures a GPU's idle time within a prefill (torch.profiler's CUDA trace): drop it on the CPU"
    if args.fresh and (short := [L for L in args.lengths if max(1, L // 16) - len(args.lengths) < args.fresh]):
        return (f"--fresh {args.fresh} draws that many new lengths from the 1/16 below each length; {short[0]} "
                f"has too few: give longer --lengths or a smaller --fresh")
    if args.tp > 1 and args.cp == 1 and not get_spec(args.cp_strategy).single_rank:
        return (f"--tp {args.tp} with --cp 1 runs the model-parallel runner: pass --cp-strategy {SINGLE_RANK} (got "
                f"{args.cp_strategy}, a context strategy's study mode, which this benchmark runs on one rank only)")
    return layout_error(args)


def text_ids(tokenizer, path: str) -> list[int]:
    """Token ids of one copy of the text, the blank line that separates copies included."""
    if tokenizer is None:
        raise SystemExit("error: --prompt-file needs a tokenizer, and the checkpoint has none")
    text = Path(path).read_text(encoding="utf-8").strip()
    ids = tokenizer.encode(text + "\n\n", add_special_tokens=False)
    if not text or not ids:
        raise SystemExit(f"error: --prompt-file {path} holds no text")
    return ids


def prompt_ids(L: int, vocab_size: int, text: list[int] | None) -> list[int] | torch.Tensor:
    """The benchmark's L prompt tokens: the text repeated or truncated, else random ids seeded by L."""
    if text is not None:
        return (text * math.ceil(L / len(text)))[:L]
    gen = torch.Generator(device="cpu").manual_seed(L)
    return torch.randint(0, vocab_size, (L,), generator=gen)


def run(args) -> None:
    # The layout fields parallel_config reads that prefill leaves at their defaults (tensor / pipeline
    # parallel runs: `launch/bench.py tp`).
    layout = argparse.Namespace(**vars(args), pp=1, pp_layers=None, query_rank=None)
    try:
        parallel, sparse = parallel_config(layout), sparse_config(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.plan_only:
        return plan_only(args, device)
    try:
        llm = LLM(None if args.random_weights else args.model, dtype=dtype, device=device, parallel=parallel,
                  progress=False, random_weights=args.random_weights, sparse=sparse, fp8=fp8_config(args),
                  cuda_graphs=not args.no_cuda_graphs, rope_scaling=args.rope_scaling)
    except (LayoutError, ValueError) as e:  # a layout this model or strategy refuses: the message says what to change
        raise SystemExit(f"error: {e}") from None
    topo, runner, model, cfg = llm.topology, llm.runner, llm.model, llm.config
    cp_runner = isinstance(runner, ContextParallelRunner)  # a context strategy (any cp), else the local runner
    windowed = any("window" in layer.attention.extras for layer in model.layers)  # what runs, not the config
    if args.all_global and not windowed:
        raise SystemExit(f"error: --all-global needs a model whose sliding-window layers run (config sliding_window / "
                         f"layer_types); this {cfg.arch} runs every layer global already: drop --all-global")
    strategy = runner.strategy if cp_runner else None
    peak = matmul_peak(topo.device)
    barrier = topo.barrier if topo.world_size > 1 else None
    fp8 = llm.fp8
    probe = probe_rows(topo.device)
    rates = {"gemm_flops_per_s": gemm_rate(cfg, topo.tp, probe, dtype, topo.device, fp8.linear),
             "allreduce_bytes_per_s": allreduce_rate(cfg, probe, dtype, topo.device,
                                                     topo.tp_group if topo.tp > 1 else None, barrier),
             "gemm": "fp8 e4m3" if fp8.linear else args.dtype, "gemm_rows": probe}
    limit = _limit(args, topo.device)
    text = text_ids(llm.tokenizer, args.prompt_file) if args.prompt_file else None
    if args.sparse and (args.random_weights or text is None) and topo.rank == 0:
        print("note: --sparse on random weights or random token ids measures the fallback, not sparse speed "
              "(use --model real weights and --prompt-file natural text)", file=sys.stderr)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()

    ran = set(args.lengths)  # lengths that --fresh must not draw
    draw = random.Random(args.fresh_seed)

    def measure(L: int, win: bool) -> dict:
        """One length's row: the prefill timed (+ decode), as the model runs now (win: with its windows)."""
        fcfg = cfg if win else all_global(cfg)  # the FLOP model of what runs
        context_len = L - args.query_tokens
        state = {}

        def prefill_of(n: int):
            ids = torch.as_tensor(prompt_ids(n, cfg.vocab_size, text)).to(topo.device)

            def prefill():
                sparse_report(model, reset=True)  # count this prefill alone
                if strategy is not None:
                    strategy.wire.reset()  # K/V bytes this rank sends in this prefill
                state["cache"] = None  # the previous cache freed before the next one is allocated
                if cp_runner:
                    state["cache"] = cache = runner.new_cache(n + args.decode_steps + 8)
                else:  # local layers keep their window (engine/kv_cache.py), as LLM.generate runs them
                    state["cache"] = cache = runner.new_cache(n + args.decode_steps + 8, n, n, trim_local=True)
                with torch.inference_mode():
                    if cp_runner:
                        state["logits"], state["owner"] = runner.prefill_logits(ids, n - args.query_tokens, cache)
                    else:
                        state["logits"] = model(ids[None], cache=cache, last_only=True)
            return prefill

        def fresh() -> dict:
            """--fresh: lengths unequal to any run before, each timed cold (its first run) and warm."""
            free = [n for n in range(L - max(1, L // 16), L) if n not in ran]
            if len(free) < args.fresh:
                raise SystemExit(f"error: --fresh {args.fresh}: only {len(free)} lengths below {L} are new; give a "
                                 f"smaller --fresh or lengths further apart")
            out = []
            for n in draw.sample(free, args.fresh):
                ran.add(n)
                first, second = timed(prefill_of(n), topo.device, 2, warmup=0, barrier=barrier)
                out.append({"length": n, "first_seconds": first, "second_seconds": second})
            return {"fresh": out, "fresh_first_over_second": median([r["first_seconds"] / r["second_seconds"]
                                                                     for r in out])}

        prefill = prefill_of(L)
        try:
            if topo.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(topo.device)
            times = timed(prefill, topo.device, args.repeats, warmup=args.warmup, barrier=barrier)
            report = sparse_report(model)  # the last timed prefill's (None without --sparse)
            mem = torch.cuda.max_memory_allocated(topo.device) / 2**30 if topo.device.type == "cuda" else None
            idle = device_idle(prefill, topo.device) if args.idle else None  # one more, after the report's
            cache = state["cache"]
            kv = {"trimmed": cache.trimmed, "bytes": sum(kv.nbytes() for kv in cache.layers.values())}
            kv["bytes_per_token"] = kv["bytes"] / L  # this rank's cache (a CP rank: its shard)
            decode = None
            if args.decode_steps:
                tok = torch.zeros(1, 1, dtype=torch.long, device=topo.device)

                def step():  # one generated token, as LLM.generate runs it (CUDA graphs on one GPU)
                    with torch.inference_mode():
                        runner.next_token(tok, state["cache"], SamplingConfig(), None)

                step_times = timed(step, topo.device, args.decode_steps, warmup=2)
                decode = {"step_seconds": median(step_times), "tokens_per_second": 1 / median(step_times),
                          # steps queued as a serving loop queues them: the device's idle time between steps
                          "back_to_back": back_to_back(step, topo.device, args.decode_steps)}
                decode.update(decode_bound(model, state["cache"], topo.device, median(step_times)))
            t = median(times)
            fl = prefill_flops(fcfg, L)
            row = {"length": L, "prefill_seconds": t, "all_seconds": times, "peak_memory_gib": mem,
                   "model_tflops": fl["total"] / 1e12, "achieved_tflops_per_gpu": fl["total"] / t / topo.world_size / 1e12,
                   "mfu": fl["total"] / t / topo.world_size / peak, "decode": decode, "kv_cache": kv}
            if report is not None:
                row["sparse_report"] = report
            if idle is not None:
                row["device_idle"] = idle
            if strategy is not None and strategy.cp > 1:
                row["kv_bytes_sent"] = strategy.wire.kv_bytes  # by this rank in one prefill (context/wire.py)
                if get_spec(strategy.name).ring_kv:
                    row["ring_bytes"] = ring_bytes(strategy, cfg, topo.device, win)
            if text is not None:
                row["prompt_repeated"] = L > len(text)
            query_phase = strategy is not None and strategy.query_phase
            context = context_len if query_phase else L
            model_t = model_seconds(fcfg, strategy, L, context, peak, topo.tp)
            if model_t:  # the FLOP model at the matmul peak: what a strategy that wastes nothing takes
                row.update(model_seconds=model_t, measured_over_model=t / model_t)
            a_rows = -(-L // args.cp)  # this rank's query rows (capped on the CPU, where it only fills the JSON)
            a_rows = a_rows if topo.device.type == "cuda" else min(a_rows, probe)
            lr = {**rates, "attention_flops_per_s": attention_rate(cfg, topo.tp, a_rows, dtype, topo.device),
                  "attention_rows": a_rows}
            fm = flop_model(fcfg, strategy, L, context, topo.tp, torch.finfo(dtype).bits // 8, lr)
            row.update(flop_model=fm, measured_over_flop_model=t / fm["seconds"],
                       memory_plan=memory_plan(cfg, args, L, context_len, query_phase, limit))
            if args.fresh:
                row.update(fresh())
            if win and windowed:
                row["all_global_tflops"] = prefill_flops(cfg, L, windows=False)["total"] / 1e12
                row["predicted_speedup"] = row["all_global_tflops"] / row["model_tflops"]
                row["kv_per_token"] = kv_per_token(cfg, L, dtype_bytes)
        except torch.OutOfMemoryError as e:
            row = {"length": L, "error": f"out of memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
        state.clear()
        runner.end_generation()  # drop the decode graph with this length's cache
        if topo.rank == 0:
            print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    rows = [measure(L, windowed) for L in args.lengths]
    if args.all_global:
        model.drop_windows()  # every local layer attends as a global one from here on
        for row in rows:
            base = row["all_global"] = measure(row["length"], False)
            if "prefill_seconds" in row and "prefill_seconds" in base:
                row["speedup"] = base["prefill_seconds"] / row["prefill_seconds"]
                row["speedup_over_predicted"] = row["speedup"] / row["predicted_speedup"]
                row["kv_cache_over_all_global"] = row["kv_cache"]["bytes"] / base["kv_cache"]["bytes"]
    result = header("prefill", topo.device, topo.world_size, args)
    result["sparse_config_file"] = llm.sparse.config_path if llm.sparse is not None else None  # the one that ran
    result["prompt"] = ({"kind": "text file", "file": args.prompt_file, "file_tokens": len(text),
                         "repeated_at": [L for L in args.lengths if L > len(text)]} if text is not None else
                        {"kind": "random token ids", "seed": "the length"})
    result["weights"] = "random" if args.random_weights else "real"
    result["checkpoint"] = str(llm.path) if llm.path is not None else None  # the embedded default's when no --model
    result.update(strategy=parallel.cp_strategy, cp=args.cp, tp=topo.tp, fp8=llm.fp8.describe(),
                  matmul_peak_tflops=peak / 1e12, windows=windowed, results=rows)
    if topo.rank == 0:
        write(args.out, result)


def _limit(args, device) -> int | None:
    """The per-rank byte limit the memory plan is checked against (--memory-limit-gb, else 90% of the GPU)."""
    if args.memory_limit_gb is not None:
        return int(args.memory_limit_gb * 2**30)
    if torch.device(device).type == "cuda":
        return usable_bytes(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return None


def plan_only(args, device) -> None:
    """--plan-only: the memory plan of every length, nothing loaded."""
    if args.random_weights is None:
        raise SystemExit("error: --plan-only needs --random-weights PRESET (the shape to plan)")
    try:
        cfg = with_rope_scaling(preset_config(args.random_weights), args.rope_scaling)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    query_phase = args.cp > 1 and not get_spec(args.cp_strategy).exact  # Star / APB: the query runs after
    plans = []
    for L in args.lengths:
        try:
            plans.append({"length": L, **memory_plan(cfg, args, L, L - args.query_tokens, query_phase,
                                                     _limit(args, device))})
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    write(args.out, {"kind": "prefill_plan", "model": args.random_weights, "tp": args.tp, "cp": args.cp,
                     "strategy": args.cp_strategy, "fp8": args.fp8, "plans": plans})
