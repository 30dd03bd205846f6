"""Transformer.attention_hooks, the one way to change the attention a layer runs: the hooks hold
inside the block only (restored after it, also on error), blocks nest, and nothing else in the
package swaps a layer's attention function (a rule over the source, like test_layering)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from starshard.checkpoints.sources import random_model
from starshard.engine.model import dense_attend, dense_attend_int8_scores
from starshard.presets import preset_config
from starshard.runtime.cuda_graph import GraphDecoder
from starshard.runtime.local import LocalRunner

PKG = Path(__file__).resolve().parents[2] / "starshard"


@pytest.fixture(scope="module")
def model():
    return random_model(preset_config("tiny"), dtype=torch.float32, seed=1)


def recorder(calls: list, tag):
    def attend(q, k, v, pos, cache, sparse=None):
        calls.append(tag)
        return dense_attend(q, k, v, pos, cache, sparse=sparse)

    return attend


def test_hooks_hold_inside_the_block_only(model):
    n = len(model.layers)
    ids = torch.arange(9)[None]
    assert not model.hooked and model.layer_attends() == [dense_attend] * n
    with torch.no_grad():
        want = model(ids)
        calls = []
        with model.attention_hooks([recorder(calls, i) for i in range(n)]):
            assert model.hooked
            got = model(ids)
        assert calls == list(range(n))  # each layer ran its own hook, in order
        assert torch.equal(got, want)  # the hooks attend densely: same logits
        assert not model.hooked and model.layer_attends() == [dense_attend] * n
        calls.clear()
        with pytest.raises(RuntimeError, match="boom"):
            with model.attention_hooks(recorder(calls, "all")):
                model(ids)
                raise RuntimeError("boom")
        assert calls == ["all"] * n and not model.hooked  # restored after the error
        model(ids)
        assert calls == ["all"] * n  # the plain forward no longer reaches the hook


def test_hooks_nest(model):
    n = len(model.layers)
    outer, inner = [], []
    outer_fns = [recorder(outer, i) for i in range(n)]
    with torch.no_grad(), model.attention_hooks(outer_fns):
        with model.attention_hooks(recorder(inner, "in")):
            model(torch.arange(5)[None])
        assert model.layer_attends() == outer_fns
        model(torch.arange(5)[None])
    assert inner == ["in"] * n and outer == list(range(n))
    assert not model.hooked


def test_one_hook_per_held_layer(model):
    with pytest.raises(ValueError, match="one per held layer"):
        with model.attention_hooks([dense_attend]):
            pass
    assert not model.hooked


def test_int8_scores_is_the_models_own_attention(model):
    """--fp8 attention is a model setting, not a hook: the graph decoder still counts as local."""
    n = len(model.layers)
    model.int8_scores = True
    try:
        assert model.layer_attends() == [dense_attend_int8_scores] * n and not model.hooked
        assert LocalRunner(model).decode_is_local()
        with model.attention_hooks(dense_attend):
            assert model.layer_attends() == [dense_attend] * n
            assert not LocalRunner(model).decode_is_local()  # a caller's hook: decode runs eagerly through it
        assert model.layer_attends() == [dense_attend_int8_scores] * n
    finally:
        model.int8_scores = False


def test_graph_decoder_restores_the_enclosing_hooks(model):
    """GraphDecoder's step installs its own hooks for the step (the capture records them) and hands
    back whatever was active around it."""
    runner = LocalRunner(model)
    cache = runner.new_cache(12)
    dec = GraphDecoder(model, cache, capture=False)
    calls = []
    outer = [recorder(calls, i) for i in range(len(model.layers))]
    with torch.no_grad():
        model(torch.arange(6)[None], cache=cache)
        with model.attention_hooks(outer):
            dec.step(torch.tensor([[3]]))
            assert model.layer_attends() == outer
    assert calls == [] and not model.hooked and cache.length == 7


def assigned_attributes(tree: ast.AST):
    """(attribute name, line) of every `x.name = ...` / `x.name += ...` / `setattr(x, "name", ...)`."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute):
                    yield sub.attr, node.lineno
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            yield node.args[1].value, node.lineno


def test_only_the_model_sets_a_layers_attention():
    """No module swaps `layer.attention.attend` or the model's hook list: callers use
    Transformer.attention_hooks (engine/model.py)."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for name, line in assigned_attributes(ast.parse(path.read_text(), str(path))):
            if name == "attend" or (name == "_hooks" and rel != "engine/model.py"):
                bad.append(f"starshard/{rel}:{line} assigns .{name}")
    assert not bad, ("set a layer's attention with `with model.attention_hooks(fn_or_per_layer_fns):` "
                     "(engine/model.py), not by assignment:\n" + "\n".join(bad))
