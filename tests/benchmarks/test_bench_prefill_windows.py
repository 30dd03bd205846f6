"""Issue 38's speed and bytes targets, measurable from one `bench prefill` JSON: the Gemma 3 presets as
published, the windowed FLOP count against a brute-force count of visible pairs, `--all-global`'s
side-by-side rows (predicted speedup, trimmed KV per token), and the K/V bytes a ring sends per local
and per global layer against what the window predicts (zigzag shards, gloo cp=2)."""
import argparse
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.mp_harness import run_ranks
from starshard.benchmarks import prefill
from starshard.config import ModelConfig
from starshard.llm import LLM
from starshard.presets import PRESETS, preset_config
from starshard.strategies.dense import dense_flops
from starshard.strategies.flops import attention_flops, linear_flops_per_token, prefill_flops

def test_gemma3_presets_are_the_published_shapes():
    for name, (h, f, layers, heads, kv) in {"gemma-3-4b": (2560, 10240, 34, 8, 4),
                                             "gemma-3-12b": (3840, 15360, 48, 16, 8)}.items():
        c = preset_config(name)
        assert (c.arch, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
            ("gemma3", h, f, layers, heads, kv, 256)
        assert c.sliding_window == 1024 and c.query_pre_attn_scalar == 256 and c.vocab_size == 262208
        glob = [i for i in range(layers) if c.layer_window(i) is None]
        assert glob == list(range(5, layers, 6))  # five local, then a global one
        assert (c.rope_theta, c.local_rope_theta, c.rope_scaling.type, c.rope_scaling.factor) == \
            (1e6, 1e4, "linear", 8.0)
        assert c.max_position_embeddings == 131072 and c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"


def test_gemma3_preset_builds_and_its_windows_run(tmp_path):
    """The 4B preset, sizes reduced, through from_hf and LLM's random weights: the windowed forward differs
    from the same weights all-global past the window, and equals it within the window."""
    hf = dict(PRESETS["gemma-3-4b"], vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              head_dim=16, sliding_window=8)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    llm = LLM(None, random_weights=str(tmp_path / "config.json"), progress=False)
    assert [llm.config.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        win = llm.model(ids)[0].float()
        llm.model.drop_windows()
        full = llm.model(ids)[0].float()
    assert torch.allclose(win[:8], full[:8], atol=1e-5)  # within the window nothing is hidden
    assert (win[8:] - full[8:]).abs().max() > 1e-3


def brute_pairs(n: int, window: int | None) -> int:
    p = torch.arange(n)
    seen = p[None, :] <= p[:, None]
    if window is not None:
        seen &= p[:, None] - p[None, :] < window
    return int(seen.sum())


@pytest.mark.parametrize("n", [1, 7, 8, 9, 50])
def test_windowed_attention_flops_against_brute_force(n):
    cfg = ModelConfig(arch="gemma3", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=4, num_heads=2,
                      num_kv_heads=1, head_dim=3, sliding_window=8,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    per_pair = 4 * 2 * 3
    want = per_pair * (3 * brute_pairs(n, 8) + brute_pairs(n, None))
    assert attention_flops(cfg, n) == want
    assert attention_flops(cfg, n, windows=False) == per_pair * 4 * brute_pairs(n, None)
    (f,) = dense_flops(cfg, n - 1, query_len=1)
    fl = prefill_flops(cfg, n)
    assert f.attention == want and f.total == fl["total"] == n * linear_flops_per_token(cfg) + 2 * 4 * 10 + want


def bench_args(*extra):
    p = argparse.ArgumentParser()
    prefill.add_arguments(p)
    args = p.parse_args(["--repeats", "1", "--warmup", "0", "--device", "cpu", "--dtype", "float32", *extra])
    assert prefill.check(args) is None
    return args


def test_bench_prefill_all_global_side_by_side(tmp_path):
    out = tmp_path / "b.json"
    prefill.run(bench_args("--random-weights", "tiny-gemma3", "--cp-strategy", "dense", "--lengths", "100",
                           "--decode-steps", "2", "--all-global", "--out", str(out)))
    res = json.loads(out.read_text())
    cfg = preset_config("tiny-gemma3")  # window 16, layers 2 and 5 global of 6
    row, L, W = res["results"][0], 100, 16
    base = row["all_global"]
    per_pair = 4 * cfg.num_heads * cfg.head_dim
    lin = L * linear_flops_per_token(cfg) + 2 * cfg.hidden_size * cfg.vocab_size
    win, full = lin + per_pair * (4 * (W * (W + 1) // 2 + (L - W) * W) + 2 * L * (L + 1) // 2), \
        lin + per_pair * 6 * L * (L + 1) // 2
    assert row["model_tflops"] * 1e12 == pytest.approx(win) and base["model_tflops"] * 1e12 == pytest.approx(full)
    assert row["predicted_speedup"] == pytest.approx(full / win)
    assert row["speedup"] == pytest.approx(base["prefill_seconds"] / row["prefill_seconds"])
    assert row["speedup_over_predicted"] == pytest.approx(row["speedup"] / row["predicted_speedup"])
    # one device's cache: local layers trimmed to their window (one forward: W rows), global ones every key
    assert row["kv_cache"]["trimmed"] and not base["kv_cache"]["trimmed"]
    cap = L + 2 + 8  # the prompt, the decode steps and the bench's spare rows
    assert row["kv_cache_over_all_global"] == pytest.approx((2 * cap + 4 * W) / (6 * cap))
    assert row["kv_per_token"]["ratio"] == pytest.approx((2 * L + 4 * W) / (6 * L))
    assert row["decode"]["step_seconds"] > 0 and base["decode"]["step_seconds"] > 0


def test_bench_prefill_all_global_needs_windows():
    with pytest.raises(SystemExit, match="--all-global needs a model whose sliding-window layers run"):
        prefill.run(bench_args("--random-weights", "tiny", "--cp-strategy", "dense", "--lengths", "64", "--all-global"))


def ring_rank(rank, world, out):
    prefill.run(bench_args("--random-weights", "tiny-gemma3", "--cp", str(world), "--cp-strategy", "ring",
                           "--lengths", "128", "--decode-steps", "0", "--all-global", "--out", out))


def test_ring_bytes_per_layer_kind_match_the_window(tmp_path):
    """cp=2 zigzag over 128 tokens (chunks of 32; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2), window
    16: a global layer passes each rank's 64-row block once (cp - 1 steps); a local layer sends only the
    W - 1 keys before each chunk its queries see across ranks (chunk 0 -> 1 and 2 -> 3; 1 -> 2 stays home)."""
    out = str(tmp_path / "ring.json")
    run_ranks(ring_rank, 2, out)
    row = json.loads(Path(out).read_text())["results"][0]
    cfg, cp, L, W = preset_config("tiny-gemma3"), 2, 128, 16
    kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # k and v of one token, float32
    glob = cp * (cp - 1) * (L // cp) * kv_row
    local = (2 * cp - 2) * (W - 1) * kv_row
    rb = row["ring_bytes"]
    assert (rb["local_layers"], rb["global_layers"]) == (4, 2)
    assert (rb["local_per_layer"], rb["global_per_layer"]) == (local, glob)
    assert rb["ratio"] == pytest.approx(local / glob)
    base = row["all_global"]["ring_bytes"]  # the baseline: every layer passes the whole ring
    assert base["local_layers"] == 0 and base["local_per_layer"] is None and base["global_per_layer"] == glob
