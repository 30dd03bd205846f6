"""How an entry point's process ends once its work is done.

gloo's worker threads (`pt_gloo_runloop`) drop each finished collective's last reference on their own
thread, after the caller's `wait()` has returned. Dropping a tensor made in Python takes the GIL; when
that happens while the interpreter is shutting down, the thread cannot get the GIL, is unwound, and
the process aborts with "terminate called without an active exception" although every rank finished
its work (caught under gdb: `~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit ->
std::terminate`, about 1 run in 10 of a two-rank CPU infer). `destroy_process_group` does not close
that window: megatron-core's parallel state and our Topology keep the groups alive until shutdown.
So a process that may have used torch.distributed leaves without interpreter shutdown, after its
groups are torn down and its output is flushed.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_process(code: int | None = 0) -> NoReturn:
    """End the process with `code` (None = 0, as sys.exit) without interpreter shutdown (see above).
    Only for an entry point's `__main__`: nothing may run after it."""
    code = 0 if code is None else int(code)
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    logging.shutdown()  # what interpreter shutdown would have flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
