"""Command-line flags shared by the entry points (launch/infer.py, serve.py, eval.py, bench.py) and the
one translation of them into configs: flags -> ParallelConfig, SparseConfig.
"""
from __future__ import annotations

import argparse

from starshard.config import FP8_ITEMS, Fp8Config, ParallelConfig
from starshard.kernels.sparse import SparseConfig
from starshard.parallel.context import APB_OPTIONS, STRATEGIES


def add_layout_arguments(ap: argparse.ArgumentParser) -> None:
    """The parallel layout: tp, pp, cp and the context strategy's options (APB's included)."""
    par = ap.add_argument_group(
        "parallel layout (launch tp*pp*cp processes: torchrun --nproc-per-node N, or srun --ntasks N in a Slurm "
        "allocation; CUDA runs NCCL on cuda:LOCAL_RANK, CPU runs gloo)")
    par.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel size: heads and MLP columns split over this many ranks (must divide the "
                     "attention heads; the error lists the valid sizes)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline-parallel stages: layers split over this many ranks, prefill pipelined in chunks")
    par.add_argument("--pp-layers", type=lambda s: [int(x) for x in s.split(",")], default=None, metavar="N,N,..",
                     help="layers per pipeline stage, comma separated (default: even split, earlier stages take the "
                     "remainder); must match a converted checkpoint's split")
    par.add_argument("--cp", type=int, default=1, help="context-parallel size: ranks that share the sequence")
    par.add_argument("--cp-strategy", choices=STRATEGIES, default=None,
                     help="how the CP group splits the sequence: ring / ulysses / usp (exact), star / apb (approximate); "
                     "default dense for --cp 1, ring otherwise; composes with --tp (tp x cp ranks)")
    par.add_argument("--ulysses-degree", type=int, default=None,
                     help="usp: Ulysses ranks inside each ring rank (must divide --cp; default --cp, i.e. plain "
                     "Ulysses); keep them on one node, the all-to-alls are the bandwidth-hungry part")
    par.add_argument("--block-size", type=int, default=None,
                     help="star: context tokens per block (default: context / cp)")
    par.add_argument("--num-blocks", type=int, default=None,
                     help="star: cut the context into this many blocks instead of giving --block-size (default: "
                     "--cp); with --cp 1 this runs on one device exactly what that many hosts would")
    par.add_argument("--anchor-size", type=int, default=None,
                     help="star: anchor tokens (the context's first tokens) before each block (default: block size); "
                     "apb: anchor tokens per host (default: the paper's table, context/hosts/4 capped at 8192; 0 = none)")
    par.add_argument("--query-rank", type=int, default=None,
                     help="CP rank that owns the query and the generated tokens' KV (default: the last)")
    add_apb_arguments(ap.add_argument_group("APB (--cp-strategy apb: anchors with the embedded query, compressed "
                                            "passing blocks; paper ablations: --anchor-size 0, --passing-size 0, "
                                            "--compressor random, --no-embed-query)"))


def add_sparse_arguments(ap: argparse.ArgumentParser) -> None:
    """Sparse prefill inside each shard (MInference, AnchorAttention)."""
    sp = ap.add_argument_group("sparse prefill (approximate; decode stays dense)")
    sp.add_argument("--sparse", choices=["minference", "anchor"], default=None,
                    help="sparse attention inside each shard during prefill: minference = per-head A-shape / "
                    "Vertical-Slash / Block-Sparse patterns; anchor = AnchorAttention stripes (keys whose score is "
                    "within --anchor-theta of the block's anchor); composes with dense, ulysses, star and apb, "
                    "not ring/usp. Never slower than dense on CUDA: calls over 64K keys or fewer run the dense kernel "
                    "without estimating (--sparse-min-length), and after the estimate every head whose sparse kernel "
                    "would not beat the dense kernel (rates measured on one H200) runs dense; `launch/bench.py "
                    "prefill` reports what ran (sparse_report)")
    sp.add_argument("--sparse-config", default=None, metavar="FILE",
                    help="--sparse minference: per-layer, per-head patterns (JSON from `python -m "
                    "starshard.tools.minference_search`, or MInference's published per-model config); default: "
                    "Vertical-Slash (1000, 6096) on every head, except on the embedded default model (no --model), "
                    "which takes the patterns searched for it (starshard/checkpoints/smollm2_minference.json, "
                    "recall 0.99). --sparse anchor: per-layer, per-head thresholds and "
                    "the pooling, calibrated for the model to a recall target (JSON from `python -m "
                    "starshard.tools.anchor_calibrate`); replaces --anchor-theta / --anchor-block-q / --anchor-step")
    sp.add_argument("--anchor-theta", type=float, default=12.0,
                    help="--sparse anchor without --sparse-config: one threshold for every head, in natural-log units "
                    "of the softmax weight: keep keys whose score stays within this of the anchor on average over "
                    "a query block (paper: 12 for 8B models; lower = sparser; how much attention mass a given theta "
                    "keeps depends on the model and head: calibrate with --sparse-config)")
    sp.add_argument("--anchor-block-q", type=int, default=128,
                    help="--sparse anchor: query rows pooled per block (small models at a few K tokens: 16)")
    sp.add_argument("--anchor-step", type=int, default=16,
                    help="--sparse anchor: query blocks sharing one stripe selection (small models: 1)")
    sp.add_argument("--sparse-min-length", type=int, default=None, metavar="N",
                    help="prefill calls over fewer than N keys run dense, nothing estimated (default: more than 64K "
                    "keys on CUDA, the measured crossover; 0 on CPU; 0 = always estimate, e.g. accuracy studies)")
    sp.add_argument("--sparse-no-fallback", action="store_true",
                    help="run every head's sparse pattern even where the dense kernel is faster (kernel and accuracy "
                    "studies; with --sparse-min-length 0 this reproduces runs from before the fallback)")


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


