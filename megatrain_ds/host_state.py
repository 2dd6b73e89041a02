"""Host-resident state of the streamed layers: one flat buffer per kind, one view per layer.

Bytes per parameter (trainable, bf16 compute):
    master fp32 (4) + exp_avg fp32 (4) + exp_avg_sq fp32 (4) + wire bf16 (2, pinned) + grad (2 or 4)
    = 16 with GA 1 (gradients land in bf16 straight into their pinned home, as the GPU made them)
    = 18 with GA > 1 (an fp32 accumulator; landings go through a small pinned ring)
In fp32 mode the pinned master *is* the wire copy: 16 bytes with GA 1.

Flat buffers are allocated once and pinned with ``cudaHostRegister`` (the caching host allocator behind
``pin_memory=True`` rounds each block up to a power of two, which would cost up to 2x on a 12 GB buffer).
"""
from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

from .model_map import LayerLayout


def pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for async DMA. Returns False (and leaves it pageable) without CUDA."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed with CUDA error {int(err)}")
    return True


def unpin(t: torch.Tensor) -> None:
    if torch.cuda.is_available() and t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


@dataclass(slots=True)
class LayerOffsets:
    full: int  # start of the layer in master/wire (all params)
    train: int  # start of the layer in exp_avg/exp_avg_sq/grad (trainable params only)


class HostLayerStore:
    """fp32 master, Adam moments, wire copy and gradients for every streamed layer."""

    def __init__(self, layouts: list[LayerLayout], wire_dtype: torch.dtype, grad_accum_fp32: bool,
                 pin: bool) -> None:
        self.layouts = layouts
        self.wire_dtype = wire_dtype
        self.offsets: list[LayerOffsets] = []
        full = train = 0
        for layout in layouts:
            self.offsets.append(LayerOffsets(full, train))
            full += layout.numel
            train += layout.n_train
        self.n_full, self.n_train = full, train
        self.master = torch.empty(full, dtype=torch.float32)
        self.exp_avg = torch.zeros(train, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(train, dtype=torch.float32)
        self.wire_is_master = wire_dtype == torch.float32
        self.wire = self.master if self.wire_is_master else torch.empty(full, dtype=wire_dtype)
        # Gradients: landed directly in their home, in the wire dtype (GA 1), or landed in a pinned ring and
        # accumulated into fp32 by the host worker (GA > 1).
        self.grad_direct = not grad_accum_fp32
        self.grad = torch.zeros(train, dtype=wire_dtype if self.grad_direct else torch.float32)
        self.max_train = max((l.n_train for l in layouts), default=0)
        self._pinned = []
        self.ring: queue.Queue | None = None
        if not self.grad_direct:
            self.ring = queue.Queue()
            for _ in range(4):
                slab = torch.empty(self.max_train, dtype=wire_dtype)
                self.ring.put(slab)
                if pin and pin_in_place(slab):
                    self._pinned.append(slab)
        if pin:
            for t in {id(self.wire): self.wire, id(self.grad): self.grad}.values():
                if pin_in_place(t):
                    self._pinned.append(t)

    # views ---------------------------------------------------------------------------------------
    def master_of(self, i: int) -> torch.Tensor:
        o = self.offsets[i].full
        return self.master[o:o + self.layouts[i].numel]

    def wire_of(self, i: int) -> torch.Tensor:
        o = self.offsets[i].full
        return self.wire[o:o + self.layouts[i].numel]

    def train_slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        o = self.offsets[i].train
        return flat[o:o + self.layouts[i].n_train]

    def grad_of(self, i: int) -> torch.Tensor:
        return self.train_slice(self.grad, i)

    def load_layer(self, i: int, layer: torch.nn.Module) -> None:
        """Copy ``layer``'s weights into the master (and wire) and release the module's own storage."""
        by_name = dict(layer.named_parameters(remove_duplicate=False))
        master, layout = self.master_of(i), self.layouts[i]
        for slot in layout.slots:
            start = slot.offset + (0 if slot.trainable else layout.n_train)
            param = by_name[slot.name]
            master[start:start + slot.numel].copy_(param.detach().reshape(-1))
            release_storage(param)
        if not self.wire_is_master:
            self.wire_of(i).copy_(master)

    def param_master(self, i: int, name: str) -> torch.Tensor:
        """The fp32 master of one parameter of layer ``i`` (a view, shaped like the parameter)."""
        layout = self.layouts[i]
        for slot in layout.slots:
            if slot.name == name:
                start = slot.offset + (0 if slot.trainable else layout.n_train)
                return self.master_of(i)[start:start + slot.numel].view(slot.shape)
        raise KeyError(f"layer {i} has no parameter {name!r}")

    def nbytes(self) -> int:
        tensors = {id(t): t for t in (self.master, self.exp_avg, self.exp_avg_sq, self.wire, self.grad)}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.ring is not None:
            total += 4 * self.max_train * torch.tensor([], dtype=self.wire_dtype).element_size()
        return total

    def close(self) -> None:
        for t in self._pinned:
            unpin(t)
        self._pinned.clear()


def release_storage(param: torch.Tensor) -> None:
    """Drop a parameter's storage but keep the object (and its identity) for the user and the optimizer.

    Like a ZeRO-3 partitioned parameter: ``ds_shape``/``ds_numel`` tell what the full tensor looks like.
    """
    param.ds_shape = tuple(param.shape)
    param.ds_numel = param.numel()
    param.data = torch.empty(0, dtype=param.dtype)
