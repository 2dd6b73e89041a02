"""Optimizer state of some layers on the GPU: DeepSpeed's ``offload_optimizer.ratio`` < 1.

With exact global-norm clipping, the host optimizer can only start once the last gradient (layer
0's) has landed; the next forward then waits for it layer by layer. At moderate batch sizes that
wait is the largest stall in a step (3B, 16K tokens: ~0.6 s on an H200 box). DeepSpeed's
ZeRO-Offload++ answers the same problem with ``offload_optimizer.ratio``: the fraction of optimizer
state kept on the CPU. Here the *leading* ``(1 - ratio) * L`` layers keep their fp32 master, Adam
moments and fp32 gradient on the GPU. Leading, because the next forward reaches them first: it runs
through them while the CPU is still updating the trailing layers, which the forward reaches last
(measured on 3B/16K/H200: 1.25 s/step with the trailing 24 of 36 layers on the GPU, where the
forward still waited 0.22 s for the CPU's 12 leading ones).

- backward accumulates their gradient in place on the GPU (no D2H) and takes its norm there;
- ``step()`` updates them first, on the GPU (fused AdamW on the h2d stream, microseconds to launch),
  while the CPU updates the trailing layers in forward order;
- forward/backward produce their compute-dtype weights by casting the device master (no PCIe).

Their host copies of master and moments go stale and are refreshed by ``sync_to_host()``
(checkpoints, ``master_state_dict``). Cost: 16 bytes of GPU memory per parameter of those layers.
ratio 1.0 (default) keeps every persistent tensor on the host. ``megatrain.gpu_optimizer_layers:
"auto"`` picks the count after the first step, from the GPU memory that step left free (the
embedding's state then stays on the host).
"""

from __future__ import annotations

import torch

from .host_state import HostLayerStore


class DeviceOptimizerState:
    """fp32 master, moments and gradient of layers [lo, hi) on the device."""

    def __init__(
        self,
        store: HostLayerStore,
        lo: int,
        hi: int,
        device: torch.device,
        moments_from_host: bool = False,
    ) -> None:
        self.store, self.lo, self.hi, self.device = store, lo, hi, device
        # the fp32 master region of layers [lo, hi): whole layers, or their trainable regions (a
        # compact store keeps frozen weights in the wire copy only: a load casts the trainable part
        # and copies the frozen one)
        self.full0 = store.offsets[lo].master
        self.full1 = store.offsets[hi].master if hi < len(store.layouts) else store.n_master
        self.train0 = store.offsets[lo].train
        self.train1 = store.offsets[hi].train if hi < len(store.layouts) else store.n_train
        self.master = store.master[self.full0 : self.full1].to(device, copy=True)
        n_train = self.train1 - self.train0
        # moved here after training started ("auto"): the moments so far come along
        if moments_from_host:
            self.exp_avg = store.exp_avg[self.train0 : self.train1].to(device, copy=True)
            self.exp_avg_sq = store.exp_avg_sq[self.train0 : self.train1].to(device, copy=True)
        else:
            self.exp_avg = torch.zeros(n_train, dtype=torch.float32, device=device)
            self.exp_avg_sq = torch.zeros(n_train, dtype=torch.float32, device=device)
        self.grad = torch.zeros(n_train, dtype=torch.float32, device=device)

    @staticmethod
    def nbytes(store: HostLayerStore, hi: int) -> int:
        """Device bytes the state of layers [0, hi) takes: fp32 master (all elements) + moments and
        gradient (trainable elements); of the layers this rank owns."""
        full = store.offsets[hi].master if hi < len(store.layouts) else store.n_master
        train = store.offsets[hi].train if hi < len(store.layouts) else store.n_train
        return DeviceOptimizerState.state_bytes(full, train)

    @staticmethod
    def state_bytes(master: int, train: int) -> int:
        """Device bytes of the state of ``master`` fp32 master elements, ``train`` of them trained:
        the master (4 bytes each), the two moments and the fp32 gradient (12 per trained one); the
        planner counts a GPU-held layer with it too (planning/capacity_count.py)."""
        return 4 * master + 12 * train

    def owns(self, i: int) -> bool:
        """Layer i's state is here (data parallel: only the layers this rank owns, see dp.py)."""
        return self.lo <= i < self.hi and self.store.owned[i]

    def master_of(self, i: int) -> torch.Tensor:
        o = self.store.offsets[i].master - self.full0
        return self.master[o : o + self.store.master_numel(i)]

    def _train(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        o = self.store.offsets[i].train - self.train0
        return flat[o : o + self.store.layouts[i].n_train]

    def grad_of(self, i: int) -> torch.Tensor:
        return self._train(self.grad, i)

    def moments_of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._train(self.exp_avg, i), self._train(self.exp_avg_sq, i)

    def sync_to_host(self) -> None:
        """Copy the device master and moments into the host buffers (blocking; checkpoints only)."""
        store = self.store
        store.master[self.full0 : self.full1].copy_(self.master)
        store.exp_avg[self.train0 : self.train1].copy_(self.exp_avg)
        store.exp_avg_sq[self.train0 : self.train1].copy_(self.exp_avg_sq)
        for i in range(self.lo, self.hi):
            if store.owned[i]:
                store.refresh_wire(i)
