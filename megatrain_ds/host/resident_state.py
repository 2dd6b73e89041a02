"""The resident parameters' persistent tensors: what a model keeps on the device outside its
streamed layers (embeddings, final norm, LM head), with their fp32 masters, Adam moments, gradients,
host wire copies and gradient landing buffers.

``ResidentState`` owns these tensors and nothing else: the gradient landing, the window bookkeeping
and the upload before a forward are ``ResidentParams``' (optim/resident.py), which holds one; the
DeepSpeed-facing reads and writes of one parameter go through ``ModelState`` (model_state.py).
"""

from __future__ import annotations

import weakref

import torch

from .host_memory import host_buffer, release_all


class ResidentState:
    """Parameters outside the streamed layers, tied ones once, with their state.

    The module's parameter holds the compute-dtype copy on the device. Its fp32 master, moments and
    gradient live on the host, or on the device when ``state_on_device``
    (``offload_optimizer.ratio`` < 1, see device_state.py): the embedding is the first thing a
    forward needs, so its update must not queue behind host work. A frozen parameter (in no
    optimizer group: a LoRA model's embeddings and head) is never updated: its ``master`` is the
    device copy itself, in the compute dtype, with no host copy (as the streamed layers' frozen
    weights, host_state.py).

    Data parallel ([Note: data parallel] in dp.py): a trained parameter's state is held by its owner
    only (``owned[k]``); every other rank keeps the device copy alone (``master[k]`` and the rest
    None).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group_of: dict[int, int],
        device: torch.device,
        compute_dtype: torch.dtype,
        pin: bool,
        state_on_device: bool = False,
        dp=None,
        owned: list[bool] | None = None,
    ) -> None:
        self.params, self.group_of, self.device = params, group_of, device
        # data parallel: each state held by its owner
        self.dp = dp if dp is not None and dp.active else None
        # in an optimizer group (whoever holds its state)
        self.trained = [id(p) in group_of for p in params]
        # this rank holds its state
        self.owned = list(owned) if owned is not None else [True] * len(params)
        self.on_device = state_on_device
        state = device if state_on_device else torch.device("cpu")
        self.master, self.exp_avg, self.exp_avg_sq = [], [], []
        self.grad, self.wire, self.landing = [], [], []
        # pinned in mappings of their own (host_memory.HostRegion): torch's pinned allocator would
        # round each up to a power of two (a 7B model's embedding wire and landing copies would take
        # twice their size)
        self.regions: list = []

        def pinned(t: torch.Tensor) -> torch.Tensor:
            if not pin or state_on_device:
                return t
            return host_buffer(t.numel(), t.dtype, True, self.regions).view(t.shape).copy_(t)

        for p, trainable, mine in zip(params, self.trained, self.owned):
            if not trainable or not mine:  # frozen (never updated), or another rank's to update
                p.data = p.detach().to(device, compute_dtype, copy=True)
                for kind in (
                    self.master,
                    self.wire,
                    self.exp_avg,
                    self.exp_avg_sq,
                    self.grad,
                    self.landing,
                ):
                    kind.append(p.data if kind is self.master and not trainable else None)
                continue
            master = p.detach().to(state, torch.float32, copy=True)
            self.master.append(master)
            wire = None if state_on_device else pinned(master.to(compute_dtype, copy=True))
            self.wire.append(wire)
            self.exp_avg.append(torch.zeros_like(master) if trainable else None)
            self.exp_avg_sq.append(torch.zeros_like(master) if trainable else None)
            self.grad.append(torch.zeros_like(master) if trainable else None)
            landing = trainable and not state_on_device
            buffer = pinned(torch.empty_like(master, dtype=compute_dtype)) if landing else None
            self.landing.append(buffer)
            p.data = master.to(device, compute_dtype, copy=True)
        weakref.finalize(self, release_all, self.regions)

    def holds(self, k: int) -> bool:
        """This rank holds resident parameter k's state (one process: every one)."""
        return self.owned[k]

    def __len__(self) -> int:
        return len(self.params)

    def device_bytes(self) -> int:
        """GPU bytes ``move_to_device`` takes: fp32 master, moments and gradient of the trained
        parameters (16 bytes each; a frozen one is on the device already, as its compute-dtype
        copy)."""
        return sum(16 * m.numel() for m, g in zip(self.master, self.grad) if g is not None)

    def move_to_device(self) -> None:
        """From now on keep the fp32 master, moments and gradient on the device (between steps,
        nothing queued: the state so far comes along; the host wire and landing buffers are
        dropped)."""
        if self.on_device:
            return
        dev = self.device
        move = lambda t: None if t is None else t.to(dev, copy=True)  # noqa: E731
        # a frozen parameter's master is its device copy already
        self.master = [move(t) if g is not None else t for t, g in zip(self.master, self.grad)]
        self.exp_avg = [move(t) for t in self.exp_avg]
        self.exp_avg_sq = [move(t) for t in self.exp_avg_sq]
        self.grad = [move(t) for t in self.grad]
        self.wire = [None] * len(self.params)
        self.landing = [None] * len(self.params)
        # their pinned host copies (unregistered; freed with the last view)
        release_all(self.regions)
        self.on_device = True

    def master_copy(self, k: int, dst: int | None = None) -> torch.Tensor | None:
        """Resident parameter k's fp32 master, a host copy (flat); data parallel, a collective of
        every rank over the gloo group: from its owner to rank ``dst`` (None: every rank); None on
        the other ranks. The caller has synchronized (no update is writing it)."""
        if not self.trained[k] or self.dp is None:  # a frozen one is every rank's (its device copy)
            return self.master[k].detach().to("cpu", torch.float32, copy=True).reshape(-1)
        import torch.distributed as dist

        owner, numel = self.dp.resident_owner(k), self.params[k].numel()
        mine = self.dp.rank == owner
        if mine:
            value = self.master[k].detach().to("cpu", torch.float32, copy=True).reshape(-1)
        else:
            value = torch.empty(numel, dtype=torch.float32)
        if dst is None:
            dist.broadcast(value, src=owner, group=self.dp.cpu_group)
        elif owner != dst:
            if mine:
                dist.send(value, dst=dst, group=self.dp.cpu_group)
            elif self.dp.rank == dst:
                dist.recv(value, src=owner, group=self.dp.cpu_group)
        return value if dst is None or self.dp.rank == dst else None

    def write_master(self, k: int, value: torch.Tensor) -> None:
        """Overwrite resident parameter k's fp32 master (its holder's), its wire copy and the device
        copy the forward uses (``param.ds_tensor``: the compute-dtype copy)."""
        if self.master[k] is not None:
            self.master[k].copy_(value.reshape(self.master[k].shape))
            if self.wire[k] is not None:
                self.wire[k].copy_(self.master[k])
        self.params[k].ds_tensor.copy_(value.reshape(self.params[k].shape))
