"""Gradients held on the device until the norm (``megatrain.gradient_hold: "gpu"``): 12 host bytes
per trained parameter of the streamed layers, for exact fp32-master training.

Note [gradients held on the device]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Exact clipping needs every gradient of the step before any update (the norm), so each layer's
gradient is kept from its backward until its update. By default it is kept in host memory: the
landing buffer, 2 bytes per parameter in the compute dtype beside the fp32 master and moments (12),
14 in all. With ``gradient_hold: "gpu"`` it stays on the device instead, in one flat buffer of the
compute dtype (2 bytes per parameter of GPU memory):

- the backward (landing.py) copies each layer's gradient into its slice and takes its norm there;
  only the norm goes to the host;
- after the norm, the AdamW thread copies each layer's gradient into one of three pinned host slabs
  just before its update (``take``), the next layer's copy already under way, on a stream of its own
  that waits for the backward's end; the update reads the slab as it read the landing buffer (the
  same bytes: bit-identical), then gives it back;
- the next backward writes a layer's slice only after its forward, which waited for that layer's
  update, which waited for the copy.

What it costs: a layer's update waits for its copy when the copy is slower than the update before
it; the speculative step (which steps layers as their gradients land on the host) and deferred
moments (which read the gradient again after the step) are off in this mode; GA 1 only, no NVMe
tier. Data parallel (dp.py): each owner holds the (mean) gradients of the layers it owns, written on
``d2h`` after their reduce (which the backward's end event follows too); every rank holds or none
does (engine_build.decide), as the speculative step is off. It pays where the host is the limit: a
model that fits the host with 12 bytes per parameter but not with 14.
"""

from __future__ import annotations

import queue
from typing import Callable

import torch

from .host_memory import host_buffer


class GradientHold:
    """The device buffer of every streamed layer's gradient, and the host slabs its updates read
    them through."""

    SLABS = 3  # the layer being updated, the next one's copy, one spare

    def __init__(
        self,
        train: int,
        max_train: int,
        dtype: torch.dtype,
        device: torch.device,
        pin: bool,
        regions: list,
        view: Callable[[torch.Tensor, int], torch.Tensor],
    ) -> None:
        self.buf = torch.zeros(train, dtype=dtype, device=device)
        self.device, self._view = device, view
        self.slab_numel = max_train
        self.slabs: queue.Queue = queue.Queue()
        whole = host_buffer(self.SLABS * max_train, dtype, pin and device.type == "cuda", regions)
        for k in range(self.SLABS):
            self.slabs.put(whole[k * max_train : (k + 1) * max_train])
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # AdamW thread: layer -> (slab, copy event)
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}
        self.after: dict[int, int] = {}  # this step's update order: layer -> the next one
        self.ready = None  # the event after the backward that wrote the gradients

    def view(self, i: int) -> torch.Tensor:
        """Layer i's gradient on the device."""
        return self._view(self.buf, i)

    def host_bytes(self) -> int:
        return self.SLABS * self.slab_numel * self.buf.element_size()

    def begin(self, order: list[int], ready) -> None:
        """Main thread, at the optimizer step (the last step's updates are done: this step's forward
        waited for them): the layers this step updates, in order, and the event after the backward.
        Slabs a failed or skipped update left are taken back."""
        for slab, event in self.pending.values():
            if event is not None:
                event.synchronize()
            self.slabs.put(slab)
        self.pending = {}
        self.after = dict(zip(order, order[1:]))
        self.ready = ready

    def _fetch(self, i: int) -> None:
        src = self.view(i)
        slab = self.slabs.get_nowait()[: src.numel()]  # at most two are out (``take``): never empty
        if self.stream is None:
            slab.copy_(src)
            self.pending[i] = (slab, None)
            return
        with torch.cuda.stream(self.stream):
            if self.ready is not None:
                self.stream.wait_event(self.ready)
            slab.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[i] = (slab, event)

    def take(self, i: int) -> torch.Tensor:
        """AdamW thread: layer i's gradient in a pinned host slab (the next layer's copy started
        behind it)."""
        if i not in self.pending:
            self._fetch(i)
        nxt = self.after.get(i)
        if nxt is not None and nxt not in self.pending:
            self._fetch(nxt)
        slab, event = self.pending[i]
        if event is not None:
            event.synchronize()
        return slab

    def give(self, i: int) -> None:
        """AdamW thread, after layer i's update: its slab back."""
        slab, _ = self.pending.pop(i)
        self.slabs.put(slab)
