"""World -> (pp, dp, cp, tp) coordinates and process groups, from torchrun or Slurm environments.

Groups come from megatron-core's `parallel_state.initialize_model_parallel` (Megatron order, tp
fastest-varying, then cp, dp, pp). Everything else takes its group from the `Topology` object; no
code relies on the default group. Layout errors are raised before any collective, so a bad launch
fails fast on every rank instead of hanging in a rendezvous.

Failures: every collective (the default group and megatron-core's groups) gives up after
`ParallelConfig.timeout_s`; NCCL's watchdog tears a process down on an error or a timeout
(TORCH_NCCL_ASYNC_ERROR_HANDLING=1) instead of leaving it hung. `collective_failure` turns what a
broken collective raises into one line for the user. (The test hook that makes a rank die or hang on
purpose, STARSHARD_FAULT_INJECT, is runtime/monitor.py's FaultInjection.)
"""
from __future__ import annotations

import os
import re
import warnings
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
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise LayoutError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR to the first node's host name")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def read_launch_env(env=None) -> LaunchEnv:
    """This process's place in the world: torchrun variables win over Slurm's (torchrun inside srun)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500"), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        host = env.get("MASTER_ADDR") or _first_slurm_host(nodelist)
        # A port derived from the job id lets two jobs share a node without colliding.
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "9500")) % 20000)
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         host, port, "slurm")
    return LaunchEnv(0, 1, 0, "127.0.0.1", "29500", "single")


def ranks_per_node(default: int) -> int:
    """Processes per node as the launcher says (torchrun LOCAL_WORLD_SIZE, srun SLURM_NTASKS_PER_NODE such as "8"
    or "8(x4)"), else `default`."""
    m = re.match(r"\d+", os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "")
    return int(m.group()) if m else default


_BROKEN = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "nccl", "gloo",
           "peer", "socket", "communicator", "watchdog")


def collective_failure(exc: BaseException, timeout_s: float) -> str | None:
    """One line for an exception raised by a broken collective (a peer died, hung or the network
    dropped), or None when `exc` is something else (a bug, whose traceback should show)."""
    text = f"{type(exc).__name__}: {exc}"
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    is_dist = isinstance(exc, getattr(dist, "DistError", ())) or (
        isinstance(exc, RuntimeError) and any(k in text.lower() for k in _BROKEN))
    if not is_dist:
        return None
    low = text.lower()
    if any(k in low for k in ("connection reset", "connection closed", "broken pipe", "connection refused")):
        what = "a peer rank closed its connection (it died or exited)"
    elif "timed out" in low or "timeout" in low:
        what = f"a collective waited longer than --dist-timeout={timeout_s:g} s (a peer rank hung or died)"
    else:
        what = "a collective failed (a peer rank died or the network dropped)"
    return (f"{what}; the job is stopping on every rank. The first rank that failed says why in its own "
            f"message or in the launcher's exit report [{first[:300]}]")


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
    dp = world_size // mp
    if parallel.dp is not None and parallel.dp != dp:
        raise LayoutError(
            f"world size {world_size} != tp*pp*cp*dp = {parallel.tp}*{parallel.pp}*{parallel.cp}*{parallel.dp} = "
            f"{mp * parallel.dp}; launch {mp * parallel.dp} processes or change the layout"
        )
    return dp


def megatron_coords(rank: int, tp: int, cp: int, dp: int, pp: int) -> dict[str, int]:
    """A rank's coordinates in Megatron order (tp fastest-varying, then cp, dp, pp)."""
    return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}


def group_ranks(kind: str, world_size: int, tp: int, cp: int, dp: int, pp: int) -> list[list[int]]:
    """Every `kind` group (tp / cp / dp / pp) of the world as sorted global ranks: ranks whose other
    coordinates agree. Subgroups inside a group (USP) are built from these lists on every rank."""
    groups: dict[tuple, list[int]] = {}
    for r in range(world_size):
        c = megatron_coords(r, tp, cp, dp, pp)
        groups.setdefault(tuple(v for k, v in c.items() if k != kind), []).append(r)
    return list(groups.values())


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
    tp_group: object = None  # None on a single process
    pp_group: object = None
    cp_group: object = None
    dp_group: object = None
    world_group: object = None  # explicit handle for whole-world barriers (benchmarks)
    tp_ranks: list[int] = field(default_factory=list)  # global ranks of each group, by group rank
    pp_ranks: list[int] = field(default_factory=list)
    cp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    timeout_s: float = 600.0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def coords(self) -> dict[str, int]:
        return {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank, "pp": self.pp_rank}

    def group_ranks(self, kind: str) -> list[list[int]]:
        return group_ranks(kind, self.world_size, self.tp, self.cp, self.dp, self.pp)

    def barrier(self) -> None:
        if self.world_group is not None:
            dist.barrier(group=self.world_group)


