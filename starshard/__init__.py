"""starshard: tensor x pipeline x context parallel inference for long-context LLMs.

Layers, each importing only those below it (tests/test_layering.py holds the rule):
    config, layout, presets, planner     pure configuration and layout arithmetic
    kernels                              attention kernels and their dispatcher
    engine                               the model, its KV cache, sampling (one device, no process groups)
    parallel, checkpoints                topology, tensor / pipeline / context parallelism; weight sources
    runtime                              runners, CUDA-graph decode, the generation loop, the service scheduler
    llm                                  LLM: the one place a runner is chosen
    cli, evaluation, server              flags -> configs, the accuracy harness, the HTTP server
    tools, benchmarks                    offline tools (MInference pattern search); the benchmark programs behind launch/bench.py
"""
from __future__ import annotations

import os

# CPU threads that wait for work by sleeping, not spinning. On a machine whose cores are busy with other work
# a spinning OpenMP thread starves the one it waits for, and every parallel op pays at its barrier: a 4K-token
# SmolLM2 prefill in 512-token chunks beside one busy process took 1.8-4.7x the whole prefill with the
# default policy and 1.2x with this one (which also ran the whole prefill 15 % faster; docs/results.md,
# Service). The OpenMP runtime reads it when torch loads it: set before torch is imported, a value the user
# set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["LLM", "Output", "load_model", "__version__"]


def __getattr__(name):
    # Lazy: `import starshard` stays cheap (no torch / transformers import) for launchers and workers.
    if name in ("LLM", "Output"):
        from starshard import llm

        return getattr(llm, name)
    if name == "load_model":
        from starshard.checkpoints.load import load_model

        return load_model
    raise AttributeError(f"module 'starshard' has no attribute {name!r}")
