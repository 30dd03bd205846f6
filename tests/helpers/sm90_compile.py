"""Build Triton kernels for sm_90a in a subprocess (the interpreter skips Triton's compiler; no GPU
needed): the compile tests of the MInference, AnchorAttention and kernel-variant modules."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def assert_compiles_for_sm90(code: str, tmp_path, timeout: int = 600, env: dict | None = None) -> str:
    """Run `code` (which compiles the kernels and prints "compiled") without TRITON_INTERPRET, with `env` added
    -> its stdout; skip where this triton install has no ptxas."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path), **(env or {}))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("no ptxas in this triton install")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
    return r.stdout
