"""Profile one prefill on one GPU: which kernels a long prefill's time goes to (issue 19: what is left
besides the GEMMs and attention at 128K).

    python bench/profile_prefill.py --layers 2 --prompt-len 131072 [--fp8 linear,kv] [--gaps 15] [--host 30] [--out prof.json]
    python bench/profile_prefill.py --layers 4 --prefill-chunk 4096 --prefill-knee 26624   # the service's chunk steps
    python bench/profile_prefill.py --layers 4 --prefill-chunk 4096 --prefill-knee 26624 --service  # through its scheduler
    python bench/profile_prefill.py --model DIR --prompt-file essay.txt --rope-scaling yarn:4 --sparse minference
        --sparse-config cfg.json --gaps 15   # (one line) real weights past the window: a sparse prefill's time

A Llama-3.1-8B-shaped model with --layers decoder layers (random weights: fine for dense speed), random
token ids. One warm-up prefill, `--repeats` timed ones, then one under torch.profiler; prints the
device kernels by total time and writes them (name, calls, ms per prefill, share) as JSON.
"""
import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from starshard import LLM
from starshard.benchmarks.common import commit, device_spans, kernel_gaps
from starshard.benchmarks.prefill import prompt_ids, text_ids
from starshard.kernels.sparse import SparseConfig
from starshard.config import SamplingConfig
from starshard.presets import PRESETS
from starshard.runtime.prompt import Prompt
from starshard.serving.scheduler import Scheduler

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--preset", default="llama-3.1-8b")
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--prompt-len", type=int, default=131072)
ap.add_argument("--fp8", default=None, help="as launch/infer.py --fp8 (e.g. linear,kv)")
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--out", default=None)
ap.add_argument("--model", default=None, help="a checkpoint (real weights) instead of the random preset")
ap.add_argument("--prompt-file", default=None, help="with --model: natural text, repeated to --prompt-len tokens")
ap.add_argument("--sparse", default=None, choices=["minference", "anchor"], help="sparse prefill method")
ap.add_argument("--sparse-config", default=None, help="its per-head config file")
ap.add_argument("--rope-scaling", default=None, metavar="yarn:FACTOR", help="with --model: run it past its window "
                "with YaRN, as `starshard run --rope-scaling` (e.g. Qwen2.5 at 128K: yarn:4)")
ap.add_argument("--host", type=int, default=0, help="also profile the host: list the N ops with the most self CPU "
                "time (short prompts are bound by the host's launches)")
ap.add_argument("--gaps", type=int, default=0, help="also list the N longest idle gaps between device kernels "
                "(with the kernels either side) and their sum")
ap.add_argument("--prefill-chunk", type=int, default=0, help="prompt tokens a step, as serve's (0: the whole prompt)")
ap.add_argument("--prefill-knee", type=int, default=None, help="the chunks' taper knee in held tokens (serve's "
                "default for Llama-3.1-8B: 26624; none: uniform chunks)")
ap.add_argument("--service", action="store_true", help="prefill through the service's scheduler (in process, "
                "on its step thread: each prompt a new document, one token generated), as bench.py serve's document "
                "scenario does; its chunks from --prefill-chunk, tapered after --prefill-knee (none: uniform chunks)")
ap.add_argument("--cache-gib", type=float, default=40.0, help="with --service: the context cache budget")
ap.add_argument("--vary-length", action="store_true", help="each prefill one token shorter than the last, as new "
                "documents are (a KV cache's capacity sets its views' strides, and torch keeps a cuDNN graph per "
                "shape and strides)")
args = ap.parse_args()
if args.rope_scaling and not args.model:
    ap.error("--rope-scaling applies to --model (a checkpoint); the random presets take their window from the preset")
sparse = SparseConfig(args.sparse, config_path=args.sparse_config) if args.sparse else None

if args.model:
    llm = LLM(args.model, device="cuda", dtype=torch.bfloat16, progress=False, fp8=args.fp8, sparse=sparse,
              rope_scaling=args.rope_scaling)
else:
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(dict(PRESETS[args.preset], num_hidden_layers=args.layers)))
        llm = LLM(device="cuda", dtype=torch.bfloat16, progress=False, random_weights=str(cfg_path), fp8=args.fp8,
                  sparse=sparse)
