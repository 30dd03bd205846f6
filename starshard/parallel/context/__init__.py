"""Context strategies: how a CP group shares one sequence. All implement ContextStrategy (base.py)."""
from __future__ import annotations

STRATEGIES = ("dense", "ring", "ulysses", "usp", "star", "apb")

# APB-only options: ParallelConfig field (= make_strategy keyword) -> the CLI flag that sets it.
APB_OPTIONS = {"passing_size": "--passing-size", "compressor": "--compressor", "compressor_path": "--compressor-path",
               "embed_query": "--no-embed-query", "prefix_len": "--prefix-len", "apb_hosts": "--apb-hosts"}


def apb_options(parallel) -> dict:
    """The APB keywords a ParallelConfig sets (None = the strategy's default), for make_strategy(**...)."""
    return {k: getattr(parallel, k) for k in APB_OPTIONS if getattr(parallel, k, None) is not None}


def make_strategy(name: str, group=None, *, block_size=None, anchor_size=None, query_rank=None,
                  ulysses_degree=None, cp_groups=None, num_blocks=None, tp_group=None, **apb):
    """The strategy `name` over `group` (None = a single rank).

    apb: the APB_OPTIONS keywords (refused for other strategies) and `tp_group` (retaining heads);
    `num_blocks` (--num-blocks) is the same as apb_hosts (--apb-hosts) for APB.

    usp: `ulysses_degree` (default: the whole CP group, i.e. plain Ulysses) and `cp_groups`, every CP
    group of the world as global ranks (its subgroups are created collectively on every rank)."""
    unknown = [k for k in apb if k not in APB_OPTIONS]
    if unknown:
        raise TypeError(f"make_strategy() got unexpected keyword(s) {', '.join(unknown)}")
    apb = {k: v for k, v in apb.items() if v is not None}
    if apb and name != "apb":
        flags = ", ".join(APB_OPTIONS[k] for k in apb)
        raise ValueError(f"{flags} only apply to --cp-strategy apb (got {name}); drop them or use --cp-strategy apb")
    if name == "dense":
        from starshard.parallel.context.dense import DenseContext

        return DenseContext(group, query_rank)
    if name == "ring":
        from starshard.parallel.context.ring import RingAttention

        return RingAttention(group, query_rank)
    if name == "ulysses":
        from starshard.parallel.context.ulysses import UlyssesAttention

        return UlyssesAttention(group, query_rank)
    if name == "usp":
        import torch.distributed as dist

        from starshard.parallel.context.base import group_size
        from starshard.parallel.context.usp import UspAttention, new_usp_groups

        cp = group_size(group)
        u = cp if ulysses_degree is None else ulysses_degree
        if u < 1 or cp % u:
            raise ValueError(f"--ulysses-degree {u} must divide --cp {cp}; valid: {[d for d in range(1, cp + 1) if cp % d == 0]}")
        if group is None:
            return UspAttention(None, 1, None, None, query_rank)
        ulysses_group, ring_group = new_usp_groups(cp_groups or [dist.get_process_group_ranks(group)], u)
        return UspAttention(group, u, ulysses_group, ring_group, query_rank)
    if name == "star":
        from starshard.parallel.context.star import StarAttention

        return StarAttention(group, block_size=block_size, anchor_size=anchor_size, query_rank=query_rank,
                             num_blocks=num_blocks)
    if name == "apb":
        from starshard.parallel.context.apb import APBAttention

        if block_size is not None:
            raise ValueError("--block-size is Star's; APB splits the context evenly over the hosts (--cp, or "
                             "--apb-hosts with --cp 1): drop --block-size")
        hosts = apb.get("apb_hosts")
        if num_blocks is not None and hosts is not None and num_blocks != hosts:
            raise ValueError(f"--num-blocks {num_blocks} and --apb-hosts {hosts} disagree; for APB they are the "
                             "same setting: give one")
        return APBAttention(group, anchor_size=anchor_size, passing_size=apb.get("passing_size"),
                            compressor=apb.get("compressor", "query"), embed_query=apb.get("embed_query", True),
                            query_rank=query_rank, prefix_len=apb.get("prefix_len"),
                            compressor_path=apb.get("compressor_path"), tp_group=tp_group,
                            num_blocks=hosts if hosts is not None else num_blocks)
    raise ValueError(f"unknown --cp-strategy {name!r}; choose one of {', '.join(STRATEGIES)}")


def add_apb_arguments(group) -> None:
    """APB's command-line flags (each dest is its ParallelConfig field; None = default), shared by
    launch/infer.py and launch/eval.py."""
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
