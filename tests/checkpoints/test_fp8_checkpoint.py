"""FP8 checkpoints (issue 19): the converter's --fp8 linear writes each rank's projections as e4m3 +
float32 channel scales, bit-identical to what --fp8 linear computes at load time from the same shards
(tp=2 and pp=2, on gloo and merged into one process), half the bytes; the refusals that name the fix.
Also --fp8 kv through USP, and the service's cached follow-ups over an e4m3 context cache."""
import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from safetensors.torch import load_file
from tests.engine.test_fp8 import _last_logits, rel
from tests.engine.test_model_families_moe import make_moe_model
from tests.serving.test_service_engine import _ask, _tokens

from starshard import LLM
from starshard.checkpoints.convert import convert, fp8_specs, is_fp8_linear
from starshard.checkpoints.convert import main as convert_main
from starshard.checkpoints.hf import plan_shard
from starshard.checkpoints.load import CheckpointError, load_model
from starshard.checkpoints.sources import RandomSource
from starshard.config import FP8_LINEARS, ParallelConfig
from starshard.kernels.fp8 import FP8_DTYPE, quantize_rows
from starshard.partition import TPShard, partition_layers, valid_tp_sizes
from starshard.parallel import fp8 as parallel_fp8
from starshard.parallel.fp8 import COLUMN_PARALLEL, ROW_PARALLEL, Fp8Linear
from starshard.planner import Layout, Workload, plan_memory
from starshard.presets import preset_config
from starshard.serving.scheduler import Scheduler

