"""Layer-boundary activations in pinned host memory (``megatrain.offload_activations``).

By default each streamed layer saves its input on the GPU for the backward recompute: L x (tokens x
hidden) in the compute dtype, the one part of GPU memory that grows with depth (3B, 16K tokens: 2.4 GB;
a 180-layer model at 128K tokens would need far more). With this option the input leaves on the d2h stream
right after the layer's forward is queued and comes back on the h2d stream one layer ahead of its backward
(while layer i recomputes, the input of layer i-1 loads). See [Note: stream and event ordering]: the
``saved`` event (d2h) orders the host buffer's write before its read-back; the ``ready`` event (h2d) orders
the read-back before the recompute; ``hand_over`` keeps each device copy alive until the other stream is done.
"""
from __future__ import annotations

import torch


class HostActivations:
    def __init__(self, streams, device: torch.device) -> None:
        self.streams, self.device = streams, device
        self.pin = device.type == "cuda"
        # keyed by the layer call (executor.LayerCall), not the layer index: two forwards before one backward
        # (a policy and a reference pass, gradient accumulation in one graph) each keep their own inputs
        self.on_host: dict[object, tuple[torch.Tensor, object]] = {}  # call -> (pinned copy, saved event)
        self.on_device: dict[object, tuple[torch.Tensor, object]] = {}  # call -> (device copy, ready event)

    def clear(self) -> None:
        """Drop every saved input (a backward failed: its graph is gone)."""
        self.on_host.clear()
        self.on_device.clear()

    def save(self, i, hidden: torch.Tensor) -> None:
        """Queue the D2H of a layer call's input (call after the layer's forward kernels are queued)."""
        st = self.streams
        host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=self.pin)
        st.wait(st.d2h, st.record(st.compute()))
        with st.on(st.d2h):
            host.copy_(hidden, non_blocking=True)
        st.hand_over(hidden, st.d2h)
        self.on_host[i] = (host, st.record(st.d2h))

    def prefetch(self, i) -> None:
        """Queue the H2D of a layer call's input, if it was saved and is not on its way already."""
        if i not in self.on_host or i in self.on_device:
            return
        st = self.streams
        host, saved = self.on_host.pop(i)
        st.wait(st.h2d, saved)
        with st.on(st.h2d):
            dev = host.to(self.device, non_blocking=True)
        self.on_device[i] = (dev, st.record(st.h2d))

    def load(self, i) -> torch.Tensor:
        """A layer call's input on the device, ordered before the compute stream's next kernel."""
        self.prefetch(i)
        dev, ready = self.on_device.pop(i)
        st = self.streams
        st.wait(st.compute(), ready)
        st.hand_over(dev, st.compute())
        return dev
