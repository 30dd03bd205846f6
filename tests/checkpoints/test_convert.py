"""Converter round trip for tp x pp layouts, and the errors a user gets for broken inputs."""
import json
import shutil

import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from starshard.checkpoints.convert import convert, main as convert_main
from starshard.checkpoints.load import CheckpointError, check_layout, load_model, load_shard, read_manifest
from starshard.config import UnsupportedArchitectureError


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip(arch, tp, pp, tmp_path):
    # 6 heads / 2 KV heads; qwen2 is tied + biased. tp=2 splits KV heads, tp=... see below for replication.
    hf, path = make_hf_model(arch, tmp_path)
    out = convert(out=tmp_path / "ckpt", hf_dir=path, tp=tp, pp=pp, dtype="float32", progress=False)
    m = read_manifest(out)
    assert (m["tp"], m["pp"]) == (tp, pp) and len(m["shards"]) == tp * pp
    ids = torch.randint(0, 211, (1, 33), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits.detach()
    got = logits(load_model(out), ids)
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-4


def test_kv_heads_replicated_when_tp_exceeds_them(tmp_path):
    hf, path = make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2)
    out = convert(out=tmp_path / "ckpt", hf_dir=path, tp=6, pp=1, dtype="float32", progress=False)
    shard = load_shard(out, read_manifest(out), 3, 0)
    # 1 q head + 1 (replicated) k head + 1 v head, head_dim 8
    assert shard["layers.0.attention.wqkv.weight"].shape == (3 * 8, 48)
    ids = torch.arange(5, 30)[None]
    ref = hf(ids).logits.detach()
    assert ((logits(load_model(out), ids) - ref).norm() / ref.norm()).item() <= 1e-4


def test_bfloat16_shards_and_cli(tmp_path, capsys):
    _, path = make_hf_model("mistral", tmp_path)
    convert_main(["--hf", str(path), "--out", str(tmp_path / "c"), "--tp", "2", "--dtype", "bfloat16"])
    sd = load_shard(tmp_path / "c", read_manifest(tmp_path / "c"), 1, 0)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert "wrote" in capsys.readouterr().out


def test_invalid_tp_names_valid_sizes(tmp_path):
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    with pytest.raises(ValueError, match=r"tp=2 does not divide .*valid tp sizes: \[1, 3, 9\]"):
        convert(out=tmp_path / "c", hf_dir=path, tp=2, progress=False)


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="directory not found"):
        convert(out=tmp_path / "o", hf_dir=tmp_path / "nope", progress=False)
    _, path = make_hf_model("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM"):
        convert(out=tmp_path / "o", hf_dir=path, progress=False)


def test_missing_and_corrupted_shards(tmp_path):
    _, path = make_hf_model("llama", tmp_path)
    ckpt = convert(out=tmp_path / "ckpt", hf_dir=path, tp=2, dtype="float32", progress=False)
    manifest = read_manifest(ckpt)
    with pytest.raises(CheckpointError, match="converted for tp=2 pp=1.*--tp 4 --pp 1"):
        check_layout(manifest, ckpt, 4, 1)

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "model-tp1-pp0.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard file .*model-tp1-pp0"):
        load_model(broken)

    # Flip bytes inside the data section: the header still parses, the checksum catches it.
    f = ckpt / "model-tp0-pp0.safetensors"
    data = bytearray(f.read_bytes())
    data[-100:-90] = bytes(10)
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted shard .*checksum mismatch"):
        load_model(ckpt)
    f.write_bytes(bytes(data[:200]))  # truncated file
    with pytest.raises(CheckpointError, match="corrupted shard"):
        load_model(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises((CheckpointError, ValueError, FileNotFoundError)):
        load_model(ckpt)  # no manifest and no config.json: neither format


def test_dir_without_tokenizer_converts_with_a_warning(tmp_path, capsys):
    """An HF dir with weights and config but no tokenizer files (random-weight dirs, e.g. the FP8 checkpoint
    bench's) converts; the warning names the files looked for, even when the config has no model_type
    (transformers 5.17's tokenizer lookup raised AttributeError there instead of OSError / ValueError)."""
    _, path = make_hf_model("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("model_type", None)
    (path / "config.json").write_text(json.dumps(cfg))
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            f.unlink()
    out = convert(out=tmp_path / "ckpt", hf_dir=path, dtype="float32", progress=False)
    err = capsys.readouterr().err
    assert "no tokenizer saved" in err and "tokenizer.json" in err
    assert not (out / "tokenizer.json").exists() and read_manifest(out)["model_config"]
