"""Programmatic dependent launch (PDL, Hopper and later): inside a CUDA graph (the decode step), a
kernel starts before the kernel ahead of it ends, so launch latency and prologues overlap its tail.

    @triton.jit
    def kernel(..., USE_PDL: tl.constexpr):
        pdl_trigger(USE_PDL)          # the next kernel may be scheduled now
        w = tl.load(weights)          # only what no kernel of the step writes may be read before...
        pdl_wait(USE_PDL)             # ...every kernel ahead is done and its writes are visible
        x = tl.load(activations); ...; tl.store(out, ...)

    kernel[grid](..., **pdl_launch(x))   # USE_PDL=True, launch_pdl=True while capturing a CUDA graph
                                         # on a GPU that has PDL, else USE_PDL=False

The rule every PDL kernel keeps: nothing an earlier kernel writes is read, and nothing is written,
before `pdl_wait` (which waits for the whole chain ahead: each kernel in it waited for its own
predecessor). Kernels launched without PDL (torch's, cuBLAS's) wait for everything ahead as usual,
and a PDL kernel after one of them starts when it ends. CUDA graphs keep the dependencies (programmatic
edges). Eager launches stay plain: there the host is the bottleneck, and a PDL launch cost more host
time than it saved (one H200: Llama-8B eager decode 25.1 -> 27.8 ms per step; under graphs 6.04 ->
5.51 ms; docs/results.md, Decode). On CPU and under TRITON_INTERPRET=1 it is off;
STARSHARD_PDL=0 (read once per process) turns it off everywhere.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # installs without triton: nothing launches, PDL stays off
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a triton without grid dependency control: PDL stays off (the helpers compile to nothing)
    gdc_launch_dependents = gdc_wait = None
try:  # ...or one whose launcher cannot set the attribute
    from triton.backends.nvidia.compiler import CUDAOptions

    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        gdc_wait = None
except ImportError:
    gdc_wait = None

_SUPPORTED: dict[int, bool] = {}
_ALLOWED = (gdc_wait is not None and os.environ.get("STARSHARD_PDL", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") != "1")
_ON = {"USE_PDL": True, "launch_pdl": True}
_OFF = {"USE_PDL": False}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` can use PDL: CUDA with compute capability >= 9, a triton with grid
    dependency control, not interpreted, and STARSHARD_PDL not "0"."""
    if not _ALLOWED or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SUPPORTED:
        _SUPPORTED[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _SUPPORTED[idx]


def pdl_launch(x: torch.Tensor) -> dict:
    """The launch keywords for a PDL-aware kernel whose tensors live on x's device: PDL while a CUDA
    graph is being captured on a device that has it."""
    return _ON if x.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_enabled(x.device) else _OFF


if triton is None:  # the names import; no kernel uses them without triton

    def pdl_trigger(USE_PDL):
        pass

    def pdl_wait(USE_PDL):
        pass

else:

    @triton.jit
    def pdl_trigger(USE_PDL: tl.constexpr):
        """Let the next kernel be scheduled (it still waits in its own pdl_wait)."""
        if USE_PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(USE_PDL: tl.constexpr):
        """Wait until every kernel ahead has finished and its writes are visible."""
        if USE_PDL:
            gdc_wait()
