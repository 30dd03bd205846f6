"""Twice the context per GPU at the same memory (issue 19): the planner's answer, checked by a run.

    python bench/context_capacity.py --out capacity.json            # one GPU, ~1.5 min on an H200

Defaults: 4 layers, cap 7 GiB -> the planner's longest prompt is ~154K tokens in bf16 and ~387K
with --fp8 linear,kv (~2.5x: with 4 layers the embedding and head are much of the memory, and FP8
linear halves the projections; --fp8 kv alone ~1.9x; the whole 32-layer model on a 141 GB H200:
2.04x, tests/test_planner.py).

A Llama-3.1-8B-shaped model with --layers layers (random weights) under a memory cap
(torch.cuda.set_per_process_memory_fraction): the planner (starshard/planner.py max_prompt_tokens)
gives the longest prompt that fits the cap in bf16 and with --fp8 linear,kv, for a chunked prefill
(--chunk) plus --decode-steps new tokens. Then real runs under the cap:

  fp8 @ fp8 length     chunked prefill + decode steps: must fit (the held FP8 keys are dequantized one
                       bounded block at a time, kernels/attention.py: no bf16 copy of the prefix)
  bf16 @ bf16 length   must fit
  bf16 @ fp8 length    must run out of memory (torch.cuda.OutOfMemoryError is caught)
  fp8-dequant @ fp8    the previous FP8 prefill (each chunk attends a dequantized bf16 copy of the
                       held prefix): runs out of memory a few chunks in

Per run: fits or out of memory (and where), prefill / decode seconds, peak allocated / reserved
bytes next to the planner's peak. On CUDA each run is its own process (the cap applies to it alone). JSON on stdout (and --out), progress on stderr. Each mode first runs
a short untimed warm-up (two chunks: Triton compiles, cuDNN plans). --device cpu runs the same code
without a cap (a smoke test of the script with --preset tiny; the out-of-memory runs are skipped).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before CUDA initialises: grow segments instead of caching fixed blocks, so fragmentation does not
# decide what fits under the cap.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from starshard import LLM  # noqa: E402
from starshard.benchmarks.common import commit, device_name  # noqa: E402
from starshard.engine import model as model_mod  # noqa: E402
from starshard.kernels.attention import attention  # noqa: E402
from starshard.kernels.fp8 import dequantize  # noqa: E402
from starshard.planner import GiB, Layout, Workload, kv_bytes_per_token, max_prompt_tokens, plan_memory  # noqa: E402
from starshard.presets import PRESETS, preset_config  # noqa: E402


def say(msg: str) -> None:
    print(f"[capacity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def dequantize_then_attend(q, k, v, pos, held_k, held_v, held_pos, *, k_scale, v_scale):
    """The FP8 prefill before kernels/flash.py read e4m3 (LayerKV.append): the held prefix dequantized
    to the compute dtype and concatenated with the chunk's keys, then one attention call."""
    kd, vd = dequantize(held_k, k_scale, q.dtype), dequantize(held_v, v_scale, q.dtype)
    return attention(q, torch.cat([kd, k], 2), torch.cat([vd, v], 2), q_pos=pos, k_pos=torch.cat([held_pos, pos]),
                     causal=True)


