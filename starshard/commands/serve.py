"""starshard as a service: an OpenAI-compatible HTTP server over the whole parallel group.

    python launch/serve.py                                              # embedded SmolLM2, CPU, 127.0.0.1:8000
    python launch/serve.py --model CKPT --port 8000 --cache-gib 40
    torchrun --nproc-per-node 4 launch/serve.py --model CKPT --cp 4 --cp-strategy star --port 8000
    sbatch --nodes 1 --ntasks-per-node 4 --gpus-per-node 4 launch/slurm/serve.sbatch --model CKPT --cp 4

Global rank 0 runs the HTTP front end and the scheduler; every rank executes the same engine steps,
broadcast from rank 0. The model and the documents' KV stay resident: a request whose prompt begins
with an already prefilled prompt (another question on the same document, a follow-up turn) runs only
the rest (`usage.prompt_tokens_details.cached_tokens` says how many came from the cache), and
concurrent requests on one document decode together. SIGTERM / SIGINT stop the server gracefully: with
--disk-cache-dir, every rank first writes the cache entries not on disk yet (--shutdown-write-s), then the
process exits 0. See docs/serving.md.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from starshard.cli import (HelpFormatter, add_fp8_arguments, add_layout_arguments, add_rope_scaling_argument,
                           add_sparse_arguments, fp8_config, layout_error, log_handler, parallel_config, plan_features,
                           sparse_config)
from starshard.checkpoints.load import CheckpointError
from starshard.llm import LLM
from starshard.parallel.topology import LayoutError, collective_failure, ranks_per_node, read_launch_env
from starshard.planner import DTYPE_BYTES, GRAPH_POOL_BYTES, GiB, Layout, Workload, cache_budget
from starshard.runconfig import parse_with_config
from starshard.serving.disk_read import DEFAULT_READERS
from starshard.serving.disk_tier import DiskTierLocked
from starshard.serving.executor import TABLE_STORE_BYTES
from starshard.serving.reload_policy import POLICIES
from starshard.serving.scheduler import Scheduler, default_prefill_chunk
from starshard.serving.tiers import (DISK_DEFAULT_CAP, DISK_FREE_SHARE, HOST_DEFAULT_RAM_SHARE, SHUTDOWN_WRITE_S,
                                     TierConfig, default_disk_budget, default_host_bytes, memory_available)
from starshard.serving.warmup import RanksDisagree
from starshard.server.app import STOP_SIGNALS, create_app, make_server, port_error
from starshard.server.settings import API_KEY_ENV, SHUTDOWN_GRACE_S, ServerSettings

log = logging.getLogger("starshard.serve")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Serve a model over an OpenAI-compatible HTTP API (chat / completions, streaming, /v1/models, "
        "/health, /metrics). With no --model, serves the embedded SmolLM2-135M-Instruct.",
        formatter_class=HelpFormatter)
    ap.add_argument("--model", default=None,
                    help="starshard checkpoint dir, Hugging Face model dir, or .gguf file (default: embedded "
                    "SmolLM2-135M-Instruct)")
    ap.add_argument("--random-weights", default=None, metavar="CONFIG",
                    help="no checkpoint: random weights of this shape (a preset name or a config.json); there is no "
                    "tokenizer then, so only /v1/completions with token-id prompts works (benchmarks)")
    http = ap.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind; the default answers this machine only (use 0.0.0.0 to expose it, with "
                      "--api-key)")
    http.add_argument("--port", type=int, default=8000,
                      help="TCP port (0 = any free port; the bound one is printed). A port already in use is reported "
                      "before the model loads (exit 2)")
    http.add_argument("--api-key", default=None,
                      help=f"require 'Authorization: Bearer KEY' on every API request (default: ${API_KEY_ENV}, else "
                      "none); /health and /metrics stay open")
    http.add_argument("--served-model-name", default=None,
                      help="the model id clients send and /v1/models lists (default: the model dir's name)")
    http.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted (413 above)")
    http.add_argument("--max-tokens-limit", type=int, default=4096,
                      help="most completion tokens one request may ask for (400 above)")
    http.add_argument("--log-prompts", action="store_true", help="log request prompts (off: documents are private)")
    http.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                      help="server and engine log level (rank 0)")
    eng = ap.add_argument_group("engine")
    eng.add_argument("--cache-gib", type=float, default=None,
                     help="context cache budget per rank in GiB: prefilled documents' KV kept for follow-up requests, "
                     "evicted least-recently-used. Default on CUDA: what the memory plan leaves on the worst rank, "
                     "logged at start: 90%% of the GPU, less the weights, the largest step's working set (one "
                     "--prefill-chunk chunk, split over --cp; a whole window-long prompt when unchunked; an extend of "
                     "up to --max-extend tokens; a decode step of --max-batch rows) and 1.5 GiB for the decode CUDA "
                     "graphs (their memory pools and the kept graphs' own-KV stores; none with --no-cuda-graphs); "
                     "on CPU 2 GiB")
    eng.add_argument("--max-batch", type=int, default=16, help="requests decoding together (one forward per step)")
    eng.add_argument("--max-queue", type=int, default=64,
                     help="requests waiting beyond the batch; more are answered 429")
    eng.add_argument("--no-cuda-graphs", action="store_true",
                     help="run every batched decode step eagerly (default on CUDA: a batch on one document replays "
                     "the CUDA graph kept for its size, rebound when a request joins or leaves; other batches capture "
                     "one at their first step and replay it until a request joins or leaves)")
    eng.add_argument("--max-extend", type=int, default=4096,
                     help="a prompt that shares a cached prefix runs only the rest when the rest is at most this many "
                     "tokens and no longer than the shared part; otherwise the whole prompt is prefilled and cached")
    eng.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                     help="prompt tokens one prefill step runs, counted over the whole prompt (a CP group splits each "
                     "chunk over its ranks); between a new document's chunks the running requests take a decode step, "
                     "so no stream stalls for a whole prefill. 0: the whole prompt in one step (default: 4096 x cp on "
                     "CUDA, 0 on CPU; APB always prefills whole). Smaller chunks shorten the other streams' longest "
                     "gap and cost prefill time: on one H200 an 8B model's 128K prefill in the default tapered 4096-token "
                     "chunks (--prefill-taper) took 1.05-1.09x the whole prompt's time, with other streams' p99 gaps of "
                     "0.39-0.47 s (6144 / 8192-token chunks: p99 0.60 / 0.78 s)")
    eng.add_argument("--prefill-taper", action=argparse.BooleanOptionalAction, default=True,
                     help="later chunks of a document take fewer tokens as the prefix before them grows (a chunk's "
                     "attention grows with it), so that no step costs more than about twice the first: full chunks up "
                     "to the model's knee (the prefix at which a token's attention FLOPs over the global layers equal "
                     "its linear FLOPs, ~26K tokens for Llama-3.1-8B; x cp over a CP group, whose steps also pay fixed "
                     "collectives), then chunk x 2 knee / (knee + prefix) tokens, in units of 256 x cp. "
                     "--no-prefill-taper: every chunk --prefill-chunk tokens (default: on)")
    eng.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                     help="before taking requests, run every kernel shape the service will use once (the longest "
                     "admitted document's prefill steps, decode batch sizes 1..--max-batch eager and as CUDA graphs) "
                     "on the model cut to one layer of each kind, so no stream's inter-token gap pays a first use "
                     "(Triton compilation, CUDA-graph capture, cuDNN plans: seconds each on a GPU); its seconds are "
                     "logged and in the engine's stats (warmup_s). A failed warm-up is logged and the server "
                     "serves cold. Default: on with CUDA, off on CPU")
    eng.add_argument("--window-trim", action=argparse.BooleanOptionalAction, default=True,
                     help="sliding-window models (Gemma 2/3, windowed Mistral/Qwen2): once a document is prefilled, "
                     "each local layer of its cache entry keeps only the last window - 1 keys of the document (and "
                     "the question after it); the global layers keep every key. A long document's entry then takes a "
                     "fraction of the memory (Gemma 3: about 1/6), but serves only prompts that share all of the "
                     "document (follow-up questions on it); a prompt sharing only part of it is prefilled. "
                     "--no-window-trim: keep every key, so any shared prefix is reused. The --host-cache-gib / "
                     "--disk-cache-dir tiers keep trimmed entries as they are (default: on)")
    eng.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="a request still running this long after it arrived ends with an error (code "
                     "request_timeout) and its memory is freed, also in the middle of its prefill (default: no limit)")
    tiers = ap.add_argument_group("context cache tiers (per rank; each rank moves only its own shard)")
    tiers.add_argument("--host-cache-gib", type=float, default=None, metavar="GiB",
                       help="pinned host memory for cache entries the device budget evicts: they move here (least "
                       "recently used first) instead of being dropped, and a prompt on such a document copies its KV "
                       "back instead of prefilling it again. Default: with --disk-cache-dir on a GPU, one device "
                       "budget (at most %d%%%% of the memory available, split over the node's ranks), so that a shard "
                       "leaving the device for disk is staged page-locked (~0.3 s for a 17 GB shard) instead of "
                       "copied inside a step through ordinary memory (~10 s, every stream waiting); else 0. 0: off"
                       % round(100 * HOST_DEFAULT_RAM_SHARE))
    tiers.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                       help="a directory (created 0700; one per node, or one on a shared filesystem) for entries that "
                       "leave the host tier (or the device, without one): written as files per rank, found again "
                       "after a restart; bound to the model, dtype, FP8 parts and layout, so another model reuses "
                       "nothing. A second server on the same directory refuses to start. `starshard cache list|purge` "
                       "shows and removes the files. Its budget: --disk-cache-gib")
    tiers.add_argument("--shutdown-write-s", type=float, default=SHUTDOWN_WRITE_S, metavar="SECONDS",
                       help="graceful shutdown (SIGTERM, SIGINT; under torchrun, SIGTERM or SIGINT to torchrun, which "
                       f"passes it to every rank): the server stops taking requests and gives those in flight "
                       f"{SHUTDOWN_GRACE_S:g} s (then they end with 503); with --disk-cache-dir every rank then "
                       "writes its shard of the cache entries held only on the device or in the host tier to disk, "
                       "most recently used first and within --disk-cache-gib, for at most this long, so that a restart "
                       "on the same directory serves them from disk (progress is logged); then the server exits 0. "
                       "0: write nothing down. torchrun kills its workers 30 s after it passed the signal on unless "
                       "started with --shutdown-timeout SECONDS above this (default: %(default)g)")
    tiers.add_argument("--disk-cache-gib", type=float, default=None, metavar="GiB",
                       help=f"the disk tier's budget per rank: least recently used files are removed beyond it "
                       f"(default: {DISK_FREE_SHARE * 100:g}%% of the free space of --disk-cache-dir's filesystem at "
                       f"start, split over the launch's ranks, at most {DISK_DEFAULT_CAP / GiB:g} GiB per rank; "
                       "logged)")
    tiers.add_argument("--disk-reload-policy", choices=POLICIES, default="auto",
                       help="when a prompt's prefix is found in the disk tier: auto (default) reloads it only while "
                       "the reload is expected to take no longer than prefilling it again, both estimated from this "
                       "server's measured reloads (seconds per byte) and prefills (seconds per FLOP), kept in "
                       "--disk-cache-dir across restarts; a reload is tried while the disk is unmeasured. A skipped "
                       "file stays. always: reload every disk hit (a fast disk, or to "
                       "measure it). split: serve a hit from both ends, prefilling its first chunks (--prefill-chunk's "
                       "steps) while its last rows are read from the file backward, cut where both are expected to "
                       "finish together by the same two rates (probed at start when none were saved), re-planned "
                       "after each chunk with the read's own rate; a tail that cannot be read is computed. Decided as "
                       "auto while a rate is missing (no file to probe), without --prefill-chunk, "
                       "for window-trimmed files and for Star files that do not record their document's length "
                       "(written by an earlier starshard)")
    tiers.add_argument("--disk-readers", type=int, default=DEFAULT_READERS, metavar="N",
                       help="threads reading one disk cache file in parallel, each a run of large sequential reads "
                       "in file order (a drive serves several at once: NVMe or a network filesystem reads faster); "
                       "1: one sequential reader (default: %(default)s)")
    add_layout_arguments(ap)
    add_sparse_arguments(ap)
    add_fp8_arguments(ap)
    add_rope_scaling_argument(ap)
    rt = ap.add_argument_group("runtime")
    rt.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    rt.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    rt.add_argument("--dist-timeout", type=float, default=600.0,
                    help="seconds any collective may wait: a dead or hung rank fails the in-flight requests (503) and "
                    "ends the server within about this long")
    ap.add_argument("--config", type=Path, default=None,
                    help="TOML run config whose keys are these flags' long names; command-line flags override it")
    if read_launch_env().rank != 0:
        ap.error = lambda message: sys.exit(2)
    args = parse_with_config(ap, argv)
    if args.model and args.random_weights:
        ap.error("give --model or --random-weights, not both")
    bad = layout_error(args)
    if bad:
        ap.error(bad)
    for flag in ("max_batch", "max_tokens_limit"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_queue < 0 or args.max_extend < 0:
        ap.error("--max-queue and --max-extend must be >= 0")
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        ap.error(f"--prefill-chunk must be >= 0 tokens (0: the whole prompt), got {args.prefill_chunk}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        ap.error(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.cache_gib is not None and args.cache_gib <= 0:
        ap.error(f"--cache-gib must be > 0, got {args.cache_gib}")
    args.disk_free = None  # the disk tier's default budget: the free bytes it came from
    if args.disk_cache_dir is not None and args.disk_cache_gib is None:
        try:
            budget, args.disk_free = default_disk_budget(args.disk_cache_dir, read_launch_env().world_size)
        except (ValueError, OSError) as e:
            ap.error(str(e))
        args.disk_cache_gib = budget / GiB  # whole MiB: exact
    try:
        args.tiers = TierConfig.from_gib(args.host_cache_gib or 0.0, args.disk_cache_dir, args.disk_cache_gib,
                                         args.disk_reload_policy, args.shutdown_write_s, args.disk_readers)
    except ValueError as e:
        ap.error(str(e))
    return args


def default_cache_bytes(llm, args, device, chunk: int) -> int:
    """The context cache budget per rank without --cache-gib. On CUDA what the memory plan leaves
    (planner.cache_budget: 90% of the GPU, less what is allocated (the weights), the largest step's working
    set and the decode graphs' pool), the worst rank's over the group; 2 GiB on CPU."""
    import torch

    if device.type != "cuda":
        return 2 * 2**30
    cfg = llm.config
    dtype = str(llm.model.layers[0].attention_norm.weight.dtype).removeprefix("torch.")
    window = cfg.max_position_embeddings
    layout = Layout.of(llm.parallel)
    work = Workload(window, window, 0, chunk or None, DTYPE_BYTES[dtype], **plan_features(args))
    budget, refused = None, None
    try:
        budget = cache_budget(cfg, layout, work, total_bytes=torch.cuda.get_device_properties(device).total_memory,
                              weights_bytes=torch.cuda.memory_allocated(device), max_batch=args.max_batch,
                              max_extend=args.max_extend,
                              # the graphs' pools, and the own-KV stores of the kept decode graphs (executor.py)
                              graphs_bytes=0 if args.no_cuda_graphs else GRAPH_POOL_BYTES + TABLE_STORE_BYTES)
    except ValueError as e:
        refused = e
    own = budget.bytes if budget is not None else 0
    worst = group_min(own, device)  # every rank refuses alike, or takes the worst rank's budget
    if refused is not None:
        raise refused
    if worst <= 0:
        raise ValueError(f"another rank has no memory left for the context cache (this rank: {budget.describe()}); "
                         "lower --prefill-chunk, --max-batch or --max-extend, spread the weights over more ranks "
                         "(--tp, --pp), or give --cache-gib explicitly")
    log.info("context cache budget %s%s", budget.describe(),
             "" if worst == own else f"; another rank has less: {worst / GiB:.2f} GiB per rank on every rank")
    return worst


def group_min(value: int, device) -> int:
    """The smallest of every rank's `value` (this rank's alone in one process)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device if "nccl" in str(dist.get_backend()) else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def stop_before_serving(lead: bool) -> None:
    """Until the server takes requests, SIGINT / SIGTERM end the process at once, quietly and with 0 (the
    cache holds nothing yet); serve_lead's server and serve_rank replace these handlers."""
    def stop(sig, frame):
        if lead:
            sys.stderr.write(f"[starshard] {signal.Signals(sig).name}: stopped before serving\n")
            sys.stderr.flush()
        os._exit(0)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def main(argv=None) -> int:
    args = parse_args(argv)
    launch = read_launch_env()
    lead = launch.rank == 0
    if lead:
        busy = port_error(args.host, args.port)  # before the model loads: a busy port fails in a second
        if busy:
            print(f"error: {busy}", file=sys.stderr)
            return 2
    stop_before_serving(lead)
    import torch

    logging.basicConfig(level=getattr(logging, args.log_level.upper()) if lead else logging.ERROR,
                        handlers=[log_handler()])  # megatron's lines keep their own prefix
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    try:
        llm = LLM(args.model, dtype=dtype, device=device, parallel=parallel_config(args), progress=lead,
                  random_weights=args.random_weights, sparse=sparse_config(args), fp8=fp8_config(args),
                  rope_scaling=args.rope_scaling)
        chunk = args.prefill_chunk
        if chunk is None:
            chunk = default_prefill_chunk(llm.device, llm.parallel.cp)
        cache = int(args.cache_gib * 2**30) if args.cache_gib else default_cache_bytes(llm, args, llm.device, chunk)
        if args.disk_free is not None:  # the default disk budget: each rank's free space may differ a little
            args.tiers = replace(args.tiers, disk_bytes=group_min(args.tiers.disk_bytes, llm.device))
            log.info("disk tier: %s, budget %.2f GiB per rank (of %.1f GiB free; --disk-cache-gib sets it)",
                     args.tiers.disk_dir, args.tiers.disk_bytes / GiB, args.disk_free / GiB)
        if args.host_cache_gib is None and args.disk_cache_dir is not None and llm.device.type == "cuda":
            host = group_min(default_host_bytes(cache, memory_available(), ranks_per_node(1)), llm.device)
            args.tiers = replace(args.tiers, host_bytes=host)
            log.info("host tier: %.2f GiB per rank, page-locked at start (one device budget, at most half the memory "
                     "available over the node's ranks; --host-cache-gib sets it, 0 turns it off)", host / GiB)
        name = args.served_model_name or (Path(args.model).name if args.model else args.random_weights
                                          or "SmolLM2-135M-Instruct")
        service = Scheduler(llm, cache_bytes=cache, max_batch=args.max_batch, max_queue=args.max_queue,
                            max_extend=args.max_extend, model_name=name, cuda_graphs=not args.no_cuda_graphs,
                            prefill_chunk=chunk, prefill_taper=args.prefill_taper,
                            request_timeout=args.request_timeout, tiers=args.tiers, warmup=args.warmup,
                            window_trim=args.window_trim)
    except (LayoutError, CheckpointError, ValueError, DiskTierLocked) as e:
        if lead:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if not lead:
        return serve_rank(service, args, launch.rank)
    if args.tiers.disk_dir is not None and not args.tiers.host_bytes and llm.device.type == "cuda":
        log.warning("a disk tier without a host tier: moving an entry from the device to disk copies its shard to "
                    "ordinary memory inside a step (~1.7 GB/s: every stream waits ~10 s for a 16 GiB shard); "
                    "--host-cache-gib of the device budget (%.1f GiB) stages it page-locked instead", cache / GiB)
    return serve_lead(service, args, cache)


