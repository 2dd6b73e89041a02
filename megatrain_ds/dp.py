"""Data parallelism over the processes of a run: who owns which layer, and the process groups.

[Note: data parallel] N processes (one per GPU; ``torchrun``, the ``deepspeed`` launcher, ``accelerate launch``)
train one model on N micro-batches at once. Every persistent tensor stays in host memory, once per run:

- **Layer ownership.** Streamed layer i is owned by rank ``i % N``. Only the owner holds layer i's host state
  (fp32 master, Adam moments, gradient, pinned wire copy): host bytes per parameter summed over the ranks are
  those of one process, and each rank's host AdamW steps 1/N of the layers, on its own cores.
- **Weights in.** The owner copies layer i's wire H2D into a slot (or casts its GPU-held master), then the
  slot is broadcast from the owner to every rank (NCCL over NVLink; gloo on CPU). Round-robin ownership means
  consecutive layers come over different PCIe links: the links share the step's H2D bytes, 1/N each.
- **Gradients out.** Layer i's flat gradient is reduced (sum) to its owner, which scales it by 1/N (the mean
  over ranks, as DeepSpeed averages data-parallel gradients) and lands it in host memory (D2H) as one process
  does. Ranks that do not own it move nothing over PCIe.
- **Resident parameters** (embeddings, final norm, head) are replicated: their gradients are all-reduced
  (mean) after the backward, and every rank steps its own copy identically.
- **The global norm** is the sum of each rank's squared norms over the layers it owns (plus the resident
  parameters, counted on rank 0), all-reduced as one scalar by the landing thread over a gloo group of its
  own: clipping is exact and every rank reaches the same skip / clip decision (fp16 overflow included).

Ordering. The collectives of the default group (broadcast, reduce, resident all-reduce) are issued by the main
thread only, in the order the executor loads and evacuates layers, which is the same on every rank as long as
every rank runs the same forwards and backwards (as DeepSpeed ZeRO-3 requires) and agrees on which layers are
kept on the GPU (the auto placement takes the minimum over ranks) and which slots are stale (a rollback
invalidates every layer on every rank). On CUDA a collective issued with ``h2d`` (broadcast) or ``d2h``
(reduce) current runs on NCCL's stream after that stream's queued work, and that stream waits for it: the
three-stream overlap is kept, NCCL's stream being the fourth.
Host-side scalars (the norm, placement budgets) and checkpoint exchange go over gloo groups, so a collective
on one thread never interleaves with another thread's.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.distributed as dist


def done(value=None) -> Future:
    """A future that has already completed with ``value``."""
    fut = Future()
    fut.set_result(value)
    return fut


class DataParallel:
    """This process's place in the run: rank, world size, layer ownership and the groups collectives use.

    With one process every method is a no-op and the rank owns every layer (the single-GPU engine)."""

    def __init__(self, device: torch.device) -> None:
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.device = device
        self.group = None  # the default group: NCCL on CUDA, gloo on CPU (device tensors, main thread)
        self.cpu_group = None  # gloo, main thread: host scalars and checkpoint exchange
        self.norm_group = None  # gloo, the landing thread: the global norm
        if self.world > 1:
            self.backend = dist.get_backend()
            if device.type == "cuda" and self.backend != "nccl":
                raise RuntimeError(f"data parallel on CUDA needs the NCCL backend; the process group uses "
                                   f"{self.backend!r} (init_distributed(dist_backend='nccl'), or let "
                                   "megatrain_ds initialize it)")
            self.cpu_group = dist.new_group(backend="gloo")
            self.norm_group = dist.new_group(backend="gloo")
            from .comm import destroy_at_exit
            destroy_at_exit()  # gloo groups left alive at exit can abort the process (comm.py)

    @property
    def active(self) -> bool:
        return self.world > 1

    def owner(self, i: int) -> int:
        return i % self.world

    def owns(self, i: int) -> bool:
        return i % self.world == self.rank

    def owned_mask(self, n_layers: int) -> list[bool]:
        return [self.owns(i) for i in range(n_layers)]

    # --- device collectives (main thread, default group) -------------------------------------------------
    def broadcast_layer(self, buf: torch.Tensor, i: int) -> None:
        """Layer i's weights, from its owner's slot into every rank's (called with ``h2d`` current on CUDA)."""
        dist.broadcast(buf, src=self.owner(i), group=self.group)

    def reduce_layer_grad(self, flat: torch.Tensor, i: int) -> None:
        """Sum layer i's flat gradient into its owner's ``flat`` and take the mean there (``d2h`` current)."""
        dist.reduce(flat, dst=self.owner(i), group=self.group)
        if self.owns(i):
            flat.div_(self.world)

    def mean_grad(self, grad: torch.Tensor) -> None:
        """A replicated (resident) parameter's gradient: the mean over the ranks, on every rank."""
        dist.all_reduce(grad, group=self.group)
        grad.div_(self.world)

    # --- host collectives ---------------------------------------------------------------------------------
    def sum_norm(self, local_sq: float) -> float:
        """Landing thread: the sum over ranks of each rank's squared-norm share."""
        if not self.active:
            return local_sq
        t = torch.tensor([local_sq], dtype=torch.float64)
        dist.all_reduce(t, group=self.norm_group)
        return float(t)

    def min_int(self, value: int) -> int:
        """Main thread: the smallest ``value`` over the ranks (placement decisions every rank must share)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.cpu_group)
