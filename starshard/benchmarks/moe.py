"""Mixture-of-experts speed on one GPU: a Qwen3-30B-A3B-shaped model (--random-weights, default
qwen3-30b-a3b) with random weights, starshard against transformers in the same run.

(a) prefill at --prefill-lengths (default 32768): starshard (a KV cache as a real run fills it,
    last-token logits) vs transformers' *ForCausalLM holding the same weights (the random tensors of
    checkpoints.sources.RandomSource, generated under transformers' in-memory names), SDPA attention,
    its own experts implementation (transformers picks grouped_mm where it dispatches; the JSON
    names it), use_cache=False, logits_to_keep=1. One model at a time on the GPU: built, timed,
    freed, then the other. The rel. difference of the two last-token logits is reported (a check
    that both ran the same model; bf16 rounding makes it nonzero).
(b) decode step at --decode-contexts (default 4096,32768): one generated token fed back, as
    LLM.generate runs it (a CUDA graph unless --no-cuda-graphs), median of --decode-steps, after an
    untimed prefill of the context. With it, the bytes a step reads: attention weights and norms,
    every layer's router and its k active experts, one embedding row, the final norm and the LM
    head (planner.decode_read_elements), plus the K and V of the context; the time those bytes take
    at --hbm-bandwidth (default: the GPU's nominal figure, common.NOMINAL_HBM_BYTES_PER_SECOND, e.g.
    4.8e12 B/s on an H200 and 3.35e12 on an H100 SXM; a GPU not listed takes the measured copy
    bandwidth; the JSON's hbm_bandwidth_source says which; on the CPU, no bound), measured / that
    time, and the fraction of the bandwidth reached. A device-to-device copy's bandwidth is measured
    for reference.

    python launch/bench.py moe --out moe.json                             # one H200
    python launch/bench.py moe --random-weights tiny-moe --device cpu --dtype float32 \\
        --prefill-lengths 64 --decode-contexts 32,64 --decode-steps 3 --repeats 1   # CPU smoke
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from starshard.benchmarks.common import (DTYPES, copy_bandwidth, header, ints, median, nominal_hbm_bandwidth, timed,
                                        write)
from starshard.benchmarks.prefill import prefill_flops
from starshard.checkpoints.sources import RandomSource
from starshard.config import Fp8Config, SamplingConfig
from starshard.llm import LLM
from starshard.planner import active_experts, decode_read_elements, projection_sizes
from starshard.presets import PRESETS, preset_config

HELP = "MoE prefill vs transformers and decode step vs the bytes it reads (one GPU)"
_MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}


def add_arguments(p) -> None:
    p.add_argument("--random-weights", default="qwen3-30b-a3b", help="MoE preset name or a config.json path")
    p.add_argument("--prefill-lengths", type=ints, default=[32768], help="comma-separated prefill lengths (tokens)")
    p.add_argument("--decode-contexts", type=ints, default=[4096, 32768],
                   help="comma-separated context lengths at which a decode step is timed")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per context (median reported)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per length (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed prefills per length and model first")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and compute dtype")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--hbm-bandwidth", type=float, default=None,
                   help="bytes per second the bytes-bound decode time assumes (default: this GPU's nominal HBM "
                        "figure, e.g. 4.8e12 on an H200, 3.35e12 on an H100 SXM; else the measured copy bandwidth)")
    p.add_argument("--fp8", default=None, metavar="LIST",
                   help="as infer.py --fp8 (e.g. linear,kv,experts): starshard runs these parts in e4m3 and the "
                        "bytes bound counts them at one byte (needs --skip-hf: transformers runs bf16)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="time decode steps eagerly")
    p.add_argument("--skip-hf", action="store_true", help="starshard only (no transformers prefill)")
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")


def check(args) -> str | None:
    try:
        cfg = preset_config(args.random_weights)
    except ValueError as e:
        return str(e)
    if not cfg.num_experts:
        return f"--random-weights {args.random_weights} is not a mixture-of-experts model (qwen3-30b-a3b, mixtral-8x7b, tiny-moe)"
    return None


def hf_config_dict(name: str) -> dict:
    if name in PRESETS:
        return dict(PRESETS[name])
    path = Path(name)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_bytes(cfg, context: int, dtype_bytes: int, fp8: Fp8Config | None = None) -> dict:
    """Bytes one decode step (one token) reads at `context` cached tokens, by part; with `fp8`, the parts it
    holds in e4m3 at one byte plus their float32 scales (projection / expert rows, KV (head, token) rows)."""
    fp8 = fp8 or Fp8Config()
    L, h, b = cfg.num_layers, cfg.hidden_size, dtype_bytes
    weights = decode_read_elements(cfg, 1, L, True, True, tokens=1) * b
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
    if fp8.linear:
        elems, channels = projection_sizes(cfg, 1, L)
        weights += elems * (1 - b) + channels * 4
    if fp8.experts and moe_layers:
        k, fe = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        weights += moe_layers * k * (3 * fe * h * (1 - b) + (2 * fe + h) * 4)
    per_head = cfg.head_dim + 4 if fp8.kv else cfg.head_dim * b
    kv = L * context * 2 * cfg.num_kv_heads * per_head
    return {"weights": int(weights), "kv": int(kv), "total": int(weights + kv)}


def run_starshard(args, cfg, dev, dtype, fp8: Fp8Config) -> tuple[list[dict], list[dict], dict[int, torch.Tensor]]:
    llm = LLM(None, dtype=dtype, device=str(dev), progress=False, random_weights=args.random_weights, fp8=fp8,
              cuda_graphs=not args.no_cuda_graphs)
    runner, model = llm.runner, llm.model
    prefill_rows, decode_rows, last_logits = [], [], {}
    for L in args.prefill_lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, L), generator=torch.Generator().manual_seed(L)).to(dev)
        state = {}

        def prefill():
            state["cache"] = cache = runner.new_cache(L + 8)
            with torch.inference_mode():
                state["logits"] = model(ids, cache=cache, last_only=True)

        try:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            times = timed(prefill, dev, args.repeats, warmup=args.warmup)
            last_logits[L] = state["logits"][0, -1].float().cpu()
            mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
            fl = prefill_flops(cfg, L)["total"]  # active experts only
            row = {"length": L, "prefill_seconds": median(times), "all_seconds": times, "peak_memory_gib": mem,
                   "model_tflops": fl / 1e12, "achieved_tflops": fl / median(times) / 1e12}
        except torch.OutOfMemoryError as e:
            row = {"length": L, "error": f"out of memory: {str(e).splitlines()[0]}"}
        state.clear()
        _free()
        prefill_rows.append(row)
        print(json.dumps({"starshard_prefill": row}), file=sys.stderr, flush=True)
    for C in args.decode_contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, C), generator=torch.Generator().manual_seed(C)).to(dev)
        state = {}

        def start():  # the context's KV, then the first generated token
            state["cache"] = runner.new_cache(C + args.decode_steps + 8)
            with torch.inference_mode():
                state["tok"] = model(ids, cache=state["cache"], last_only=True)[:, -1].argmax(-1).view(1, 1)

        def step():  # one generated token, fed back, as LLM.generate runs it
            with torch.inference_mode():
                state["tok"] = runner.next_token(state["tok"].view(1, 1), state["cache"], SamplingConfig(), None)

        start()
        graph_error = None
        try:
            times = timed(step, dev, args.decode_steps, warmup=2)
        except RuntimeError as e:  # a capture this build refuses: say so, and time the eager steps
            graph_error = str(e).splitlines()[0]
            runner.end_generation()
            runner.cuda_graphs = False
            start()
            times = timed(step, dev, args.decode_steps, warmup=2)
        t = median(times)
        nbytes = decode_bytes(cfg, C + 2, torch.empty(0, dtype=dtype).element_size(), fp8)
        bound = nbytes["total"] / args.hbm_bandwidth if args.hbm_bandwidth else None
        row = {"context": C, "step_seconds": t, "all_seconds": times, "cuda_graphs": runner.cuda_graphs,
               "graph_error": graph_error, "bytes_read": nbytes, "bytes_bound_seconds": bound,
               "measured_over_bytes_bound": t / bound if bound else None,
               "bandwidth_fraction": bound / t if bound else None, "achieved_bytes_per_second": nbytes["total"] / t}
        decode_rows.append(row)
        print(json.dumps({"starshard_decode": row}), file=sys.stderr, flush=True)
        runner.end_generation()  # the CUDA graph holds this cache
        state.clear()
        _free()
    return prefill_rows, decode_rows, last_logits  # the model goes with this frame


def build_hf(args, cfg, dev, dtype):
    """transformers' model of the preset with starshard's random tensors under its own names."""
    import transformers

    hf = hf_config_dict(args.random_weights)
    arch = hf.pop("architectures")[0]
    hf_cfg = transformers.AutoConfig.for_model(_MODEL_TYPES[cfg.arch], **hf)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = getattr(transformers, arch)(hf_cfg)
    src = RandomSource(cfg, 0, dtype, dev)  # LLM(random_weights=...)'s seed: the same tensors
    for name, _ in list(model.named_parameters()):  # a tied head is the embedding: listed once
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(src.get(name), requires_grad=False)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=hf_cfg).to(dev)  # its buffers were made on meta
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"transformers' model kept tensors without data: {left[:5]}")
    experts = getattr(model.config, "_experts_implementation", None)
    return model.eval(), experts


def run_hf(args, cfg, dev, dtype, ours_logits) -> tuple[list[dict], dict]:
    import transformers

    model, experts = build_hf(args, cfg, dev, dtype)
    rows = []
    for L in args.prefill_lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, L), generator=torch.Generator().manual_seed(L)).to(dev)
        state = {}

        def prefill():
            with torch.inference_mode():
                state["logits"] = model(ids, use_cache=False, logits_to_keep=1).logits

        try:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            times = timed(prefill, dev, args.repeats, warmup=args.warmup)
            mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
            row = {"length": L, "prefill_seconds": median(times), "all_seconds": times, "peak_memory_gib": mem}
            if L in ours_logits:
                ref = state["logits"][0, -1].float().cpu()
                row["last_logits_rel_diff_vs_starshard"] = ((ours_logits[L] - ref).norm() / ref.norm()).item()
        except torch.OutOfMemoryError as e:
            row = {"length": L, "error": f"out of memory: {str(e).splitlines()[0]}"}
        state.clear()
        _free()
        rows.append(row)
        print(json.dumps({"hf_prefill": row}), file=sys.stderr, flush=True)
    info = {"transformers": transformers.__version__, "experts_implementation": experts, "attention": "sdpa"}
    return rows, info


def run(args) -> None:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    cfg = preset_config(args.random_weights)
    fp8 = Fp8Config.parse(args.fp8)
    if fp8.any and not args.skip_hf:
        raise ValueError(f"--fp8 {args.fp8}: transformers runs the bf16 model, so its prefill is no peer for this "
                         "one: add --skip-hf")
    bandwidth = copy_bandwidth(dev)
    source = "--hbm-bandwidth"
    if args.hbm_bandwidth is None:  # the CPU has neither: no bytes bound
        nominal = nominal_hbm_bandwidth(dev)
        args.hbm_bandwidth = nominal or bandwidth
        source = (f"nominal for {torch.cuda.get_device_name(dev)}" if nominal else
                  "measured copy bandwidth" if bandwidth else None)
    _free()
    prefill, decode, logits = run_starshard(args, cfg, dev, dtype, fp8)
    _free()
    held = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else None  # ~0: starshard's model is gone
    hf_rows, hf_info = ([], None) if args.skip_hf else run_hf(args, cfg, dev, dtype, logits)
    if hf_info is not None:
        hf_info["gib_allocated_before_build"] = held
    for row in prefill:
        peer = next((r for r in hf_rows if r["length"] == row["length"] and "prefill_seconds" in r), None)
        if peer is not None and "prefill_seconds" in row:
            row["hf_prefill_seconds"] = peer["prefill_seconds"]
            row["speedup_vs_hf"] = peer["prefill_seconds"] / row["prefill_seconds"]
    for row in decode:
        if bandwidth:
            row["copy_bandwidth_fraction"] = row["achieved_bytes_per_second"] / bandwidth
    result = header("moe", dev, 1, args)
    result.update(
        model={"preset": args.random_weights, "arch": cfg.arch, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
               "experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
               "expert_width": cfg.moe_intermediate_size, "vocab": cfg.vocab_size, "weights": "random",
               "active_experts_per_decode_step": active_experts(cfg, 1)},
        dtype=args.dtype, fp8=fp8.describe(), hbm_bytes_per_second=args.hbm_bandwidth,
        hbm_bandwidth_source=source,
        copy_bytes_per_second=bandwidth,
        prompt={"kind": "random token ids", "seed": "the length"},
        prefill=prefill, hf=hf_info, hf_prefill=hf_rows, decode=decode)
    write(args.out, result)
