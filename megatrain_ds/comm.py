"""``deepspeed.comm`` as scripts use it. One process is a world of size 1 with no process group needed;
under a launcher (WORLD_SIZE > 1) the calls go to ``torch.distributed`` once it is initialized."""
from __future__ import annotations

import os

import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout=None, init_method: str | None = None, dist_init_required=None,
                     config=None, rank: int = -1, world_size: int = -1) -> None:
    """Initialize ``torch.distributed`` when launched with several processes; a no-op for one process
    (a plain ``python train.py`` needs no MASTER_ADDR)."""
    world = int(os.environ.get("WORLD_SIZE", world_size if world_size > 0 else 1))
    if world <= 1 or is_initialized():
        return
    backend = dist_backend or ("nccl" if __import__("torch").cuda.is_available() else "gloo")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    dist.init_process_group(backend=backend, init_method=init_method, rank=int(os.environ.get("RANK", rank)),
                            world_size=world)


def ensure_deepspeed_comm() -> None:
    """Make ``torch.distributed`` and ``deepspeed.comm`` answer in one process, as DeepSpeed's own
    initialize leaves them (its monitors and transformers' ZeRO-3 loading ask them for the rank): an
    in-memory world of one, no port, no launcher. Under a launcher the group must already exist."""
    import deepspeed.comm

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group)


def all_reduce(tensor, op=None, group=None, async_op: bool = False):
    """Sum (or ``op``) over the world; with one process the tensor already holds the result."""
    if not is_initialized():
        return None
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)
