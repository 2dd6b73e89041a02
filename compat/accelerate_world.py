"""What ``MEGATRAIN_DS=1`` changes in accelerate, and why: the size of a DeepSpeed run's world on
CPU.

accelerate counts the processes of a DeepSpeed launch from the backend it picked itself
(``PartialState``): ``nccl`` with CUDA, ``hccl``, ``xccl``, ... On a CPU-only machine it picks none,
so after it has joined the launcher's group through ``deepspeed.comm.init_distributed`` (gloo) it
still says ``num_processes == 1`` and ``process_index == 0`` on every rank. With real DeepSpeed that
run stops in ``deepspeed.initialize`` (``train_batch_size`` = micro x GA x accelerate's 1 != micro x
GA x the world's 2: DeepSpeed's batch assertion, seen with accelerate 1.15 / transformers 5.23 /
DeepSpeed 0.19.8, ``accelerate launch --num_processes 2`` and the Trainer under ``torchrun
--nproc_per_node 2``). It would also give every rank the same batches: the dataloader is sharded by
``num_processes``.

Under the switch, after ``PartialState`` has set itself up for DeepSpeed without a backend of its
own while the process group holds several processes, it takes the world from the group: ``backend``
(gloo), ``num_processes``, ``process_index``, ``local_process_index`` -- what it says on a GPU
machine, where nothing here changes anything. Then ``train_batch_size`` is micro x GA x world, each
rank's dataloader is its shard, and ``gather`` / ``wait_for_everyone`` / ``is_main_process`` span
the world, as on GPUs.
"""

from __future__ import annotations

import functools
import os


def count_the_world(state) -> None:
    """A DeepSpeed ``PartialState`` with no backend on a process group of several: take the group's
    world."""
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    if state.__dict__.get("distributed_type") != DistributedType.DEEPSPEED or state.__dict__.get(
        "backend"
    ):
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    state.backend = dist.get_backend()
    state.num_processes = dist.get_world_size()
    state.process_index = dist.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def patch_partial_state(module) -> None:
    """``accelerate.state.PartialState.__init__`` followed by ``count_the_world`` (idempotent)."""
    cls = module.PartialState
    if getattr(cls.__init__, "__megatrain_ds__", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        count_the_world(self)

    __init__.__megatrain_ds__ = True
    cls.__init__ = __init__


HOOKS = {"accelerate.state": patch_partial_state}  # module name -> what runs once it is imported
