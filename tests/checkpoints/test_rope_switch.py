"""--rope-scaling yarn:FACTOR (LLM(..., rope_scaling=...)): a plain-RoPE model runs with the YaRN scaling
transformers computes for a config that declares it, its window FACTOR times longer; bad values and models
whose config already sets another scaling are refused, naming the fix."""
import dataclasses
import math

import pytest
import torch
from tests.helpers.hf_models import make_hf_model

from starshard.checkpoints.rope import parse_rope_scaling, with_rope_scaling
from starshard.commands import infer
from starshard.config import ModelConfig
from starshard.engine.model import rope_inv_freq
from starshard.llm import LLM

N = 512  # the tiny models' max_position_embeddings


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))


def test_switch_is_the_yarn_transformers_runs_for_a_declaring_config(qwen2, tmp_path):
    hf, path = qwen2
    llm = LLM(str(path), progress=False, rope_scaling="yarn:4")
    cfg = llm.config
    assert cfg.max_position_embeddings == 4 * N and cfg.rope_scaling.type == "yarn"
    # the same model with yarn declared in its config.json, as transformers runs it
    declared = dict(hf.config.to_dict(), rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": N})
    assert cfg == ModelConfig.from_hf(declared)
    yarn_hf = type(hf)(type(hf.config)(**declared)).eval()
    yarn_hf.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 211, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, plain, out = yarn_hf(ids).logits, hf(ids).logits, llm.model(ids)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-4
    assert ((plain - ref).norm() / ref.norm()).item() > 1e-3  # the switch changed the model
    # the path where each rank builds its own slices (random weights take it in one process) runs it too
    sliced = LLM(random_weights="tiny", progress=False, rope_scaling="yarn:4")
    plain = LLM(random_weights="tiny", progress=False).config
    assert sliced.config == with_rope_scaling(plain, "yarn:4") and sliced.config.max_position_embeddings == 4 << 20
    assert torch.equal(sliced.model.inv_freq, rope_inv_freq(sliced.config))
    assert sliced.model.rope_scale == pytest.approx(0.1 * math.log(4) + 1)  # YaRN's attention factor


@pytest.mark.parametrize("bad", ["yarn", "yarn:", "yarn:1", "yarn:0.5", "yarn:x", "yarn:inf", "linear:4", "4"])
def test_bad_values_are_refused(bad, capsys):
    with pytest.raises(ValueError, match="give yarn:FACTOR with FACTOR a number > 1, e.g. yarn:4"):
        parse_rope_scaling(bad)
    with pytest.raises(SystemExit) as e:
        infer.parse_args(["--rope-scaling", bad])
    assert e.value.code == 2 and "argument --rope-scaling: --rope-scaling" in capsys.readouterr().err


def test_a_model_with_its_own_scaling_is_refused_unless_identical(qwen2):
    hf, _ = qwen2
    cfg = ModelConfig.from_hf(dict(hf.config.to_dict(), rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": N}))
    assert with_rope_scaling(cfg, "yarn:4") is cfg
    with pytest.raises(ValueError, match=r"already sets RoPE scaling \(rope_scaling type 'yarn', factor 4.*drop "
                                         r"--rope-scaling"):
        with_rope_scaling(cfg, "yarn:2")
    linear = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, type="linear"))
    with pytest.raises(ValueError, match="rope_scaling type 'linear'"):
        with_rope_scaling(linear, "yarn:4")


def test_run_plans_the_raised_window(qwen2, capsys):
    _, path = qwen2
    base = ["--model", str(path), "--prompt-len", str(N + 100), "--max-new-tokens", "1", "--plan-only"]
    assert infer.main(base) == 2 and "window" in capsys.readouterr().err  # past the model's 512 positions
    assert infer.main([*base, "--rope-scaling", "yarn:4"]) == 0


def test_pattern_search_runs_past_the_window_only_with_the_switch(qwen2, tmp_path, capsys):
    """minference-search probes one sample's attention: past the model's window it would find patterns of
    positions the model never runs, so it is refused, naming --rope-scaling; with it the search runs the YaRN
    model and the config records the scaling."""
    from starshard.kernels.minference import MInferenceConfig
    from starshard.tools import minference_search as ms
    from starshard.tools.layer_probe import probe_layers

    _, path = qwen2
    # no tokenizer files: random ids of the model's vocabulary
    out = tmp_path / "cfg.json"
    args = ["--model", str(path), "--out", str(out), "--length", str(N + 88), "--layers", "0", "--block-size", "16",
            "--last-q", "16", "--force-sink", "4", "--force-local", "8", "--quiet"]
    with pytest.raises(SystemExit) as e:
        ms.main(args)
    assert e.value.code == 2 and f"past the model's window of {N}" in capsys.readouterr().err and not out.exists()
    ms.main([*args, "--rope-scaling", "yarn:2"])
    cfg = MInferenceConfig.load(out)
    assert cfg.meta["rope_scaling"] == "yarn:2" and cfg.meta["sample"]["tokens"] == N + 88 and cfg.layers[0]
    llm = LLM(str(path), progress=False)
    with pytest.raises(ValueError, match="--rope-scaling"):  # the library call refuses it too
        probe_layers(llm.model, list(range(N + 1)), lambda i, q, k: None)