text = text_ids(llm.tokenizer, args.prompt_file) if args.prompt_file else None
ids = prompt_ids(args.prompt_len, llm.config.vocab_size, text)
ids = ids.tolist() if torch.is_tensor(ids) else ids
runner, s = llm.runner, SamplingConfig()


svc = None
if args.service:
    svc = Scheduler(llm, cache_bytes=int(args.cache_gib * 2**30), prefill_chunk=args.prefill_chunk,
                    prefill_taper=args.prefill_knee is not None, prefill_knee_tokens=args.prefill_knee,
                    warmup=False)
    svc.start()
calls = iter(range(1, 1000))  # the i-th prefill: its first token (and with --vary-length, i tokens fewer)


def prefill():
    i = next(calls)
    p = ids[: len(ids) - i] if args.vary_length else ids
    if svc is not None:  # a new document each time (a changed first token): never a cache hit
        done = threading.Event()
        svc.submit(Prompt([i] + p[1:], len(p)), max_tokens=1, sampling=s,
                   on_event=lambda ev: ev.finish_reason is not None and done.set())
        done.wait()
        return
    cache = runner.new_cache(len(p) + 8)
    runner.prefill(Prompt(p, len(p)), cache, s, None, chunk=args.prefill_chunk or None, knee=args.prefill_knee)
    torch.cuda.synchronize()


with torch.inference_mode():
    prefill()
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        prefill()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.host else [])) as prof:
        prefill()
if svc is not None:
    svc.shutdown()
rows = []
total = 0.0
for e in prof.key_averages():
    dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
    if e.device_type == torch.autograd.DeviceType.CUDA and dev_us > 0:
        rows.append({"kernel": e.key[:160], "calls": e.count, "ms": dev_us / 1e3})
        total += dev_us / 1e3
rows.sort(key=lambda r: -r["ms"])
idle = kernel_gaps(device_spans(prof), args.gaps) if args.gaps else None  # the device's idle time, longest gaps
for r in rows:
    r["share"] = r["ms"] / total
print(f"prefill {args.prompt_len} tokens, {llm.config.num_layers} layers, chunk {args.prefill_chunk or 'whole'} "
      f"(knee {args.prefill_knee}), fp8 {args.fp8 or 'none'}, "
      f"sparse {args.sparse or 'none'}{', through the service' if svc else ''}"
      f"{', lengths varied' if args.vary_length else ''}: "
      f"{min(times):.3f} s wall (best of {args.repeats}); kernels {total:.1f} ms")
for r in rows[:30]:
    print(f"{r['ms']:10.2f} ms {100 * r['share']:5.1f}% x{r['calls']:<5d} {r['kernel'][:110]}")
host = []
if args.host:
    cpu = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    cpu.sort(key=lambda e: -e.self_cpu_time_total)
    host = [{"op": e.key[:120], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in cpu]
    print(f"host: {sum(h['self_cpu_ms'] for h in host):.2f} ms of self CPU time in profiled ops; most:")
    for h in host[: args.host]:
        print(f"{h['self_cpu_ms']:10.3f} ms x{h['calls']:<5d} {h['op'][:100]}")
if idle is not None:
    print(f"idle between kernels: {idle['idle_s'] * 1e3:.1f} ms in {idle['gaps']} gaps; longest:")
    for g in idle["longest_gaps"]:
        print(f"{g['s'] * 1e3:10.2f} ms after {g['after']} | before {g['before']}")
if args.out:
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "commit": commit(), "preset": args.preset,
                   "layers": llm.config.num_layers, "model": args.model, "prompt_file": args.prompt_file,
                   "sparse": args.sparse, "sparse_config": args.sparse_config, "rope_scaling": args.rope_scaling,
                   "prompt_len": args.prompt_len, "fp8": args.fp8 or "none",
                   "prefill_chunk": args.prefill_chunk, "prefill_knee": args.prefill_knee, "service": args.service,
                   "vary_length": args.vary_length,
                   "wall_s": times, "kernel_ms_total": total, "kernels": rows,
                   "device_idle": idle,
                   "host_ops": host[: args.host]}, f, indent=1)
