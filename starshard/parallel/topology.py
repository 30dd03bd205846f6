"""World -> (pp, dp, cp, tp) coordinates and process groups, from torchrun or Slurm environments.

Groups come from megatron-core's `parallel_state.initialize_model_parallel` (Megatron order, tp
fastest-varying, then cp, dp, pp). Everything else takes its group from the `Topology` object; no
code relies on the default group.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from starshard.config import ParallelConfig


class LayoutError(ValueError):
    pass


@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: str
    source: str  # torchrun | slurm | single


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: 'gpu[01-04,07],cpu1' -> 'gpu01'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if m is None:
        raise LayoutError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def read_launch_env(env=None) -> LaunchEnv:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500"), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        host = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         host, env.get("MASTER_PORT", "29500"), "slurm")
    return LaunchEnv(0, 1, 0, "127.0.0.1", "29500", "single")


def check_layout(parallel: ParallelConfig, world_size: int) -> int:
    """-> dp. Refuses a layout that does not tile the world, before any collective."""
    for name in ("tp", "pp", "cp"):
        if getattr(parallel, name) < 1:
            raise LayoutError(f"--{name} must be >= 1, got {getattr(parallel, name)}")
    mp = parallel.tp * parallel.pp * parallel.cp
    if world_size % mp:
        raise LayoutError(
            f"world size {world_size} is not a multiple of tp*pp*cp = {parallel.tp}*{parallel.pp}*{parallel.cp} = {mp}; "
            f"launch {mp} processes (e.g. torchrun --nproc-per-node {mp}) or change --tp/--pp/--cp"
        )
    return world_size // mp


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    device: torch.device
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    pp_group: object = None
    cp_group: object = None
    dp_group: object = None
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of this rank's pipeline, by stage

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_topology(parallel: ParallelConfig, device: str | None = None, timeout_s: float = 600) -> Topology:
    """Initialise torch.distributed (NCCL on CUDA, gloo on CPU) and the tp/cp/dp/pp groups."""
    env = read_launch_env()
    dp = check_layout(parallel, env.world_size)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if env.world_size == 1 and not dist.is_initialized():
        return Topology(0, 1, 0, 1, 1, 1, 1, torch.device(device), pp_ranks=[0])  # as asked, e.g. cuda:1
    use_cuda = device.startswith("cuda")
    dev = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")  # one GPU per local rank
    if use_cuda:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", env.master_port)
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
        )
    return Topology(
        rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
        tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, dp=dp, device=dev,
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(), dp_group=ps.get_data_parallel_group(),
        pp_ranks=list(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
    )