def _single(parallel: ParallelConfig, device: str) -> Topology:
    return Topology(0, 1, 0, 1, 1, 1, 1, torch.device(device), tp_ranks=[0], pp_ranks=[0], cp_ranks=[0],
                    dp_ranks=[0], timeout_s=parallel.timeout_s)  # device as asked, e.g. cuda:1


def init_topology(parallel: ParallelConfig, device: str | None = None, timeout_s: float | None = None) -> Topology:
    """Initialise torch.distributed (NCCL on CUDA, gloo on CPU) and the tp/cp/dp/pp groups.

    Under a launcher each process takes `cuda:LOCAL_RANK` (one GPU per local rank), or the only GPU
    it can see when the launcher binds one per task.
    """
    env = read_launch_env()
    dp = check_layout(parallel, env.world_size)
    timeout_s = parallel.timeout_s if timeout_s is None else timeout_s
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if env.world_size == 1 and not dist.is_initialized():
        return _single(parallel, device)
    use_cuda = device.startswith("cuda")
    dev = torch.device("cpu")
    if use_cuda:
        visible = torch.cuda.device_count()
        if visible == 1:  # the launcher bound one GPU to this task (srun --gpus-per-task 1, CUDA_VISIBLE_DEVICES)
            dev = torch.device("cuda", 0)
        elif env.local_rank < visible:
            dev = torch.device("cuda", env.local_rank)
        else:
            raise LayoutError(f"local rank {env.local_rank} has no GPU (this node shows {visible}); "
                              "launch at most one process per GPU on each node")
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        # NCCL: on an error or a timeout the watchdog ends the process instead of leaving it blocked
        # (a user's own setting wins). gloo raises on a dead peer or a timeout by itself.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", env.master_port)
        kw = {"device_id": dev} if use_cuda else {}  # NCCL binds its communicators to this GPU up front
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s), **kw)
    if dist.get_world_size() != env.world_size:
        raise LayoutError(f"torch.distributed has {dist.get_world_size()} ranks but the launcher says "
                          f"WORLD_SIZE={env.world_size}")
    with warnings.catch_warnings():  # megatron-core warns at import that Transformer Engine / Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps

    sizes = (parallel.tp, parallel.pp, parallel.cp)
    if ps.model_parallel_is_initialized():
        held = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size())
        if held != sizes:  # a second layout in one process (tests, notebooks): rebuild the groups
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
            distributed_timeout_minutes=timeout_s / 60,  # a timedelta inside: short test timeouts hold
            order="tp-cp-ep-dp-pp",
            create_gloo_process_groups=False,  # inference needs no gloo side groups next to NCCL
        )
    groups = {
        "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
        "cp": ps.get_context_parallel_group(), "dp": ps.get_data_parallel_group(),
    }
    topo = Topology(
        rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
        tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, dp=dp, device=dev,
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=groups["tp"], pp_group=groups["pp"], cp_group=groups["cp"], dp_group=groups["dp"],
        world_group=dist.group.WORLD,
        timeout_s=timeout_s,
        **{f"{k}_ranks": list(dist.get_process_group_ranks(g)) for k, g in groups.items()},
    )
    expected = megatron_coords(env.rank, parallel.tp, parallel.cp, dp, parallel.pp)
    if topo.coords != expected or topo.dp != ps.get_data_parallel_world_size():
        raise RuntimeError(f"megatron-core placed rank {env.rank} at {topo.coords}, expected {expected} "
                           "(order tp-cp-dp-pp); this megatron-core version orders ranks differently")
    return topo
