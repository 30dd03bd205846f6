import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton decides when a kernel is decorated (at import) whether it runs in the interpreter, and test
# modules import kernels at collection time in any order: on a machine without CUDA, interpret them
# all from the start (CPU code paths pick the torch implementations unless a test asks for Triton).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
