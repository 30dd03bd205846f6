"""probe_layers: each selected layer's post-RoPE q and k as the full forward computes them, the forward
stopping after the last selected layer, the model's attention back afterwards; --layers checked against the
model."""
import dataclasses
import importlib

import pytest
import torch

from starshard.checkpoints.sources import random_model
from starshard.cli import parse_layer_ids
from starshard.presets import preset_config
from starshard.tools.layer_probe import layers_error, probe_layers


@pytest.fixture(scope="module")
def model():
    return random_model(dataclasses.replace(preset_config("tiny"), num_layers=5), dtype=torch.float32, seed=5)


def test_probe_stops_after_the_last_selected_layer(model):
    n = len(model.layers)
    assert n >= 3
    ids = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(11)).tolist()
    whole = {}
    probe_layers(model, ids, lambda i, q, k: whole.setdefault(i, (q.clone(), k.clone())))
    assert sorted(whole) == list(range(n))

    ran, seen = [], {}

    def counting(i, fn):
        def attend(q, k, v, pos, cache, sparse=None, **extras):
            ran.append(i)
            return fn(q, k, v, pos, cache, sparse=sparse, **extras)
        return attend

    own = model.layer_attends()
    with model.attention_hooks([counting(i, fn) for i, fn in enumerate(own)]):
        probe_layers(model, ids, lambda i, q, k: seen.setdefault(i, (q, k)), [n - 2, 0])
    assert sorted(seen) == [0, n - 2]
    assert ran == list(range(n - 2)), "layers at and past the last selected one must not attend"
    for i in seen:
        torch.testing.assert_close(seen[i][0], whole[i][0], rtol=0, atol=0)
        torch.testing.assert_close(seen[i][1], whole[i][1], rtol=0, atol=0)
    assert model.layer_attends() == own  # the hooks are gone after the early stop

    out = model(torch.tensor([ids]), last_only=True)  # the model still runs whole afterwards
    assert out.shape[-2] == 1 and torch.isfinite(out).all()


def test_layers_flag_is_checked_against_the_model():
    assert parse_layer_ids(None) is None and layers_error(None, 4) is None
    assert parse_layer_ids("0, 2-3") == [0, 2, 3] and layers_error([0, 2, 3], 4) is None
    with pytest.raises(SystemExit, match="comma-separated layer ids or ranges"):
        parse_layer_ids("1-x")
    with pytest.raises(SystemExit, match="the range 5-3 runs backwards"):
        parse_layer_ids("0,5-3")
    assert "the model has layers 0..3" in layers_error([2, 4, 9], 4) and "[4, 9]" in layers_error([2, 4, 9], 4)
    assert "no layer" in layers_error([], 4)


@pytest.mark.parametrize("tool", ["minference_search", "anchor_calibrate"])
def test_tools_refuse_layers_past_the_model(tool, tmp_path, capsys):
    try:
        from starshard.checkpoints.default import default_checkpoint

        ckpt = default_checkpoint(progress=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    main = importlib.import_module(f"starshard.tools.{tool}").main
    out = tmp_path / "cfg.json"
    with pytest.raises(SystemExit):
        main(["--model", str(ckpt), "--out", str(out), "--length", "160", "--layers", "3,30", "--quiet"])
    assert "--layers names [30]: the model has layers 0..29" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("tool", ["minference_search", "anchor_calibrate"])
def test_tools_refuse_a_malformed_layers_list_before_loading(tool, tmp_path):
    main = importlib.import_module(f"starshard.tools.{tool}").main
    # the model path does not exist: the --layers error must come before any loading
    with pytest.raises(SystemExit, match="the range 5-3 runs backwards"):
        main(["--model", str(tmp_path / "absent"), "--out", str(tmp_path / "cfg.json"), "--layers", "0,5-3", "--quiet"])