def fp8_config(args) -> Fp8Config:
    """The Fp8Config --fp8 asks for (ValueError names the valid items)."""
    return Fp8Config.parse(getattr(args, "fp8", None))


def add_apb_arguments(group) -> None:
    """APB's command-line flags (each dest is its ParallelConfig field; None = default), shared by the
    entry points."""
    group.add_argument("--passing-size", type=int, default=None, metavar="N",
                       help="apb: KV entries per KV head each host passes on per layer, picked by --compressor "
                       "(default: the paper's table, context/hosts/8 capped at 8192, at least 32; 0 = no passing, "
                       "the ablation)")
    group.add_argument("--compressor", choices=["query", "retaining-heads", "random"], default=None,
                       help="apb: how each host scores its block for the passing entries: query = attention of the "
                       "embedded query's rows (training-free, default); retaining-heads = trained per-layer MLPs "
                       "over [q, k, v] read from --compressor-path; random = uniform (ablation)")
    group.add_argument("--compressor-path", default=None, metavar="FILE",
                       help="apb: retaining-heads weights, safetensors or torch file with layers.<i>.fc1.weight "
                       "[I, (Hq+2Hkv)*D] and layers.<i>.fc2.weight [Hkv, I] (biases optional); full format in "
                       "starshard/parallel/context/apb.py, RetainingHeads")
    group.add_argument("--no-embed-query", dest="embed_query", action="store_const", const=False, default=None,
                       help="apb: do not embed the query in the anchors (ablation); the query compressor then "
                       "scores each block with its own last rows")
    group.add_argument("--prefix-len", type=int, default=None, metavar="N",
                       help="apb: context tokens that stay before the embedded query in each anchor (default: the "
                       "chat template's head when the template is applied, else 0)")
    group.add_argument("--apb-hosts", type=int, default=None, metavar="N",
                       help="apb with --cp 1: split the context into N blocks run one after another on this device, "
                       "each handing its passing KV to the later ones; reproduces --cp N exactly (study mode). Without it, "
                       "APB on one rank has nothing to pass and is exact causal attention")


def apb_cli_error(args, cp_strategy: str | None, cp: int | None) -> str | None:
    """What is wrong with the APB flags in `args` (None: nothing), checked before any model loads."""
    given = [APB_OPTIONS[k] for k in APB_OPTIONS if getattr(args, k, None) is not None]
    if given and cp_strategy != "apb":
        return f"{', '.join(given)} only apply to --cp-strategy apb"
    for flag in ("passing_size", "prefix_len"):
        v = getattr(args, flag, None)
        if v is not None and v < 0:
            return f"{APB_OPTIONS[flag]} must be >= 0, got {v}"
    hosts = getattr(args, "apb_hosts", None)
    if hosts is not None and hosts < 1:
        return f"--apb-hosts must be >= 1, got {hosts}"
    if hosts is not None and (cp or 1) > 1 and hosts != cp:
        return f"--apb-hosts simulates hosts on one device; with --cp {cp} the CP ranks are the hosts: drop --apb-hosts"
    if (getattr(args, "compressor", None) == "retaining-heads") != (getattr(args, "compressor_path", None) is not None):
        return "--compressor retaining-heads and --compressor-path FILE go together"
    return None


def layout_error(args) -> str | None:
    """What is wrong with the layout / sparse / fp8 flags in `args` (None: nothing), before any model loads."""
    try:
        fp8 = fp8_config(args)
    except ValueError as e:
        return str(e)
    bad = fp8.layout_error(args.cp or 1, default_strategy(args), getattr(args, "sparse", None) is not None)
    if bad:
        return bad
    if getattr(args, "sparse_config", None) is not None and getattr(args, "sparse", None) is None:
        return "--sparse-config needs --sparse minference or --sparse anchor"
    if getattr(args, "sparse", None) is None and (getattr(args, "sparse_min_length", None) is not None
                                                   or getattr(args, "sparse_no_fallback", False)):
        return "--sparse-min-length and --sparse-no-fallback need --sparse minference or --sparse anchor"
    return apb_cli_error(args, args.cp_strategy, args.cp)


def default_strategy(args) -> str:
    """--cp-strategy as given, else dense for --cp 1 and ring for a CP group."""
    return args.cp_strategy or ("dense" if (args.cp or 1) == 1 else "ring")


def parallel_config(args) -> ParallelConfig:
    """The ParallelConfig the layout flags ask for (ValueError names a bad combination)."""
    return ParallelConfig(
        tp=args.tp, pp=args.pp, cp=args.cp, cp_strategy=default_strategy(args), pp_layers=args.pp_layers,
        block_size=args.block_size, anchor_size=args.anchor_size, num_blocks=args.num_blocks,
        query_rank=args.query_rank, ulysses_degree=args.ulysses_degree,
        timeout_s=getattr(args, "dist_timeout", ParallelConfig.timeout_s),
        **{k: getattr(args, k) for k in APB_OPTIONS},
    )


def sparse_config(args) -> SparseConfig | None:
    """The SparseConfig --sparse asks for, or None (ValueError names a bad value)."""
    if args.sparse is None:
        return None
    return SparseConfig(args.sparse, args.sparse_config, args.anchor_theta, args.anchor_block_q, args.anchor_step,
                        min_length=args.sparse_min_length, fallback=False if args.sparse_no_fallback else None)