def serve_rank(service, args, rank: int) -> int:
    """Every rank but 0: execute rank 0's steps until it says stop. SIGINT / SIGTERM are ignored here (torchrun
    and a terminal's Ctrl-C send them to every rank): rank 0 stops the group, after the steps that write this
    rank's shard of the cache to disk."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        service.serve_forever()
    except Exception as e:
        why = collective_failure(e, args.dist_timeout) or f"{type(e).__name__}: {e}"
        sys.stderr.write(f"error: rank {rank}: {why}\n")
        sys.stderr.flush()
        os._exit(1)
    return 0


def serve_lead(service, args, cache_bytes: int) -> int:
    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                              max_body_bytes=int(args.max_body_mb * 2**20), max_tokens_limit=args.max_tokens_limit,
                              served_model_name=service.model_name, log_prompts=args.log_prompts,
                              log_level=args.log_level)
    server = make_server(create_app(service, settings), settings)
    failed = threading.Event()

    def watch():  # the engine stopped (a rank died or hung): answer 503 briefly, then end the server
        while not server.should_exit:
            if service.health() is not None:
                failed.set()
                server.should_exit = True
                return
            failed.wait(0.5)

    log.info("context cache: %.2f GiB per rank; batch up to %d, queue %d; prefill chunk %s%s", cache_bytes / 2**30,
             args.max_batch, args.max_queue, service.prefill_chunk or "whole",
             f", tapered after {service.prefill_knee} held tokens" if service.prefill_knee else "")
    tiers = args.tiers
    if tiers.any:
        host = f"{tiers.host_bytes / 2**30:.2f} GiB" if tiers.host_bytes else "off"
        disk = (f"{tiers.disk_bytes / 2**30:.2f} GiB in {tiers.disk_dir} (--disk-reload-policy {tiers.disk_reload})"
                if tiers.disk_dir else "off")
        log.info("context cache tiers per rank: host %s, disk %s", host, disk)
        if tiers.disk_dir and tiers.shutdown_write_s:
            torchrun = "TORCHELASTIC_RUN_ID" in os.environ and tiers.shutdown_write_s > 30
            log.info("graceful shutdown writes the entries not on disk yet to %s (at most %g s, --shutdown-write-s)%s",
                     tiers.disk_dir, tiers.shutdown_write_s,
                     "; torchrun ends its ranks 30 s after it passed SIGTERM / SIGINT on, unless started with "
                     "--shutdown-timeout" if torchrun else "")
    try:
        service.start()  # returns after the warm-up
    except RanksDisagree as e:
        sys.stderr.write(f"error: rank 0: {e}\n")
        sys.stderr.flush()
        os._exit(1)  # the other ranks stop alike; the group is not torn down
    threading.Thread(target=watch, name="starshard-health", daemon=True).start()
    server.run()  # until SIGINT / SIGTERM (its handlers stay: a second one is logged, see server/app.py) or a failure
    if failed.is_set():
        sys.stderr.write(f"error: rank 0: {service.health()}; the server is stopping\n")
        sys.stderr.flush()
        os._exit(1)  # the group is broken: tearing it down can block
    service.shutdown()  # the write-down (every rank follows its steps), then the other ranks stop
    return 0
