"""The benchmark programs behind `launch/bench.py`: one module per subcommand, each with
`add_arguments(parser)` and `run(args)` (and `HELP`, its one-line summary; `check(args)` where flags
are checked before anything loads), and `common` for what they share (timing, commit, JSON writing).

    prefill    end-to-end prefill (+ decode steps) of one context strategy, through starshard.LLM
    attention  one attention layer per context strategy, and torch's context_parallel
    hf         Hugging Face transformers prefill, the single-GPU peer
    tp         tensor x pipeline parallel prefill and decode, through starshard.LLM
    serve      the service engine: cached vs uncached time to first token, concurrent decode
    sparse     MInference sparse prefill kernels vs dense attention
    anchor     AnchorAttention vs dense attention and Vertical-Slash
    kernels    attention kernels on one GPU: correctness, probes of torch's fused kernels, speed
    plot       latency vs length from result JSON files

The top layer of the package (tests/test_layering.py): it imports from every layer below, nothing
imports it.
"""
