"""AnchorAttention calibrated per model: per-head thresholds in the kernels (against the paper's
formula per head and a float64 masked reference, Triton interpreted in fp32/fp16), the calibration's
recall / density curves against the kernels' own selection, the config file, and the round trip
calibration -> file -> --sparse anchor --sparse-config -> a run that uses those thresholds.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.helpers.sparse_reference import assert_matches, masked_reference  # noqa: E402
from tests.kernels.test_anchor import assert_selection_matches, make, plain_selection, reference_vis  # noqa: E402

from starshard.cli import add_sparse_arguments, layout_error, sparse_config  # noqa: E402
from starshard.kernels import anchor as an  # noqa: E402
from starshard.kernels.anchor_model import AnchorModelConfig  # noqa: E402
from starshard.kernels.minference import MInferenceConfig  # noqa: E402
from starshard.kernels.sparse import SparseConfig, load_sparse_method, sparse_report  # noqa: E402
from starshard.llm import LLM  # noqa: E402
from starshard.tools import anchor_calibrate as ac  # noqa: E402

CFG = an.AnchorConfig(theta=0.0, block_q=16, block_k=16, init_tokens=5, local_window=7, step=2)


def per_head(cfg, thetas):
    return an.AnchorConfig(**{**cfg.to_dict(), "theta": tuple(thetas)})


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_head_theta_selects_each_head_by_its_own_formula(backend):
    q, k, v, q_pos, k_pos, off = make("batch_gqa_d24", torch.float32, seed=3)
    thetas = (1.0, 2.5, -math.inf, 1.75, math.inf, 3.0)  # 6 query heads, 2 KV heads
    cfg = per_head(CFG, thetas)
    index = an.build_index(q, k, cfg, offset=off, backend=backend)
    for h, t in enumerate(thetas):
        one = an.AnchorConfig(**{**CFG.to_dict(), "theta": t})
        _, sel, margin = plain_selection(q, k, one, off)
        mine = {key: keys for key, keys in sel.items() if key[1] == h}
        assert_selection_matches(index, mine, margin, 1e-4)
    assert int(index.count[:, 2].sum()) == 0  # -inf: no stripes
    ws = an.window_starts(CFG, Lq=q.shape[2], offset=off)
    assert torch.equal(index.count[0, 4].long(), (ws.clamp(max=k.shape[2]) - 5).clamp(min=0))  # inf: all


@pytest.mark.parametrize("case", ["tail-fp32", "batch_gqa_d24-fp16", "past_keys-fp32"])
def test_per_head_theta_kernel_matches_masked_reference(case):
    layout, dt = case.split("-")
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dt]
    q, k, v, q_pos, k_pos, off = make(layout, dtype, seed=4)
    B, hq, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    cfg = per_head(CFG, [2.0 + 1.0 * h for h in range(hq)])
    index = an.build_index(q, k, cfg, offset=off, backend="triton")
    if layout != "past_keys":
        counts = index.count.sum((0, 2))
        assert counts[0] < counts[-1]  # the thresholds differ per head, and so do the selections
    vis = reference_vis(cfg, index, B, hq, lq, lk, off)
    ref, ref_lse = masked_reference(q, k, v, vis)
    out, lse = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg, backend="triton")
    assert_matches(out, lse, ref, ref_lse, dtype)
    out_t, lse_t = an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg, backend="torch")
    assert_matches(out_t, lse_t, ref, ref_lse, dtype)


def test_per_head_theta_validation_and_dict():
    cfg = per_head(CFG, [1, 2.5])
    assert cfg.theta == (1.0, 2.5) and an.AnchorConfig.from_dict(cfg.to_dict()) == cfg
    q, k, v, q_pos, k_pos, off = make("square_odd", torch.float32)  # 4 heads
    with pytest.raises(ValueError, match="2 per-head thetas but the call has 4"):
        an.anchor_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, config=cfg, backend="torch")
    for bad in ([], [1.0, float("nan")], ["x"]):
        with pytest.raises(ValueError, match="per head"):
            per_head(CFG, bad)


def test_curves_match_the_kernels_selection():
    """Recall and density at grid thetas equal what the identification kernels select at that theta."""
    g = torch.Generator().manual_seed(7)
    Hq, Hkv, L, D = 4, 2, 203, 16
    q, k = torch.randn(1, Hq, L, D, generator=g) * 1.5, torch.randn(1, Hkv, L, D, generator=g)
    k[0, :, 40:44] *= 3.0  # a few keys stand out
    grid = ac.theta_grid(-2.0, 8.0, 0.5)
    rec, den = ac.layer_curves(q, k, CFG, grid, recall_rows=48)
    rows = ac.sample_rows(L, 48)
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * D**-0.5
    causal = torch.arange(L)[None, :] <= torch.arange(L)[:, None]
    p = torch.softmax(s.masked_fill(~causal, -math.inf), -1)[0, :, rows]
    assert (rec[:, 1:] >= rec[:, :-1] - 1e-12).all() and (den[:, 1:] >= den[:, :-1] - 1e-12).all()
    assert (rec[:, -1] - 1).abs().max() < 1e-5 and (den[:, -1] - 1).abs().max() < 1e-12
    for i in (0, 4, 9, 13, grid.numel() - 1):
        cfg = an.AnchorConfig(**{**CFG.to_dict(), "theta": float(grid[i])})
        index = an.build_index(q, k, cfg, offset=0, backend="torch")
        want_d = an.head_density(index, cfg, Lq=L, Lk=L, offset=0)[0]
        vis = reference_vis(cfg, index, 1, Hq, L, L, 0)[0, :, rows]
        want_r = (p * vis).sum(-1).mean(-1)
        torch.testing.assert_close(den[:, i], want_d, rtol=0, atol=1e-12)
        torch.testing.assert_close(rec[:, i], want_r, rtol=0, atol=1e-6)
    assert 0.2 < float(rec[:, 9].mean()) < 0.999  # the grid spans sparse and dense selections


def test_choose_takes_the_smallest_theta_reaching_the_target():
    grid = torch.tensor([-math.inf, 0.0, 1.0, 2.0, math.inf], dtype=torch.float64)
    rec = torch.tensor([[0.5, 0.8, 0.96, 0.99, 1.0], [0.97, 0.98, 0.99, 1.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.9999999]])
    den = torch.linspace(0.1, 1.0, 5).expand(3, 5)
    picks = ac.choose(rec, den, grid, 0.95)
    assert [t for t, _, _ in picks] == [1.0, -math.inf, math.inf]
    assert picks[0][1] == pytest.approx(0.96) and picks[0][2] == pytest.approx(float(den[0, 2]))


def test_config_file_round_trip_and_errors(tmp_path):
    cfg = AnchorModelConfig(layers=[{0: 1.5, 1: math.inf}, {}, {2: -math.inf}], default=12.0, block_q=32, step=2,
                            init_tokens=8, scores=[{0: {"score": 0.97, "density": 0.2}}, {}, {}], meta={"x": 1})
    path = tmp_path / "a.json"
    cfg.save(path)
    text = path.read_text()
    assert "Infinity" not in text and '"inf"' in text  # plain JSON
    back = AnchorModelConfig.load(path)
    assert back.layers == cfg.layers and back.scores[0] == {0: {"score": 0.97, "density": 0.2}}
    p = back.pattern(0, num_heads=3)
    assert p.theta == (1.5, math.inf, 12.0) and (p.block_q, p.step, p.init_tokens) == (32, 2, 8)
    assert back.pattern(0, 2, head_offset=1).theta == (math.inf, 12.0)
    assert back.pattern(1, 3).theta == 12.0 and back.pattern(7, 2).theta == 12.0  # unnamed: the default
    with pytest.raises(ValueError, match="not an AnchorAttention config"):
        AnchorModelConfig.from_dict(MInferenceConfig().to_dict())
    with pytest.raises(ValueError, match="not a MInference config"):
        MInferenceConfig.from_dict(cfg.to_dict())
    with pytest.raises(ValueError, match="theta"):
        AnchorModelConfig.from_dict({"format": "starshard.anchor/1", "layers": [{"0": {"theta": "big"}}]})
    with pytest.raises(ValueError, match="powers of two"):
        AnchorModelConfig(block_q=24)


def _cli(*argv):
    ap = argparse.ArgumentParser()
    add_sparse_arguments(ap)
    return ap.parse_args(list(argv))


def _tiny(sparse=None):
    """The tiny random preset with its queries scaled up: random weights give near-uniform attention,
    where every threshold keeps all keys or none; sharper scores give the thresholds a range."""
    llm = LLM(random_weights="tiny", progress=False, device="cpu", dtype=torch.float32, sparse=sparse)
    qs = llm.config.num_heads * llm.config.head_dim
    with torch.no_grad():
        for layer in llm.model.layers:
            layer.attention.wqkv.weight[:qs] *= 8
    return llm


def test_calibration_round_trip_on_a_tiny_model(tmp_path):
    """calibrate -> file -> `--sparse anchor --sparse-config FILE` -> the run computes what the file says."""
    ids = torch.randint(0, 512, (190,), generator=torch.Generator().manual_seed(1)).tolist()
    base = an.AnchorConfig(theta=12.0, block_q=16, block_k=16, init_tokens=4, local_window=0, step=1)
    llm = _tiny()
    grid = ac.theta_grid(-2.0, 6.0, 0.125)
    found = ac.calibrate(llm.model, [ids, ids[::-1]], base, target=0.9, grid=grid, progress=False, recall_rows=64)
    path = tmp_path / "anchor.json"
    found.save(path)
    layers, heads = 2, 4  # the tiny preset
    data = json.loads(path.read_text())
    assert data["format"] == "starshard.anchor/1" and len(data["layers"]) == layers
    entries = [e for layer in data["layers"] for e in layer.values()]
    assert len(entries) == layers * heads and all(e["score"] >= 0.9 for e in entries)
    assert len({e["theta"] for e in entries}) > 1  # calibrated per head
    assert any(e["density"] < 0.97 for e in entries)  # and really sparse

    args = _cli("--sparse", "anchor", "--sparse-config", str(path), "--sparse-min-length", "0", "--sparse-no-fallback")
    sp = sparse_config(args)
    method = load_sparse_method(sp).method
    assert isinstance(method, AnchorModelConfig)
    got, want = method.pattern(1, heads).theta, [found.layers[1][h] for h in range(heads)]
    assert list(got) == want if isinstance(got, tuple) else set(want) == {got}

    # the run over the last prompt: layer 0's kept density per head is what the calibration measured on
    # it (later layers see the sparse layers' outputs: left at the default, theta inf, density 1)
    dense_default = an.AnchorConfig(**{**base.to_dict(), "theta": math.inf})
    single = ac.calibrate(llm.model, [ids], dense_default, target=0.9, grid=grid, layers=[0], progress=False,
                          recall_rows=64)
    single.save(path)
    run = _tiny(sparse_config(args))
    with torch.inference_mode():
        run.model(torch.tensor([ids]), cache=run.runner.new_cache(200), last_only=True)
    rep = sparse_report(run.model)
    assert rep["heads_sparse"] == layers * heads and rep["heads_dense"] == rep["heads_skipped"] == 0
    assert single.layers[1] == {} and single.default == math.inf
    want = (sum(single.scores[0][h]["density"] for h in range(heads)) + heads) / (layers * heads)
    assert want < 0.99
    assert rep["mean_density"] == pytest.approx(want, abs=1e-5)


def test_cli_refuses_conflicts_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="anchor_calibrate"):
        SparseConfig("anchor", str(tmp_path / "missing.json"))
    AnchorModelConfig().save(tmp_path / "a.json")
    for flag, value in (("--anchor-theta", "4"), ("--anchor-theta", "12"), ("--anchor-step", "16")):  # defaults too
        with pytest.raises(ValueError, match="drop --anchor-theta"):
            sparse_config(_cli("--sparse", "anchor", "--sparse-config", str(tmp_path / "a.json"), flag, value))
    with pytest.raises(ValueError, match="--sparse minference has none"):  # not silently ignored
        sparse_config(_cli("--sparse", "minference", "--anchor-block-q", "16"))
    uniform = sparse_config(_cli("--sparse", "anchor", "--anchor-theta", "4")).uniform_anchor()
    assert (uniform.theta, uniform.block_q, uniform.step) == (4.0, 128, 16)  # the paper's for what is not given
    args = _cli("--sparse-config", str(tmp_path / "a.json"))
    args.cp_strategy, args.cp = None, None
    assert "needs --sparse minference or --sparse anchor" in layout_error(args)
    with pytest.raises(ValueError, match="not a MInference config"):
        load_sparse_method(SparseConfig("minference", str(tmp_path / "a.json")))


def test_calibrate_cli_refuses_bad_samples_before_loading(tmp_path, capsys):
    """An unknown task or no sample is refused naming the fix, before any model is looked for (the path is missing)."""
    for bad, why in ((["--tasks", "multikey,nosuch"], "give one or more of"), (["--samples", "0"], "at least 1")):
        with pytest.raises(SystemExit):
            ac.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "a.json"), *bad])
        assert why in capsys.readouterr().err


def test_calibrate_cli_on_the_default_model(tmp_path, capsys):
    """The tool end to end (harness prompts through the tokenizer) on the embedded model, two layers."""
    try:
        from starshard.checkpoints.default import default_checkpoint

        ckpt = default_checkpoint(progress=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "anchor.json"
    summary = ac.main(["--model", str(ckpt), "--out", str(out), "--length", "256", "--samples", "1", "--layers", "0,5",
                       "--block-q", "16", "--step", "1", "--init-tokens", "4", "--device", "cpu", "--dtype", "float32",
                       "--recall-rows", "32", "--target-recall", "0.9", "--quiet"])
    cfg = AnchorModelConfig.load(out)
    assert len(cfg.layers) == 30 and len(cfg.layers[0]) == 9 and len(cfg.layers[5]) == 9 and not cfg.layers[1]
    assert summary["heads"] == 18 and 0.9 <= summary["mean_recall"] <= 1.0 + 1e-6
    assert cfg.meta["samples"]["tokens"][0] <= 256 and (cfg.block_q, cfg.step, cfg.init_tokens) == (16, 1, 4)
    assert cfg.meta["rope_scaling"] is None
    # a sample past the model's 8,192 positions: refused, naming the fix, nothing written
    with pytest.raises(SystemExit) as e:
        ac.main(["--model", str(ckpt), "--out", str(tmp_path / "long.json"), "--length", "8300", "--samples", "1",
                 "--layers", "0", "--device", "cpu", "--dtype", "float32", "--quiet"])
    assert e.value.code == 2 and not (tmp_path / "long.json").exists()
    assert "past the model's window of 8192" in capsys.readouterr().err


def test_bench_prompt_file_is_repeated_or_truncated(tmp_path):
    """launch/bench.py prefill --prompt-file: the text's ids (a blank line between copies) fill each length."""
    from starshard.benchmarks import prefill

    class Tok:  # one id per character
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    f = tmp_path / "t.txt"
    f.write_text("  abc \n")
    ids = prefill.text_ids(Tok(), str(f))
    assert ids == [ord(c) for c in "abc\n\n"]
    assert prefill.prompt_ids(3, 100, ids) == ids[:3]
    assert prefill.prompt_ids(12, 100, ids) == (ids * 3)[:12]
    rnd = prefill.prompt_ids(7, 100, None)
    assert torch.equal(rnd, prefill.prompt_ids(7, 100, None)) and rnd.shape == (7,) and int(rnd.max()) < 100
    (tmp_path / "e.txt").write_text(" \n")
    with pytest.raises(SystemExit, match="holds no text"):
        prefill.text_ids(Tok(), str(tmp_path / "e.txt"))
    with pytest.raises(SystemExit, match="needs a tokenizer"):
        prefill.text_ids(None, str(f))
    ns = argparse.Namespace(random_weights="tiny", model=None, prompt_file=str(f))
    assert "needs --model" in prefill.check(ns)
    p = argparse.ArgumentParser()
    prefill.add_arguments(p)
    assert prefill.check(p.parse_args(["--prompt-file", str(f)])) is None  # neither: the embedded SmolLM2