STEPS = 6
ROOT = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every tensor of the two models' state dicts equal bit for bit (e4m3 compared as bytes)."""
    sa, sb = ({k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)} for m in (a, b))
    return sorted(sa) == sorted(sb) and all(
        sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama (8 heads, 2 KV heads) and its FP8 checkpoints: tp=2 and pp=2, float32 elsewhere."""
    base = tmp_path_factory.mktemp("fp8ckpt")
    _, hf = make_hf_model("llama", base, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                          eos_token_id=None)
    ckpts = {f"{lay}": convert(out=base / lay, hf_dir=hf, dtype="float32", fp8="linear", progress=False,
                               **{lay[:2]: 2}) for lay in ("tp2", "pp2")}
    ids = torch.randint(0, 211, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    return hf, ckpts, ids


# ---------------------------------------------------------------------------- what the converter writes
def test_converter_quantizes_each_rank_shard_after_slicing(model):
    """Column-parallel (wqkv, w13): quantizing per output channel commutes with the row slicing. Row-parallel
    (wo, w2): a rank's scale is the amax over its own input columns, which quantize-then-slice would not give;
    the converter writes slice-then-quantize, what load-time quantization of the rank's shard computes."""
    hf, ckpts, _ = model
    full = load_file(str(next(hf.glob("*.safetensors"))))
    manifest = json.loads((ckpts["tp2"] / "manifest.json").read_text())
    assert manifest["fp8"] == ["linear"] and manifest["dtype"] == "float32"
    cfg_heads = 8 * 8  # q rows = heads x head_dim
    ffn = 72
    for t in range(2):
        shard = load_file(str(ckpts["tp2"] / f"model-tp{t}-pp0.safetensors"))
        assert shard["layers.0.attention.wqkv.weight"].dtype == FP8_DTYPE
        assert shard["layers.0.attention.wqkv.weight_scale"].dtype == torch.float32
        assert shard["tok_embeddings.weight"].dtype == torch.float32 and "output.weight_scale" not in shard
        q_cols = slice(t * cfg_heads // 2, (t + 1) * cfg_heads // 2)
        f_rows = slice(t * ffn // 2, (t + 1) * ffn // 2)
        # row-parallel: wo's columns of this rank
        o = full["model.layers.1.self_attn.o_proj.weight"]
        w8, s = quantize_rows(o[:, q_cols])
        assert torch.equal(_bits(shard["layers.1.attention.wo.weight"]), _bits(w8))
        assert torch.equal(shard["layers.1.attention.wo.weight_scale"], s)
        w8_full, s_full = quantize_rows(o)
        assert not torch.equal(s, s_full)  # quantize-then-slice would give other scales (and bytes)
        assert not torch.equal(_bits(w8), _bits(w8_full[:, q_cols]))
        # column-parallel: gate rows of this rank; slicing rows commutes with per-row quantization
        g = full["model.layers.1.mlp.gate_proj.weight"]
        w13 = shard["layers.1.feed_forward.w13.weight"]
        assert torch.equal(_bits(w13[: ffn // 2]), _bits(quantize_rows(g)[0][f_rows]))
        assert torch.equal(shard["layers.1.feed_forward.w13.weight_scale"][: ffn // 2], quantize_rows(g)[1][f_rows])


def test_fp8_names_are_the_ones_quantized_at_load_time():
    assert set(FP8_LINEARS) == set(COLUMN_PARALLEL + ROW_PARALLEL)
    assert is_fp8_linear("layers.3.feed_forward.w2.weight") and is_fp8_linear("layers.0.attention.wqkv.weight")
    assert not is_fp8_linear("layers.0.feed_forward.experts.w13") and not is_fp8_linear("layers.0.attention.wqkv.bias")
    assert not is_fp8_linear("output.weight") and not is_fp8_linear("layers.0.attention_norm.weight")


def test_fp8_checkpoint_is_about_half_the_bytes(model, tmp_path):
    """bf16 checkpoint vs the same with --fp8 linear (tp=2): every projection drops from 2 bytes per weight to
    1 plus 4 per output channel; the rest is unchanged."""
    hf = model[0]
    sizes = {}
    for fp8 in (None, "linear"):
        out = convert(out=tmp_path / str(fp8), hf_dir=hf, tp=2, fp8=fp8, progress=False)
        sizes[fp8] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        if fp8:
            shards = [load_file(str(out / f"model-tp{t}-pp0.safetensors")) for t in range(2)]
    proj = sum(v.numel() for sd in shards for v in sd.values() if v.dtype == FP8_DTYPE)
    channels = sum(v.numel() for sd in shards for k, v in sd.items() if k.endswith("weight_scale"))
    headers = 4096  # both files' JSON headers; the FP8 one names the scale tensors too
    assert abs(sizes[None] - sizes["linear"] - (proj - 4 * channels)) < headers
    # this tiny model is a third embedding / head (bf16 in both); Llama-3.1-8B's projections are 87% of it
    assert sizes["linear"] < 0.7 * sizes[None]


def test_moe_experts_stay_in_the_compute_dtype(tmp_path):
    """Qwen3-MoE with a dense layer among the sparse ones: attention projections and the dense MLP in e4m3,
    the experts and router in the checkpoint's dtype; loads equal to load-time quantization."""
    hf = tmp_path / "moe"
    make_moe_model("qwen3-moe", hf)
    ckpt = convert(out=tmp_path / "moe-fp8", hf_dir=hf, dtype="float32", fp8="linear", progress=False)
    shard = load_file(str(ckpt / "model-tp0-pp0.safetensors"))
    assert shard["layers.0.feed_forward.experts.w13"].dtype == torch.float32
    assert shard["layers.0.attention.wo.weight"].dtype == FP8_DTYPE
    assert shard["layers.1.feed_forward.w2.weight"].dtype == FP8_DTYPE  # the dense layer (mlp_only_layers)
    stored, quantized = LLM(ckpt, fp8="linear"), LLM(hf, fp8="linear")
    assert same_state(stored.model, quantized.model)


@pytest.mark.parametrize("preset", ["tiny", "llama-3.1-8b", "tiny-moe", "qwen3-30b-a3b"])
def test_planner_counts_the_bytes_the_fp8_converter_writes(preset):
    """--fp8 linear in the memory plan == the bytes of the FP8 converter's tensors on every (tp, pp) rank:
    e4m3 projections, float32 channel scales, everything else (MoE experts included) in the compute dtype."""
    cfg = preset_config(preset)
    src = RandomSource(cfg, 0, None, "cpu")  # only has() is used: which tensors exist
    for tp in valid_tp_sizes(cfg, 4):
        for pp in (1, 2):
            stages = partition_layers(cfg.num_layers, pp, None)
            plan = plan_memory(cfg, Layout(tp=tp, pp=pp), Workload(16, dtype_bytes=2, fp8_linear=True))
            for p, layers in enumerate(stages):
                specs = fp8_specs(plan_shard(cfg, src, TPShard(cfg, tp, tp - 1), layers, p == 0, p == pp - 1),
                                  torch.bfloat16)
                stored = sum(math.prod(s.shape) * (s.dtype or torch.bfloat16).itemsize for s in specs)
                assert plan.stages[p].weights == stored, (preset, tp, pp, p)


def test_plan_only_reflects_fp8(model, capsys):
    """launch/infer.py --plan-only: --fp8 linear,kv in the JSON and the table, e4m3 bytes in the weights and KV;
    an FP8 checkpoint without --fp8 linear refused at plan time with the fix."""
    hf, ckpts, _ = model
    spec = importlib.util.spec_from_file_location("infer_cli", ROOT / "starshard" / "commands" / "infer.py")
    infer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(infer)
    plans = {}
    for path, fp8 in ((hf, None), (ckpts["pp2"], "linear,kv")):
        argv = ["--model", str(path), "--prompt-len", "40", "--max-new-tokens", "8", "--pp", "2", "--plan-only", "--json"]
        assert infer.main(argv + (["--fp8", fp8] if fp8 else [])) == 0
        plans[fp8] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert infer.main(argv[:-1] + (["--fp8", fp8] if fp8 else [])) == 0
        assert ("(fp8: linear,kv)" in capsys.readouterr().out) == (fp8 is not None)
    assert plans[None]["fp8"] == [] and plans["linear,kv"]["fp8"] == ["linear", "kv"]
    for bf, f8 in zip(plans[None]["stages"], plans["linear,kv"]["stages"]):
        assert f8["weights"] < bf["weights"] and f8["kv_cache"] < bf["kv_cache"]
    assert infer.main(["--model", str(ckpts["pp2"]), "--prompt-len", "40", "--pp", "2", "--plan-only", "--fp8", "kv"]) == 2
    assert "add --fp8 linear" in capsys.readouterr().err


# ---------------------------------------------------------------------------- loading in one process
def test_one_process_load_equals_load_time_quantization(model, monkeypatch):
    """pp=2 shards merged into one process: Fp8Linear modules filled from the stored e4m3 bytes (nothing real
    is quantized while loading), every tensor and the logits equal to quantizing the HF weights at load time."""
    hf, ckpts, ids = model
    seen = []

    def recording(x):
        seen.append(x.device.type)
        return quantize_rows(x)

    monkeypatch.setattr(parallel_fp8, "quantize_rows", recording)
    stored = LLM(ckpts["pp2"], fp8="linear")
    assert seen and set(seen) == {"meta"}  # empty modules on the meta model; the weights come as stored
    quantized = LLM(hf, fp8="linear")
    assert "cpu" in seen
    wo = stored.model.layers[2].attention.wo
    assert isinstance(wo, Fp8Linear) and wo.weight.dtype == FP8_DTYPE and wo.weight_scale.dtype == torch.float32
    assert same_state(stored.model, quantized.model)
    assert torch.equal(_last_logits(stored, ids), _last_logits(quantized, ids))
    kv = LLM(ckpts["pp2"], fp8="linear,kv", dtype=torch.bfloat16)
    assert kv.runner.new_cache(4).layer(0).k.dtype == FP8_DTYPE
    wo = kv.model.layers[0].attention.wo  # a bf16 run: the scales stay float32, the rest is cast
    assert wo.weight.dtype == FP8_DTYPE and wo.weight_scale.dtype == torch.float32
    assert kv.model.output.weight.dtype == torch.bfloat16


def test_e4m3_bytes_are_checksummed(model, tmp_path):
    """A flipped byte inside a stored e4m3 weight fails the manifest's sha256, as for every other tensor."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(model[1]["pp2"], ckpt)
    shard = ckpt / "model-tp0-pp0.safetensors"
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8 : 8 + n])["layers.0.attention.wqkv.weight"]["data_offsets"][0]
    raw[8 + n + start + 5] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 'layers.0.attention.wqkv.weight'"):
        LLM(ckpt, fp8="linear")


def test_refusals_name_the_fix(model, capsys):
    hf, ckpts, _ = model
    for fp8 in (None, "kv", "none"):
        with pytest.raises(CheckpointError, match="stores the decoder projections in FP8 e4m3.*add --fp8 linear"):
            LLM(ckpts["pp2"], fp8=fp8)
    with pytest.raises(CheckpointError, match="cut for tp=2.*run with --tp 2.*convert again with --tp 1"):
        LLM(ckpts["tp2"], fp8="linear")  # tp=2 shards do not merge: row-parallel scales are per rank
    with pytest.raises(CheckpointError, match=r"LLM\(path, fp8=\"linear\"\)"):
        load_model(ckpts["pp2"])
    with pytest.raises(SystemExit):
        convert_main(["--hf", str(hf), "--out", str(ckpts["pp2"].parent / "x"), "--fp8", "kv"])
    assert "stores only `linear`" in capsys.readouterr().err


# ---------------------------------------------------------------------------- gloo ranks
USP = [{"cp": 2, "cp_strategy": "usp", "ulysses_degree": 2}, {"cp": 2, "cp_strategy": "usp", "ulysses_degree": 1}]


def _layouts(hf, ckpts, ids):
    """tp=2 and pp=2 from the FP8 shards next to load-time quantization of the HF weights in that layout."""
    out = {}
    for name, par in (("tp2", ParallelConfig(tp=2)), ("pp2", ParallelConfig(pp=2))):
        stored = LLM(ckpts[name], parallel=par, fp8="linear")
        quantized = LLM(hf, parallel=par, fp8="linear")
        r = {"same_state": same_state(stored.model, quantized.model),
             "fp8_modules": sum(isinstance(m, Fp8Linear) for m in stored.model.modules()),
             "tokens": stored.generate(ids, max_new_tokens=STEPS).token_ids,
             "quantized_tokens": quantized.generate(ids, max_new_tokens=STEPS).token_ids}
        with torch.inference_mode():
            for key, llm in (("logits", stored), ("quantized_logits", quantized)):
                runner = llm.runner
                r[key] = runner.logits(torch.tensor([ids]), runner.new_cache(len(ids)), last_only=False)
        out[name] = r
    return out


def _usp(hf, ids):
    """USP layouts with a float32 and an e4m3 KV cache."""
    out = []
    for lay in USP:
        row = {}
        for fp8 in (None, "kv"):
            llm = LLM(hf, parallel=ParallelConfig(**lay), fp8=fp8)
            row[fp8] = {"tokens": llm.generate(ids, max_new_tokens=STEPS).token_ids, "logits": _last_logits(llm, ids),
                        "kv_dtype": llm.runner.new_cache(4).layer(llm.model.layer_ids[0]).k.dtype}
        out.append(row)
    return out


def _rank(rank, world, hf, ckpts, ids):
    return {"layouts": _layouts(hf, ckpts, ids), "usp": _usp(hf, ids)}


@pytest.fixture(scope="module")
def ranks(model):
    """One spawn of 2 gloo ranks for the tests below (megatron-core's import, ~10 s a rank, paid once)."""
    hf, ckpts, ids = model
    return run_ranks(_rank, 2, hf, ckpts, ids)


@pytest.mark.slow
def test_fp8_checkpoint_on_tp2_and_pp2_ranks(model, ranks):
    """tp=2 and pp=2 on gloo from the FP8 shards: every rank's tensors equal load-time quantization of the HF
    weights for that layout (bit for bit: logits and tokens equal); pp=2 gives the one-process FP8 run's
    tokens and logits."""
    hf, _, ids = model
    one = LLM(hf, fp8="linear")
    want_tokens = one.generate(ids, max_new_tokens=STEPS).token_ids
    with torch.inference_mode():
        want_logits = one.model(torch.tensor([ids]))[0]
    for name in ("tp2", "pp2"):
        for rank, res in enumerate(ranks):
            r = res["layouts"][name]
            assert r["same_state"] and r["fp8_modules"] > 0, (name, rank)
            assert r["tokens"] == r["quantized_tokens"], (name, rank)
            if r["logits"] is not None:
                assert torch.equal(r["logits"], r["quantized_logits"]), (name, rank)
    # pp=2 holds the one process's tensors, split by layer: the last stage's logits and every rank's tokens
    pp = [res["layouts"]["pp2"] for res in ranks]
    assert all(r["tokens"] == want_tokens for r in pp)
    pp_logits = [r["logits"] for r in pp if r["logits"] is not None]
    assert len(pp_logits) == 1 and rel(pp_logits[0][0], want_logits) < 1e-6
    tp_logits = ranks[0]["layouts"]["tp2"]["logits"][0]
    assert 0 < rel(tp_logits, want_logits) < 0.03  # tp=2: row-parallel shards have their own channel scales


@pytest.mark.slow
def test_fp8_kv_cache_under_usp(ranks):
    """USP (cp=2 as all-Ulysses and as all-ring) with an e4m3 cache: the same greedy tokens as the same layout
    with a float32 cache, and the logits of a step that reads the cache within a bound."""
    for i, lay in enumerate(USP):
        for r in (res["usp"][i] for res in ranks):
            assert r["kv"]["kv_dtype"] == FP8_DTYPE and r[None]["kv_dtype"] == torch.float32, lay
            assert r["kv"]["tokens"] == r[None]["tokens"], lay
            if r[None]["logits"] is not None:
                assert 0 < rel(r["kv"]["logits"], r[None]["logits"]) < 0.02, lay
        assert any(res["usp"][i][None]["logits"] is not None for res in ranks), lay


# ---------------------------------------------------------------------------- the service
def test_service_cached_follow_up_with_fp8_cache():
    """Scheduler over --fp8 kv: the document's cached e4m3 KV serves follow-ups; each answer equals an uncached
    run with the same FP8 setting (the question prefilled behind the document's e4m3 cache)."""
    llm = LLM(random_weights="tiny", progress=False, fp8="kv")
    rng = np.random.default_rng(2)
    doc = [int(x) for x in rng.integers(1, 500, 200)]
    questions = [[int(x) for x in rng.integers(1, 500, 5)] for _ in range(2)]
    svc = Scheduler(llm, cache_bytes=2**26, max_batch=2)
    svc.start()
    try:
        answers = []
        for q in questions:
            events, done = _ask(svc, doc + q, STEPS)
            assert done.wait(60)
            answers.append(events)
        assert [a[-1].cached_tokens for a in answers] == [0, len(doc)]
        for events, q in zip(answers, questions):
            assert _tokens(events) == llm.generate(doc + q, max_new_tokens=STEPS, prefill_chunk=len(doc)).token_ids
        entry = next(iter(svc.cache.entries.values()))
        assert entry.kv.layer(0).stored().k.dtype == FP8_DTYPE
        attn = llm.model.layers[0].attention  # the budget counts e4m3 bytes + a float32 scale per (head, token)
        per_token = len(llm.model.layers) * (2 * attn.n_kv_heads * (attn.head_dim + 4) + 8)
        assert svc.executor.token_bytes() == per_token and entry.nbytes == svc.executor.entry_bytes(len(entry))
    finally:
        svc.shutdown()
