"""Command-line flags shared by the entry points (launch/infer.py, serve.py, eval.py, bench.py) and the
one translation of them into configs: flags -> ParallelConfig, SparseConfig.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys

from starshard.checkpoints.rope import parse_rope_scaling
from starshard.config import FP8_ITEMS, Fp8Config, ParallelConfig
from starshard.kernels.sparse import SparseConfig
from starshard.planner import Layout
from starshard.strategies import (OPTIONS, SPECS, STRATEGIES, check, default_name, fp8_attention_error,
                                  given_options)


def number(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False):
    """An argparse type: a `kind` (int or float) >= low (> low with `above`) and <= high. A value out of
    range is argparse's error naming the flag and the range (exit 2), as a bad TOML key is (runconfig)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if low is not None and (value <= low if above else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low:g}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return value
    parse.kind = kind  # runconfig reads a TOML number through it as through `kind`
    parse.__name__ = kind.__name__
    return parse


POSITIVE = number(int, 1)  # sizes and counts that cannot be zero: --tp, --prompt-len, ...
COUNT = number(int, 0)  # counts where 0 means none / off
SECONDS = number(float, 0, above=True)
GIB = number(float, 0, above=True)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help only where the help does not say its default already and
    X tells something (not None, not a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


class LogFormatter(logging.Formatter):
    """'[starshard] message' on starshard's own lines; another library's keep their own name ('[megatron] Using
    Megatron-FSDP without Transformer Engine.'), so its import notices are not read as starshard's."""

    def __init__(self):
        super().__init__("[%(package)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.package = record.name.partition(".")[0]
        return super().format(record)


def parse_layer_ids(text: str | None) -> list[int] | None:
    """--layers "0,5,10-14" as layer ids (None: every layer); a malformed list exits naming the form."""
    if text is None:
        return None
    out = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, dash, hi = part.partition("-")
            ids = list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
            if not ids:  # a range backwards would name no layer, silently
                raise SystemExit(f"error: --layers {text!r}: the range {part} runs backwards; write it low-high")
            out += ids
    except ValueError:
        raise SystemExit(f"error: --layers {text!r}: expected comma-separated layer ids or ranges, "
                         "e.g. 0,5,10-14") from None
    return out


def log_handler() -> logging.Handler:
    """The commands' stderr log handler (LogFormatter)."""
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(LogFormatter())
    return h


def add_sampling_arguments(group) -> None:
    """How the next token is drawn: --temperature, --top-p, --top-k, --seed (checked by the parser)."""
    group.add_argument("--temperature", type=number(float, 0), default=0.0,
                       help="sampling temperature, >= 0; 0 = greedy")
    group.add_argument("--top-p", type=number(float, 0, 1, above=True), default=1.0,
                       help="nucleus sampling mass in (0, 1] (1 = off)")
    group.add_argument("--top-k", type=COUNT, default=0, help="sample from the k most likely tokens (0 = off)")
    group.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def add_layout_arguments(ap: argparse.ArgumentParser) -> None:
    """The parallel layout: tp, pp, cp and the context strategies' options (the registry's)."""
    par = ap.add_argument_group(
        "parallel layout (launch tp*pp*cp processes: torchrun --nproc-per-node N, or srun --ntasks N in a Slurm "
        "allocation; CUDA runs NCCL on cuda:LOCAL_RANK, CPU runs gloo)")
    par.add_argument("--tp", type=POSITIVE, default=1,
                     help="tensor-parallel size: heads and MLP columns split over this many ranks (must divide the "
                     "attention heads; the error lists the valid sizes)")
    par.add_argument("--pp", type=POSITIVE, default=1,
                     help="pipeline-parallel stages: layers split over this many ranks, prefill pipelined in chunks")
    par.add_argument("--pp-layers", type=lambda s: [int(x) for x in s.split(",")], default=None, metavar="N,N,..",
                     help="layers per pipeline stage, comma separated (default: even split, earlier stages take the "
                     "remainder); must match a converted checkpoint's split")
    par.add_argument("--cp", type=POSITIVE, default=1, help="context-parallel size: ranks that share the sequence")
    exact = " / ".join(s.name for s in SPECS.values() if s.exact and not s.single_rank)
    approximate = " / ".join(s.name for s in SPECS.values() if not s.exact)
    par.add_argument("--cp-strategy", choices=STRATEGIES, default=None,
                     help=f"how the CP group splits the sequence: {exact} (exact), {approximate} (approximate); "
                     f"default {default_name(1)} for --cp 1, {default_name(2)} otherwise; composes with --tp (tp x cp "
                     "ranks)")
    add_strategy_arguments(ap, par)


def add_sparse_arguments(ap: argparse.ArgumentParser) -> None:
    """Sparse prefill inside each shard (MInference, AnchorAttention)."""
    sp = ap.add_argument_group("sparse prefill (approximate; decode stays dense)")
    with_sparse = [s.name for s in SPECS.values() if s.sparse]
    sp.add_argument("--sparse", choices=["minference", "anchor"], default=None,
                    help="sparse attention inside each shard during prefill: minference = per-head A-shape / "
                    "Vertical-Slash / Block-Sparse patterns; anchor = AnchorAttention stripes (keys whose score is "
                    f"within --anchor-theta of the block's anchor); composes with {', '.join(with_sparse[:-1])} and "
                    f"{with_sparse[-1]}, not {'/'.join(s.name for s in SPECS.values() if not s.sparse)}. Never slower than dense on CUDA: calls over 64K keys or fewer run the dense kernel "
                    "without estimating (--sparse-min-length), and after the estimate every head whose sparse kernel "
                    "would not beat the dense kernel (rates measured on one H200) runs dense (AnchorAttention: a whole call "
                    "runs dense when its heads' mean density reaches the break-even, --sparse-fallback-density); "
                    "`launch/bench.py "
                    "prefill` reports what ran (sparse_report)")
    sp.add_argument("--sparse-config", default=None, metavar="FILE",
                    help="--sparse minference: per-layer, per-head patterns (JSON from `python -m "
                    "starshard.tools.minference_search`, or MInference's published per-model config); default: "
                    "Vertical-Slash (1000, 6096) on every head, except on the embedded default model (no --model, "
                    "or its checkpoint by path), which takes the patterns searched for it "
                    "(starshard/checkpoints/smollm2_minference.json, recall 0.99). --sparse anchor: per-layer, "
                    "per-head thresholds and the pooling, calibrated for the model to a recall target (JSON from "
                    "`python -m starshard.tools.anchor_calibrate`); replaces --anchor-theta / --anchor-block-q / "
                    "--anchor-step; default: qwen2.5-coder-1.5b-instruct (by name, or its GGUF or a checkpoint "
                    "converted from it) takes the calibration shipped for it "
                    "(starshard/checkpoints/qwen2.5-coder-1.5b-instruct_anchor.json, recall 0.99 at 128K with YaRN "
                    "x4) unless one of those three flags is given, every other model --anchor-theta's one threshold")
    sp.add_argument("--anchor-theta", type=number(float, 0), default=None, metavar="T",
                    help="--sparse anchor without --sparse-config: one threshold for every head, in natural-log units "
                    "of the softmax weight: keep keys whose score stays within this of the anchor on average over "
                    "a query block (default 12, the paper's for 8B models; lower = sparser; how much attention mass "
                    "a given theta keeps depends on the model and head: calibrate with --sparse-config)")
    sp.add_argument("--anchor-block-q", type=POSITIVE, default=None, metavar="N",
                    help="--sparse anchor: query rows pooled per block (default 128; small models at a few K tokens: 16)")
    sp.add_argument("--anchor-step", type=POSITIVE, default=None, metavar="S",
                    help="--sparse anchor: query blocks sharing one stripe selection (default 16; small models: 1)")
    sp.add_argument("--sparse-min-length", type=COUNT, default=None, metavar="N",
                    help="prefill calls over fewer than N keys run dense, nothing estimated (default: more than 64K "
                    "keys on CUDA, the measured crossover; 0 on CPU; 0 = always estimate, e.g. accuracy studies)")
    sp.add_argument("--sparse-no-fallback", action="store_true",
                    help="run every head's sparse pattern even where the dense kernel is faster (kernel and accuracy "
                    "studies; with --sparse-min-length 0 this reproduces runs from before the fallback)")
    sp.add_argument("--sparse-fallback-density", type=number(float, 0), default=None, metavar="D",
                    help="--sparse anchor: the per-call floor: after identification a call whose heads keep on "
                    "average at least this share of the causal (query, key) pairs runs the exact dense kernel "
                    "whole, counted per layer in sparse_report (default: the break-even density, the stripe "
                    "kernel's measured speed per pair as a share of cuDNN's: 0.399 at head dim 64, 0.411 at 128; "
                    "above 1: no per-call floor, heads still priced one by one)")
    sp.add_argument("--sparse-fallback-sample", type=COUNT, default=None, metavar="N",
                    help="--sparse anchor: count the stripes of only the last N groups of query blocks first and run "
                    "the call dense, skipping the full identification (what a fallen-back call costs on top of "
                    "dense), when their mean density reaches the floor (default 4; 0: the floor is checked after the "
                    "full identification)")


def add_fp8_arguments(ap: argparse.ArgumentParser) -> None:
    """--fp8: what runs in FP8 e4m3 (GPUs of compute capability >= 8.9; the CPU runs a slow reference)."""
    ap.add_argument("--fp8", default=None, metavar="LIST",
                    help=f"comma-separated parts to run in FP8 e4m3, from {', '.join(FP8_ITEMS)} (default: none, the "
                    "compute dtype): linear = decoder projections with e4m3 weights (one scale per output channel) and "
                    "activations scaled per row (FP8 GEMM in prefill, weight-only kernel in decode), quantized at load time or "
                    "read as stored from a checkpoint converted with --fp8 linear (which needs this item); kv = the KV cache "
                    "in e4m3 with one scale per (KV head, token), half the KV bytes (the memory plan counts it); "
                    "attention = 8-bit prefill scores: q . k from int8 q and int8 keys minus their mean (e4m3 scores measured ~8%% "
                    "off), P . V in the compute dtype, for the prompt's prefill on the dense path, in Star's context blocks "
                    "and in Ulysses, on the GPU for calls of at least 96K keys (shorter ones measured no faster and keep "
                    "exact scores; not with ring / USP / APB or --sparse; decode unchanged); experts = an MoE model's "
                    "experts in e4m3 with one scale per expert row, quantized at load time (decode reads them as stored, "
                    "prefill runs FP8 grouped GEMMs; MoE models only). Needs an Ada / Hopper GPU (compute capability "
                    ">= 8.9) and --dtype bfloat16 for linear. Usual choice: --fp8 linear,kv (MoE: linear,kv,experts)")


def add_rope_scaling_argument(ap: argparse.ArgumentParser) -> None:
    """--rope-scaling: YaRN on a model whose config declares plain RoPE (checkpoints/rope.py)."""
    ap.add_argument("--rope-scaling", type=_rope_scaling, default=None, metavar="yarn:FACTOR",
                    help="run the model with YaRN RoPE of this factor, its window FACTOR times its config's "
                    "(yarn:4: Qwen2.5's 32,768 positions -> 131,072); refused for a model whose config already "
                    "sets RoPE scaling, unless it is the same")


def _rope_scaling(text: str) -> str:
    try:
        parse_rope_scaling(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def fp8_config(args) -> Fp8Config:
    """The Fp8Config --fp8 asks for (ValueError names the valid items)."""
    return Fp8Config.parse(getattr(args, "fp8", None))


def plan_layout(args, strategy: str | None = None) -> Layout:
    """The planner's Layout of the layout flags (`strategy`: the plan's own when not the flags', e.g. a whole
    sequence on one rank); ValueError names an impossible layout. A command without --pp / --query-rank plans
    one stage and the default query rank."""
    pp_layers = getattr(args, "pp_layers", None)
    return Layout(args.tp, getattr(args, "pp", 1), args.cp, strategy or default_strategy(args),
                  tuple(pp_layers) if pp_layers else None, args.block_size, args.anchor_size,
                  getattr(args, "query_rank", None), getattr(args, "num_blocks", None), getattr(args, "apb_hosts", None))


def plan_features(args) -> dict:
    """The planner Workload's fields that --fp8 and --sparse set (what the memory plan counts of them)."""
    fp8 = fp8_config(args)
    return dict(fp8_kv=fp8.kv, fp8_linear=fp8.linear, fp8_experts=fp8.experts, fp8_attention=fp8.attention,
                sparse=getattr(args, "sparse", None) is not None)


def add_strategy_arguments(ap: argparse.ArgumentParser, group, without: tuple[str, ...] = ()) -> None:
    """Every context strategy's options (starshard.strategies.OPTIONS) as flags whose dest is the
    ParallelConfig field (None = the strategy's default): the shared ones into `group`, a strategy's
    exclusive ones into a group of their own; `without`: fields left out."""
    for o in OPTIONS.values():
        if not o.exclusive and o.field not in without:
            group.add_argument(o.flag, **o.argparse_kwargs())
    for spec in SPECS.values():
        own = [o for o in spec.options if o.exclusive and o.field not in without]
        if own:
            g = ap.add_argument_group(spec.flag_group)
            for o in own:
                g.add_argument(o.flag, **o.argparse_kwargs())


def strategy_cli_error(args) -> str | None:
    """What is wrong with the context strategy's flags in `args` (None: nothing), checked by its
    registry entry before any model loads."""
    try:
        check(default_strategy(args), args.cp or 1, given_options(args))
    except ValueError as e:
        return str(e)
    return None


def layout_error(args) -> str | None:
    """What is wrong with the layout / sparse / fp8 flags in `args` (None: nothing), before any model loads."""
    try:
        fp8 = fp8_config(args)
    except ValueError as e:
        return str(e)
    if fp8.attention:
        bad = fp8_attention_error(default_strategy(args), args.cp or 1, getattr(args, "sparse", None) is not None)
        if bad:
            return bad
    if getattr(args, "sparse_config", None) is not None and getattr(args, "sparse", None) is None:
        return "--sparse-config needs --sparse minference or --sparse anchor"
    if getattr(args, "sparse", None) is None and (getattr(args, "sparse_min_length", None) is not None
                                                   or getattr(args, "sparse_no_fallback", False)):
        return "--sparse-min-length and --sparse-no-fallback need --sparse minference or --sparse anchor"
    if getattr(args, "sparse", None) != "anchor" and (getattr(args, "sparse_fallback_density", None) is not None
                                                       or getattr(args, "sparse_fallback_sample", None) is not None):
        return "--sparse-fallback-density and --sparse-fallback-sample need --sparse anchor"
    return strategy_cli_error(args)


def default_strategy(args) -> str:
    """--cp-strategy as given, else the registry's default for --cp (dense on one rank, ring for a CP group)."""
    return args.cp_strategy or default_name(args.cp or 1)


def parallel_config(args) -> ParallelConfig:
    """The ParallelConfig the layout flags ask for (ValueError names a bad combination)."""
    return ParallelConfig(
        tp=args.tp, pp=args.pp, cp=args.cp, cp_strategy=default_strategy(args), pp_layers=args.pp_layers,
        timeout_s=getattr(args, "dist_timeout", ParallelConfig.timeout_s),
        **{k: getattr(args, k) for k in OPTIONS},
    )


def sparse_config(args) -> SparseConfig | None:
    """The SparseConfig --sparse asks for, or None (ValueError names a bad value)."""
    if args.sparse is None:
        return None
    return SparseConfig(args.sparse, args.sparse_config, args.anchor_theta, args.anchor_block_q, args.anchor_step,
                        min_length=args.sparse_min_length, fallback=False if args.sparse_no_fallback else None,
                        fallback_density=getattr(args, "sparse_fallback_density", None),
                        fallback_sample=getattr(args, "sparse_fallback_sample", None))
