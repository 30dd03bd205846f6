"""Memory planner against hand-computed byte counts (tiny preset, Llama-3.1-8B/70B) and published
parameter counts; the smallest-layout search; the CLI's --plan-only and refusal."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from starshard.config import FP8_PREFILL_KEY_BLOCK
from starshard.planner import GiB, Layout, Workload, plan_memory, smallest_layout, weight_elements
from starshard.presets import preset_config

ROOT = Path(__file__).resolve().parents[1]


def test_weight_counts_match_published_parameter_counts():
    # Llama 3.1 8B / 70B and SmolLM2-135M (tied head) as published: the whole model on one rank.
    assert weight_elements(preset_config("llama-3.1-8b"), 1, 32, True, True) == 8_030_261_248
    assert weight_elements(preset_config("llama-3.1-70b"), 1, 80, True, True) == 70_553_706_496
    assert weight_elements(preset_config("smollm2-135m"), 1, 30, True, True) == 134_515_008
    # Tied head on a last stage without the embedding: the stage keeps its own copy.
    smol = preset_config("smollm2-135m")
    assert weight_elements(smol, 1, 15, False, True) - weight_elements(smol, 1, 15, False, False) == 576 + 49152 * 576


def test_tiny_dense_by_hand():
    # tiny: vocab 512, hidden 64, MLP 128, 2 layers, 4 heads, 2 KV heads, head_dim 16; float32.
    cfg = preset_config("tiny")
    plan = plan_memory(cfg, Layout(), Workload(64, max_new_tokens=4, dtype_bytes=4))
    (s,) = plan.stages
    # per layer: norms 2*64 + wqkv (4+2*2)*16*64 + wo 64*64 + w13 2*128*64 + w2 64*128 = 36992
    assert s.weights == (2 * 36992 + 512 * 64 + 64 + 512 * 64) * 4 == 558336
    # 68 tokens x 2 layers x (K+V: 2*2 heads*16*4 bytes + int64 position)
    assert s.kv_cache == 2 * 68 * 264 == 35904
    # 64 rows x 4 bytes x max(attn 4*64 + 8*16 + 14*16 = 608, mlp max(3*64 + 4*128, 4*64 + 3*128) = 704)
    # + logits 512 x 4
    assert s.activations == 64 * 4 * 704 + 2048 == 182272
    assert plan.peak_bytes == 558336 + 35904 + 182272


def test_tiny_tp2_pp2_by_hand():
    cfg = preset_config("tiny")
    plan = plan_memory(cfg, Layout(tp=2, pp=2), Workload(64, max_new_tokens=4, dtype_bytes=4, prefill_chunk=16))
    s0, s1 = plan.stages
    # per layer per tp rank: 128 + (2+2*1)*16*64 + 64*32 + 2*64*64 + 64*64 = 18560; vocab rows 256
    assert (s0.weights, s1.weights) == ((18560 + 256 * 64) * 4, (18560 + 64 + 256 * 64) * 4) == (139776, 140032)
    assert s0.kv_cache == s1.kv_cache == 68 * (2 * 1 * 16 * 4 + 8) == 9248
    # 16-row chunks: attn 256 + 4*16 + 7*16 = 432, mlp max(192 + 256, 256 + 192) = 448; logits on the last stage
    assert s0.activations == 16 * 4 * 448 == 28672
    assert s1.activations == 28672 + 256 * 4


def test_vocab_padding_to_tp_multiple():
    cfg = dataclasses.replace(preset_config("tiny"), vocab_size=510)
    a = plan_memory(cfg, Layout(tp=4), Workload(8, dtype_bytes=4)).stages[0]
    b = plan_memory(dataclasses.replace(cfg, vocab_size=512), Layout(tp=4), Workload(8, dtype_bytes=4)).stages[0]
    assert a.weights == b.weights  # 510 pads to 512: 128 rows per rank for embedding and head
    assert a.activations == b.activations


def test_llama8b_tp8_128k_by_hand():
    cfg = preset_config("llama-3.1-8b")
    plan = plan_memory(cfg, Layout(tp=8), Workload(131072, max_new_tokens=64, dtype_bytes=2))
    (s,) = plan.stages
    # per layer per rank: 2*4096 + (4+2)*128*4096 + 4096*512 + 2*1792*4096 + 4096*1792 = 27271168; vocab 16032 rows
    assert s.weights == (32 * 27271168 + 2 * 16032 * 4096 + 4096) * 2 == 2_008_031_232
    # one KV head per rank: 131136 tokens x 32 layers x (2*128*2 + 8)
    assert s.kv_cache == 131136 * 32 * 520
    # the textbook figure: 128K tokens of Llama-3-8B KV in bf16 = 16 GiB on one rank (positions aside)
    one = plan_memory(cfg, Layout(), Workload(131072, dtype_bytes=2)).stages[0]
    assert one.kv_cache - 131072 * 32 * 8 == 16 * GiB
    # rows 131072 x 2 bytes x max(attn 4*4096 + 6*128 + 13*128 = 18816, mlp max(3*4096 + 4*1792,
    # 4*4096 + 3*1792) = 21760) + float32 logits of the last token
    assert s.activations == 131072 * 2 * 21760 + 16032 * 4


def test_cp_strategies_by_hand():
    cfg = preset_config("tiny")
    w = Workload(64, max_new_tokens=4, dtype_bytes=4)
    ring = plan_memory(cfg, Layout(cp=2, strategy="ring"), w).stages[0]
    assert (ring.kv_tokens, ring.rows) == (32 + 4, 32)  # zigzag shard of 2*ceil(64/4) rows
    assert ring.activations == 32 * 4 * 704 + 2 * 32 * 2 * 2 * 16 * 4 + 2048  # + send/recv KV blocks
    uly = plan_memory(cfg, Layout(cp=4, strategy="ulysses"), Workload(63, max_new_tokens=4, dtype_bytes=4)).stages[0]
    assert (uly.kv_tokens, uly.rows) == (16 + 4, 16)
    # star: context 63 (+1 query token), blocks of 32 -> rank 0 [0,32), rank 1 [32,63) behind a 32-token anchor
    star = plan_memory(cfg, Layout(cp=2, strategy="star"), w).stages[0]
    assert (star.kv_tokens, star.rows) == (31 + 1 + 4, 31 + 32)
    # apb: context 63 -> blocks 31, 32; defaults anchor min(b,64)=32, passing min(b,32)=32
    apb = plan_memory(cfg, Layout(cp=2, strategy="apb"), w).stages[0]
    assert (apb.kv_tokens, apb.rows) == (32 + 1 + 4, 32 + 32 + 1)
    # study mode (cp = 1): one device keeps every block; its largest forward is one block's (star: behind the
    # anchor; apb: behind the anchor and the embedded query), not the whole context
    # blocks of 16, each after the first reading the anchor from the cache (StarAttention.anchor_stored) ...
    star4 = plan_memory(cfg, Layout(strategy="star", num_blocks=4), w).stages[0]
    assert (star4.kv_tokens, star4.rows) == (63 + 1 + 4, 16)
    # ... unless --sparse or --fp8 attention runs each [anchor; block] square: 16 + 16 rows
    for flag in ("sparse", "fp8_attention"):
        square = plan_memory(cfg, Layout(strategy="star", num_blocks=4), dataclasses.replace(w, **{flag: True})).stages[0]
        assert (square.kv_tokens, square.rows) == (63 + 1 + 4, 16 + 16), flag
    # over real ranks only rank 0 reads it stored: rank 1's block [32, 63) still runs behind its 32-token anchor
    assert plan_memory(cfg, Layout(cp=2, strategy="star"), w).stages[0].rows == 31 + 32
    apb4 = plan_memory(cfg, Layout(strategy="apb", apb_hosts=4), w).stages[0]  # blocks 15/16/16/16, anchor 16
    assert (apb4.kv_tokens, apb4.rows) == (63 + 1 + 4, 16 + 16 + 1)
    assert plan_memory(cfg, Layout(strategy="apb", num_blocks=4), w).stages[0].rows == apb4.rows
    one = plan_memory(cfg, Layout(strategy="star"), w).stages[0]  # no blocks given: one block, the context
    assert (one.kv_tokens, one.rows) == (63 + 1 + 4, 63)
    # KV per rank falls with cp for every sharding strategy
    for strat in ("ring", "ulysses", "usp", "star", "apb"):
        kv = [plan_memory(cfg, Layout(cp=c, strategy=strat), Workload(4096, dtype_bytes=4)).stages[0].kv_cache
              for c in (2, 4)]
        assert kv[1] < kv[0], strat


def test_smallest_layout():
    cfg = preset_config("llama-3.1-8b")
    w = Workload(8192, max_new_tokens=128, dtype_bytes=2)
    one = plan_memory(cfg, Layout(), w)
    assert smallest_layout(cfg, w, "dense", one.peak_bytes).layout == Layout()
    best = smallest_layout(cfg, w, "dense", one.peak_bytes - 1)
    assert best.layout.world == 2 and best.peak_bytes <= one.peak_bytes - 1
    # 70B with a 1M-token context on 80 GB GPUs: tp 8 alone does not fit; the search adds ring CP ranks
    big = preset_config("llama-3.1-70b")
    w = Workload(1 << 20, max_new_tokens=64, dtype_bytes=2)
    limit = 72 * GiB
    assert not plan_memory(big, Layout(tp=8), w).fits(limit)
    found = smallest_layout(big, w, "ring", limit, allow=lambda tp, pp, cp: tp <= 8)
    assert found is not None and found.fits(limit) and found.layout.tp <= 8
    # nothing with fewer ranks fits (checked by brute force over every factorisation)
    for tp in (1, 2, 4, 8):
        for pp in range(1, 81):
            for cp in range(1, 65):
                if tp * pp * cp < found.layout.world:
                    lay = Layout(tp, pp, cp, "ring" if cp > 1 else "dense")
                    assert not plan_memory(big, lay, w).fits(limit), lay


def test_bad_layout_in_planner():
    with pytest.raises(ValueError, match="valid tp sizes"):
        plan_memory(preset_config("tiny"), Layout(tp=3), Workload(8))
    with pytest.raises(ValueError, match="needs a context strategy"):
        Layout(cp=2)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        plan_memory(preset_config("tiny"), Layout(pp=3), Workload(8))


def _infer(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(ROOT / "launch" / "infer.py"), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_cli_plan_only_and_refusal():
    p = _infer(["--random-weights", "llama-3.1-8b", "--prompt-len", "131072", "--max-new-tokens", "64", "--tp", "8",
                "--dtype", "bfloat16", "--plan-only", "--json"])
    assert p.returncode == 0, p.stderr[-2000:]
    plan = json.loads(p.stdout.strip().splitlines()[-1])
    assert plan["peak_bytes"] == 2_008_031_232 + 131136 * 32 * 520 + 131072 * 2 * 21760 + 16032 * 4
    assert plan["layout"] == {"tp": 8, "pp": 1, "cp": 1, "strategy": "dense"}
    # a layout that cannot fit is refused before anything loads, naming the smallest one that does
    p = _infer(["--random-weights", "llama-3.1-8b", "--prompt-len", "8192", "--max-new-tokens", "16", "--dtype",
                "bfloat16", "--memory-limit-gb", "12"])
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "does not fit" in p.stderr and "smallest layout that fits: tp=1 pp=2 cp=1" in p.stderr


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m", "llama-3.1-8b", "llama-3.1-70b"])
def test_weights_match_the_shards_the_runtime_builds(preset):
    """Planner weight bytes == the tensor shapes runner.build_rank_model would load on every (tp, pp) rank
    (plan_shard's specs, read without building anything)."""
    import math

    from starshard.checkpoints.hf import plan_shard
    from starshard.partition import TPShard, partition_layers, valid_tp_sizes
    from starshard.checkpoints.sources import RandomSource

    cfg = preset_config(preset)
    src = RandomSource(cfg, 0, None, "cpu")  # only has() is used: which tensors exist
    for tp in valid_tp_sizes(cfg, 8):
        for pp in (1, 2, 3)[: cfg.num_layers]:
            stages = partition_layers(cfg.num_layers, pp, None)
            plan = plan_memory(cfg, Layout(tp=tp, pp=pp), Workload(16, dtype_bytes=2))
            for p, layers in enumerate(stages):
                specs = plan_shard(cfg, src, TPShard(cfg, tp, tp - 1), layers, p == 0, p == pp - 1)
                assert plan.stages[p].weights == 2 * sum(math.prod(s.shape) for s in specs), (tp, pp, p)


def test_kv_cache_matches_the_runtime_allocation():
    """Dense KV bytes == what LocalRunner.new_cache allocates for prompt + decode budget."""
    import torch

    from starshard.config import ParallelConfig
    from starshard.runtime.local import LocalRunner
    from starshard.checkpoints.sources import weight_source
    from starshard.runtime.build import build_rank_model, plan_parallel

    cfg = preset_config("tiny")
    src = weight_source(None, random_seed=0)
    model = build_rank_model(cfg, src, plan_parallel(cfg, ParallelConfig(), src), 0, 0, None, torch.float32, "cpu")
    cache = LocalRunner(model).new_cache(64 + 4)
    real = sum(t.numel() * t.element_size() for kv in cache.layers.values() for t in (kv.k, kv.v, kv.pos))
    assert real == plan_memory(cfg, Layout(), Workload(64, max_new_tokens=4, dtype_bytes=4)).stages[0].kv_cache
    weights = plan_memory(cfg, Layout(), Workload(64, dtype_bytes=4)).stages[0].weights
    assert sum(p.numel() * 4 for p in model.parameters()) == weights


# ---------------------------------------------------------------------------- FP8 KV transient, longest prompt
def test_fp8_cache_has_no_prefix_sized_transient():
    """A bf16 cache is attended in place: activations do not grow with the prompt. A chunk after held FP8
    entries adds its chunk-sized merge (hq d (b + 8) bytes per row) and one block of dequantized held keys
    (k and v of at most FP8_PREFILL_KEY_BLOCK keys): bounded, whatever the prompt."""
    cfg = preset_config("llama-3.1-8b")
    acts = {plan_memory(cfg, Layout(), Workload(n, prefill_chunk=8192)).worst.activations
            for n in (8193, 65536, 1 << 20)}
    assert len(acts) == 1
    fp8 = {n: plan_memory(cfg, Layout(), Workload(n, prefill_chunk=8192, fp8_kv=True)).worst.activations
           for n in (8193, 2 * FP8_PREFILL_KEY_BLOCK, 1 << 20)}
    assert fp8[2 * FP8_PREFILL_KEY_BLOCK] == fp8[1 << 20] > fp8[8193]
    per_key = 8 * 128 * (2 * 2 + 4)  # k and v in bf16 + v's float32 temporary, 8 KV heads of 128
    assert fp8[1 << 20] - fp8[8193] == per_key * (FP8_PREFILL_KEY_BLOCK - 8193)  # 8193 held at most (no decode budget)
    tiny = preset_config("tiny")  # attention-bound rows: hidden 64, MLP 128, 4 heads of 16, 2 KV heads
    one = plan_memory(tiny, Layout(), Workload(16, prefill_chunk=16, fp8_kv=True, dtype_bytes=4)).worst
    chunked = plan_memory(tiny, Layout(), Workload(64, prefill_chunk=16, fp8_kv=True, dtype_bytes=4)).worst
    bf = plan_memory(tiny, Layout(), Workload(64, prefill_chunk=16, dtype_bytes=4)).worst
    assert one.activations == bf.activations == 16 * 4 * 704 + 512 * 4  # one chunk: nothing held, no merge
    # 4 * (4*64 + 8*16 + 14*16) + 4*16 * (4 + 8) = 2432 + 768 bytes per row > the MLP's 4 * 704
    # + the held keys dequantized (64 tokens < one block): k and v of 2 KV heads of 16 in float32, + v's temporary
    assert chunked.activations == 16 * (2432 + 768) + 512 * 4 + 2 * 16 * (2 * 4 + 4) * 64


def test_max_prompt_tokens_fp8_doubles_the_context():
    """Llama-3.1-8B on one 141 GB GPU, prefill chunks of 8192: the longest prompt with --fp8 linear,kv vs
    bf16, from the byte counts (weights, KV per token, chunk activations) and checked tight."""
    from starshard.planner import max_prompt_tokens, projection_sizes

    cfg = preset_config("llama-3.1-8b")
    limit, chunk, new, layers = 141 * 10**9, 8192, 128, 32
    h, f, hq, hkv, d, vocab = 4096, 14336, 32, 8, 128, 128256
    weights = weight_elements(cfg, 1, layers, True, True) * 2
    elems, channels = projection_sizes(cfg, 1, layers)
    fp8_weights = weights - elems + 4 * channels  # projections: 1 byte + a float32 scale per output channel
    mlp = 2 * max(3 * h + 4 * f, 4 * h + 3 * f)
    attn = 2 * (4 * h + (hq + 2 * hkv) * d + (3 * hq + hkv) * d)
    bf16_act = chunk * max(attn, mlp) + 4 * vocab
    fp8_act = chunk * max(attn + hq * d * (2 + 8), mlp) + chunk * f + 4 * vocab  # + e4m3 GEMM input copy
    fp8_act += hkv * d * (2 * 2 + 4) * FP8_PREFILL_KEY_BLOCK  # one block of held keys dequantized (k, v, temporary)
    bf16_kv = layers * (2 * hkv * d * 2 + 8)
    fp8_kv = layers * (2 * hkv * (d + 4) + 8)  # e4m3 + float32 scale per (head, token)
    want_bf16 = (limit - weights - bf16_act) // bf16_kv - new
    want_fp8 = (limit - fp8_weights - fp8_act) // fp8_kv - new
    got_bf16 = max_prompt_tokens(cfg, Layout(), Workload(1, max_new_tokens=new, prefill_chunk=chunk), limit)
    got_fp8 = max_prompt_tokens(cfg, Layout(), Workload(1, max_new_tokens=new, prefill_chunk=chunk, fp8_kv=True,
                                                          fp8_linear=True), limit)
    assert (got_bf16, got_fp8) == (want_bf16, want_fp8)
    assert got_fp8 >= 1.9 * got_bf16
    # tight: one more token does not fit
    w = Workload(got_fp8 + 1, max_new_tokens=new, prefill_chunk=chunk, fp8_kv=True, fp8_linear=True)
    assert not plan_memory(cfg, Layout(), w).fits(limit)
    assert plan_memory(cfg, Layout(), dataclasses.replace(w, prompt_tokens=got_fp8)).fits(limit)


def test_max_prompt_tokens_edges():
    from starshard.planner import max_prompt_tokens

    cfg = preset_config("tiny")
    w = Workload(1, max_new_tokens=4, dtype_bytes=4)
    assert max_prompt_tokens(cfg, Layout(), w, 1000) == 0  # not even the weights fit
    assert max_prompt_tokens(cfg, Layout(), w, 1 << 40, most=5000) == 5000
    n = max_prompt_tokens(cfg, Layout(cp=2, strategy="ring"), w, 4 << 20)
    assert plan_memory(cfg, Layout(cp=2, strategy="ring"), dataclasses.replace(w, prompt_tokens=n)).fits(4 << 20)
    assert not plan_memory(cfg, Layout(cp=2, strategy="ring"), dataclasses.replace(w, prompt_tokens=n + 1)).fits(4 << 20)


def test_cli_max_prompt():
    args = ["--random-weights", "llama-3.1-8b", "--prefill-chunk", "8192", "--dtype", "bfloat16", "--memory-limit-gb",
            "100", "--max-prompt", "--json"]
    bf16 = json.loads(_infer(args).stdout.strip().splitlines()[-1])
    fp8 = json.loads(_infer(args + ["--fp8", "linear,kv"]).stdout.strip().splitlines()[-1])
    from starshard.planner import max_prompt_tokens

    cfg = preset_config("llama-3.1-8b")
    w = Workload(1, max_new_tokens=128, prefill_chunk=8192, fp8_kv=True, fp8_linear=True)
    assert fp8["max_prompt_tokens"] == max_prompt_tokens(cfg, Layout(), w, 100 * GiB)
    assert fp8["fp8"] == ["linear", "kv"] and fp8["limit_bytes"] == 100 * GiB and fp8["peak_bytes"] <= 100 * GiB
    assert fp8["max_prompt_tokens"] > 1.9 * bf16["max_prompt_tokens"] > 0
    p = _infer(["--random-weights", "tiny", "--device", "cpu", "--max-prompt"])  # no GPU: the limit must be given
    assert p.returncode == 2 and "--memory-limit-gb" in p.stderr


def test_cache_budget_by_hand():
    from starshard.planner import GRAPH_POOL_BYTES, cache_budget, usable_bytes

    # tiny, float32 (see test_tiny_dense_by_hand): a row costs 4 x max(attn 608, mlp 704) bytes; logits 512 x 4.
    cfg = preset_config("tiny")
    W = cfg.max_position_embeddings
    b = cache_budget(cfg, Layout(), Workload(W, W, 0, 16, 4), total_bytes=GiB, weights_bytes=1 << 20, max_batch=3,
                     max_extend=8)
    # chunk: 16 rows + logits; extend: 8 rows + logits + two float32 partials (hq 4 x (d 16 + lse)) per row;
    # decode: 3 rows of one token, logits and partials for each
    assert dict(b.steps) == {"one 16-token chunk": 16 * 4 * 704 + 2048,
                             "an extend of 8 tokens": 8 * 4 * 704 + 2048 + 8 * 2 * 4 * 17 * 4,
                             "a decode step of 3 rows": 3 * (4 * 704 + 2048 + 2 * 4 * 17 * 4)}
    assert b.step == ("one 16-token chunk", 47104)
    assert b.bytes == usable_bytes(GiB) - (1 << 20) - 47104 - GRAPH_POOL_BYTES
    assert b.describe().startswith(f"{b.bytes / GiB:.2f} GiB per rank = 0.9 x total 1.00 GiB - weights 0.00 GiB - "
                                   "step 0.00 GiB (one 16-token chunk) - graphs 0.50 GiB")
    # cp=2 ring: the chunk as a 16-token prompt (zigzag: 2 x ceil(16/4) = 8 rows, a send and a receive block of
    # 8 tokens' KV in flight), its gathered queries (16 x 4 x 16 x 4) and (out, lse) partials sent and received;
    # every rank runs an extend's or a decode step's rows, and gathers cp partials besides its own
    b2 = cache_budget(cfg, Layout(cp=2, strategy="ring"), Workload(W, W, 0, 16, 4), total_bytes=GiB,
                      weights_bytes=1 << 20, max_batch=3, max_extend=8, graphs_bytes=0)
    assert dict(b2.steps) == {"one 16-token chunk over cp=2": 8 * 4 * 704 + 16 * 2 * 2 * 16 * 4 + 2048
                              + 16 * 4 * 16 * 4 + 2 * 16 * 4 * 17 * 4,
                              "an extend of 8 tokens": 8 * 4 * 704 + 2048 + 8 * 5 * 4 * 17 * 4,
                              "a decode step of 3 rows": 3 * (4 * 704 + 2048 + 5 * 4 * 17 * 4)}
    assert b2.bytes == usable_bytes(GiB) - (1 << 20) - 41472


def test_cache_budget_one_chunk_not_the_window():
    from starshard.planner import cache_budget, prefill_step_bytes

    # Llama-3.1-8B's preset window is 1M: a window-long prefill plan leaves nothing on an 80 GB card,
    # a chunk's leaves most of it.
    cfg, total, weights = preset_config("llama-3.1-8b"), 80 * 10**9, 16 * 10**9
    W = cfg.max_position_embeddings
    assert W == 1 << 20

    def budget(chunk, layout=Layout(), extend=0):
        return cache_budget(cfg, layout, Workload(W, W, 0, chunk), total_bytes=total, weights_bytes=weights,
                            max_batch=16, max_extend=extend)

    with pytest.raises(ValueError, match=r"--cache-gib.*a whole 1048576-token prompt\).*--prefill-chunk"):
        budget(None)
    b = budget(4096, extend=4096)
    assert b.bytes > 50 * GiB
    # a bigger chunk leaves less
    assert budget(4096).bytes > budget(8192).bytes > budget(65536).bytes > 0
    assert budget(65536).step[0] == "one 65536-token chunk"
    # cp splits the chunk: half the rows per rank at cp=2, a quarter at cp=4, besides what the prefix partial
    # moves for the whole chunk (its bf16 queries gathered, float32 (out, lse) partials sent and received);
    # Star's chunk runs ring's zigzag path
    one, two, four = (prefill_step_bytes(cfg, Layout(cp=cp, strategy="ring" if cp > 1 else "dense"),
                                         Workload(W, W, 0, 65536))[1] for cp in (1, 2, 4))
    moved = 65536 * 32 * 128 * 2 + 2 * 65536 * 32 * 129 * 4
    assert one > two > four
    assert 0.5 * one < two - moved < 0.56 * one and 0.25 * one < four - moved < 0.3 * one  # + the ring's KV in flight
    assert prefill_step_bytes(cfg, Layout(cp=2, strategy="star"), Workload(W, W, 0, 65536))[1] == two
    assert budget(65536, Layout(cp=2, strategy="ring")).bytes > budget(65536).bytes
    # APB prefills whole whatever the chunk; a chunk of the whole window is no chunk
    with pytest.raises(ValueError, match=r"a whole 1048576-token prompt\)"):
        budget(W)
    with pytest.raises(ValueError, match="a whole 1048576-token prompt over cp=2"):
        budget(4096, Layout(cp=2, strategy="apb"))
    # held FP8 keys are read a block at a time by a chunk's prefix partial (k and v in bf16, v's float32
    # temporary); its merge buffers (32 x 128 x 10 bytes a row) stay under the MLP part's peak (2 x 69632)
    fp8 = prefill_step_bytes(cfg, Layout(cp=2, strategy="ring"), Workload(W, W, 0, 65536, fp8_kv=True))[1]
    assert 2 * (4 * 4096 + 48 * 128 + 104 * 128) + 32 * 128 * 10 < 2 * 69632
    assert fp8 - two == 8 * 128 * (2 * 2 + 4) * FP8_PREFILL_KEY_BLOCK


def test_cache_budget_refused_when_the_weights_fill_the_card():
    from starshard.planner import cache_budget

    cfg = preset_config("llama-3.1-8b")
    w = Workload(4096, 4096, 0, 2048)
    with pytest.raises(ValueError, match=r"no memory is left for the context cache \(--cache-gib\): -\d.*"
                                         r"weights 74\.51 GiB.*lower --max-batch.*give --cache-gib"):
        cache_budget(cfg, Layout(), w, total_bytes=80 * 10**9, weights_bytes=80 * 10**9, max_batch=4096)
