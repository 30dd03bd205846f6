"""Benchmarks -> JSON (+ PNG). One program, one subcommand per benchmark; each subcommand's --help
says what it measures and how it times it (the code: starshard/benchmarks/<subcommand>.py).

    python launch/bench.py prefill --random-weights llama-3.1-8b --cp-strategy dense --lengths 8192,32768 --out r.json
    torchrun --nproc-per-node 2 launch/bench.py prefill --cp 2 --cp-strategy ring --random-weights llama-3.1-8b ...
    torchrun --nproc-per-node 2 launch/bench.py attention --cp 2 --strategies ring,ulysses,torch-cp ...
    python launch/bench.py hf --random-weights llama-3.1-8b --lengths 8192     # transformers peer
    torchrun --nproc-per-node 2 launch/bench.py tp --tp 2 --random-weights llama-3.1-8b --out tp2.json
    python launch/bench.py serve --random-weights llama-3.1-8b --lengths 32768 --concurrency 1,4,16
    python launch/bench.py serve --scenario load --url http://127.0.0.1:8000 --num-prompts 300 --max-concurrency 8
    python launch/bench.py sparse --lengths 32768,131072 --out sparse.json    # MInference kernels vs dense
    python launch/bench.py anchor --lengths 32768,131072 --thetas 4,8,12     # AnchorAttention vs dense / VS
    python launch/bench.py kernels --quick --out kernels.json                  # attention kernels, one GPU
    python launch/bench.py fp8-attention --lengths 32768,131072                # cuDNN FP8 attention vs bf16
    python launch/bench.py moe --random-weights qwen3-30b-a3b --out moe.json   # MoE prefill vs HF, decode vs bytes
    python launch/bench.py plot r1.json r2.json --out latency.png

Timings: warm-up, then the median of --repeats runs, CUDA events on GPU (kernels: triton's do_bench).
Every result records the device, date and git commit.
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from starshard.benchmarks import anchor, attention, fp8_attention, hf, kernels, moe, plot, prefill, serve, sparse, tp
from starshard.cli import HelpFormatter

SUBCOMMANDS = {"prefill": prefill, "attention": attention, "hf": hf, "tp": tp, "serve": serve, "sparse": sparse,
               "anchor": anchor, "kernels": kernels, "fp8-attention": fp8_attention, "moe": moe, "plot": plot}


class _DescriptionAndDefaults(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    pass


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    parsers = {}
    for name, mod in SUBCOMMANDS.items():
        fmt = _DescriptionAndDefaults if getattr(mod, "DEFAULTS_IN_HELP", False) else argparse.RawDescriptionHelpFormatter
        parsers[name] = p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__, formatter_class=fmt)
        mod.add_arguments(p)
    args = ap.parse_args(argv)
    check = getattr(SUBCOMMANDS[args.cmd], "check", None)
    bad = check(args) if check else None
    if bad:
        parsers[args.cmd].error(bad)
    return args


def main(argv=None):
    args = parse_args(argv)
    SUBCOMMANDS[args.cmd].run(args)
    if dist.is_initialized():
        dist.destroy_process_group()
