"""Run a function on N gloo ranks in fresh processes and collect what each returns.

The ranks start from a fork server that has imported torch once (a spawned rank spends ~4 s of a CPU
core importing it; ~150 tests start ranks). A fork server's children inherit its environment, not the
caller's, so each rank first takes the caller's environment as it is at the call (a test may have set
a variable) and only then unpickles its function and arguments, whose imports may read it.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from starshard.parallel.exit import exit_process

# Imported by the fork server before it forks any rank: only what reads no test-set variable at import.
_PRELOAD = ["torch", "torch.distributed"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir, env, payload):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    fn, args = pickle.loads(payload)
    # The ranks meet through a file in this run's own directory, not a TCP port: a port picked free can be
    # taken by another process (a second pytest run) before rank 0 binds it.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while a peer still has traffic in flight
    finally:
        dist.destroy_process_group()
    exit_process(0)  # past interpreter shutdown, where a gloo thread can abort the process (see exit.py)


def run_ranks(fn, world: int, *args):
    """fn(rank, world, *args) on `world` gloo ranks (default group = all); returns [result per rank]."""
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read once, when the first call starts the server
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, _free_port(), out_dir, dict(os.environ), pickle.dumps((fn, args))),
                           nprocs=world, join=True, start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)]
