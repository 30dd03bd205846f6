import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton decides when a kernel is decorated (at import) whether it runs in the interpreter, and test
# modules import kernels at collection time in any order: on a machine without CUDA, interpret them
# all from the start (CPU code paths pick the torch implementations unless a test asks for Triton).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _starshard_logging_restored():
    """CLI mains run in-process (launch/infer.py's setup_logging) give the "starshard" logger their own
    stderr handler and stop propagation; put it back after each test so later tests' caplog sees
    records and no handler writes to a captured stream that is gone."""
    log = logging.getLogger("starshard")
    saved = (list(log.handlers), log.propagate, log.level)
    yield
    log.handlers[:], log.propagate, log.level = saved[0], saved[1], saved[2]


@pytest.fixture
def dot_flops(monkeypatch):
    """A list that collects 2 * M * K * N for every tl.dot the interpreted Triton kernels run."""
    interp = pytest.importorskip("triton.runtime.interpreter")
    seen = []
    real = interp.InterpreterBuilder.create_dot

    def counting(self, a, b, d, *args):
        (m, kk), n = a.data.shape, b.data.shape[1]
        assert b.data.shape[0] == kk
        seen.append(2 * m * kk * n)
        return real(self, a, b, d, *args)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", counting)
    return seen