def model_config_file(preset: str, layers: int, tmp: Path) -> Path:
    hf = dict(PRESETS[preset], num_hidden_layers=layers)
    path = tmp / "config.json"
    path.write_text(json.dumps(hf))
    return path


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class ChunkProgress:
    """A forward pre-hook that says every `every` prefill chunks how far the prefill is."""

    def __init__(self, total: int, chunk: int, every: int = 16):
        self.total, self.chunk, self.every, self.done, self.t0 = total, chunk, every, 0, time.perf_counter()

    def __call__(self, module, args):
        n = args[0].shape[1]
        if n > 1:
            self.done += n
            if (self.done // self.chunk) % self.every == 0 or self.done >= self.total:
                say(f"  prefill {self.done}/{self.total} tokens, {time.perf_counter() - self.t0:.1f} s")


def run_one(cfg_path, mode: str, fp8, tokens: int, args, device, planned_peak: int | None, old_path: bool = False):
    """Build the model, warm up, then a chunked prefill of `tokens` random tokens + decode steps."""
    row = {"mode": mode, "fp8": fp8 or "none", "prompt_tokens": tokens, "planned_peak_bytes": planned_peak}
    saved = model_mod.attention_after_held
    llm = hook = None
    try:
        if old_path:
            model_mod.attention_after_held = dequantize_then_attend
        say(f"{mode}: building the model (fp8 {fp8 or 'none'})")
        llm = LLM(random_weights=str(cfg_path), dtype=torch.bfloat16, device=str(device), fp8=fp8,
                  progress=False)
        llm.eos_ids = set()  # random weights: never stop early
        free(device)
        row["weights_allocated_bytes"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        gen = torch.Generator().manual_seed(0)
        warm = torch.randint(0, llm.config.vocab_size, (2 * args.chunk + 7,), generator=gen).tolist()
        say(f"{mode}: warm-up, {len(warm)} tokens")
        llm.generate(warm, max_new_tokens=2, prefill_chunk=args.chunk)
        free(device)
        ids = torch.randint(0, llm.config.vocab_size, (tokens,), generator=gen).tolist()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        hook = llm.model.register_forward_pre_hook(ChunkProgress(tokens, args.chunk))
        say(f"{mode}: prefill {tokens} tokens in chunks of {args.chunk}, then {args.decode_steps} decode steps")
        out = llm.generate(ids, max_new_tokens=args.decode_steps + 1, prefill_chunk=args.chunk)
        m = out.metrics
        row.update(fits=True, prefill_seconds=m["prefill_seconds"], decode_seconds=m["decode_seconds"],
                   prefill_tokens_per_second=tokens / m["prefill_seconds"],
                   decode_tokens_per_second=m["decode_tokens_per_second"], generated_tokens=len(out.token_ids))
        say(f"{mode}: fits; prefill {m['prefill_seconds']:.1f} s, decode {m['decode_tokens_per_second']:.1f} tok/s")
    except torch.cuda.OutOfMemoryError as e:
        row.update(fits=False, error=str(e).splitlines()[0][:300])
        say(f"{mode}: out of memory ({row['error'][:120]})")
    except Exception as e:  # noqa: BLE001 - one failed run must not lose the others' results
        row.update(fits=None, error=f"{type(e).__name__}: {str(e)[:300]}")
        say(f"{mode}: FAILED {row['error']}")
    finally:
        model_mod.attention_after_held = saved
        if hook is not None:
            hook.remove()
    if device.type == "cuda":
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    del llm
    free(device)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.1-8b", help="model shape (starshard/presets.py)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (random weights)")
    ap.add_argument("--cap-gb", type=float, default=7.0, help="memory cap of the process's allocator, GiB")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens per forward)")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--margin-gb", type=float, default=0.25,
                    help="ask the planner for lengths under cap - margin (the runs keep the whole cap): room for "
                         "what the planner does not count, cuBLAS workspaces and the CUDA-graph pool of decode")
    ap.add_argument("--kv-only", action="store_true",
                    help="also run --fp8 kv alone (bf16 weights) at its planned length (~+20 s)")
    ap.add_argument("--skip-oom-checks", action="store_true", help="run only the two runs that must fit")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one mode, print its row
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cap = int(args.cap_gb * GiB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        say(f"{device_name(device)}: allocator capped at {args.cap_gb} GiB of {total / GiB:.1f} GiB")

    cfg = dataclasses.replace(preset_config(args.preset), num_layers=args.layers)
    lay = Layout()
    settings = {"bf16": dict(), "fp8": dict(fp8_kv=True, fp8_linear=True), "fp8-kv": dict(fp8_kv=True)}
    lengths, planned = {}, {}
    for name, kw in settings.items():
        w = Workload(1, max_new_tokens=args.decode_steps + 1, prefill_chunk=args.chunk, **kw)
        n = max_prompt_tokens(cfg, lay, w, cap - int(args.margin_gb * GiB))
        plan = plan_memory(cfg, lay, dataclasses.replace(w, prompt_tokens=n)).worst
        lengths[name] = n
        planned[name] = {"max_prompt_tokens": n, "peak_bytes": plan.total, "weights": plan.weights,
                         "kv_cache": plan.kv_cache, "activations": plan.activations,
                         "kv_bytes_per_token_layer": kv_bytes_per_token(cfg, 1, w)}
        say(f"planner, {name}: longest prompt {n} tokens (weights {plan.weights / GiB:.2f} GiB, KV "
            f"{plan.kv_cache / GiB:.2f} GiB, activations {plan.activations / GiB:.2f} GiB)")
    wf = Workload(lengths["fp8"], max_new_tokens=args.decode_steps + 1, prefill_chunk=args.chunk)
    bf16_at_fp8 = plan_memory(cfg, lay, wf).worst.total

    result = {
        "bench": "context_capacity", "device": device_name(device), "torch": torch.__version__, "commit": commit(),
        "model": {"preset": args.preset, "layers": args.layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                  "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "weights": "random"},
        "cap_bytes": cap, "margin_bytes": int(args.margin_gb * GiB), "chunk": args.chunk,
        "decode_steps": args.decode_steps, "planner": planned,
        "planned_ratio_fp8_over_bf16": lengths["fp8"] / lengths["bf16"] if lengths["bf16"] else None,
        "planned_ratio_fp8_kv_over_bf16": lengths["fp8-kv"] / lengths["bf16"] if lengths["bf16"] else None,
        "runs": [],
    }
    runs = [("fp8 @ fp8 length", "linear,kv", lengths["fp8"], planned["fp8"]["peak_bytes"], False, True),
            ("bf16 @ bf16 length", None, lengths["bf16"], planned["bf16"]["peak_bytes"], False, True)]
    if args.kv_only:
        runs.append(("fp8-kv @ fp8-kv length", "kv", lengths["fp8-kv"], planned["fp8-kv"]["peak_bytes"], False, True))
    if device.type == "cuda" and not args.skip_oom_checks:
        runs += [("bf16 @ fp8 length", None, lengths["fp8"], bf16_at_fp8, False, False),
                 ("fp8-dequant @ fp8 length", "linear,kv", lengths["fp8"], None, True, False)]
    if args.only is not None:  # a child process: one run, its row as the last stdout line
        mode, fp8, n, peak, old, _ = runs[args.only]
        with tempfile.TemporaryDirectory() as tmp:
            row = run_one(model_config_file(args.preset, args.layers, Path(tmp)), mode, fp8, n, args, device, peak,
                          old_path=old)
        print(json.dumps(row))
        return 0
    t0 = time.perf_counter()
    for i, (mode, fp8, n, peak, old, expect_fit) in enumerate(runs):
        if device.type == "cuda":
            # Each run in a fresh process: a previous run's cuBLAS workspaces, graph pool and allocator
            # segments must not count against the next one's cap.
            child = [a for a in (argv if argv is not None else sys.argv[1:])]
            done = subprocess.run([sys.executable, __file__, *child, "--only", str(i)], stdout=subprocess.PIPE,
                                  text=True)
            lines = done.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "mode": mode, "fits": None, "error": f"child process exited {done.returncode}"}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                row = run_one(model_config_file(args.preset, args.layers, Path(tmp)), mode, fp8, n, args, device,
                              peak, old_path=old)
        row["expected"] = "fits" if expect_fit else "out of memory"
        row["as_expected"] = row.get("fits") is expect_fit
        result["runs"].append(row)
    ok = {r["mode"]: r.get("fits") for r in result["runs"]}
    result["checked_ratio_fp8_over_bf16"] = (lengths["fp8"] / lengths["bf16"]
                                             if ok.get("fp8 @ fp8 length") and ok.get("bf16 @ bf16 length") else None)
    result["all_as_expected"] = all(r["as_expected"] for r in result["runs"])
    result["seconds"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    say(f"done in {result['seconds']:.0f} s; fp8 / bf16 tokens {result['planned_ratio_fp8_over_bf16']:.3f}; "
        f"all as expected: {result['all_as_expected']}")
    return 0 if result["all_as_expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
