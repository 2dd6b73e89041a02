"""Layer-boundary activations in pinned host memory (``megatrain.offload_activations``).

By default each streamed layer saves its input on the GPU for the backward recompute: L x (tokens x
hidden) in the compute dtype, the one part of GPU memory that grows with depth (3B, 16K tokens: 2.4 GB;
a 180-layer model at 128K tokens would need far more). With this option the input leaves on the d2h stream
right after the layer's forward is queued and comes back on the h2d stream one layer ahead of its backward
(while layer i recomputes, the input of layer i-1 loads). See [Note: stream and event ordering]: the
``saved`` event (d2h) orders the host buffer's write before its read-back; the ``ready`` event (h2d) orders
the read-back before the recompute; ``hand_over`` keeps each device copy alive until the other stream is done.

Host buffers. Each input goes to a buffer of exactly its size, in a mapping of its own (host_state.HostRegion,
page-locked on CUDA), kept in a pool by (elements, dtype) and reused by later saves of the same size. torch's pinned
allocator would round each up to a power of two: a 7B layer input at 384K tokens (2.6 GiB) takes a 4 GiB block, 38
GiB more over 28 layers (computed from the sizes). Reuse is ordered on the GPU: a buffer goes back to the pool with
the event of its H2D read-back, and the next D2H into it waits for that event on the ``d2h`` stream (writes are all
on ``d2h``, reads all on ``h2d``).
"""
from __future__ import annotations

import weakref

import torch

from .host_state import _release_all, host_buffer


class HostActivations:
    def __init__(self, streams, device: torch.device) -> None:
        self.streams, self.device = streams, device
        self.pin = device.type == "cuda"
        # keyed by the layer call (executor.LayerCall), not the layer index: two forwards before one backward
        # (a policy and a reference pass, gradient accumulation in one graph) each keep their own inputs
        self.on_host: dict[object, tuple[torch.Tensor, torch.Tensor, object]] = {}  # call -> (copy, buffer, saved)
        self.on_device: dict[object, tuple[torch.Tensor, object]] = {}  # call -> (device copy, ready event)
        self.pool: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, object]]] = {}  # -> [(buffer, last read)]
        self.regions: list = []  # the buffers' mappings (unpinned when the engine goes)
        self.nbytes = 0  # host bytes of every buffer made so far (in use or pooled)
        weakref.finalize(self, _release_all, self.regions)

    def _take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        free = self.pool.get((numel, dtype))
        if free:
            return free.pop()
        buf = host_buffer(numel, dtype, self.pin, self.regions)
        self.nbytes += buf.numel() * buf.element_size()
        return buf, None

    def _give(self, buf: torch.Tensor, last_read) -> None:
        self.pool.setdefault((buf.numel(), buf.dtype), []).append((buf, last_read))

    def clear(self) -> None:
        """Drop every saved input (a backward failed: its graph is gone); their buffers go back to the pool."""
        for _, buf, saved in self.on_host.values():
            self._give(buf, saved)
        self.on_host.clear()
        self.on_device.clear()

    def save(self, i, hidden: torch.Tensor) -> None:
        """Queue the D2H of a layer call's input (call after the layer's forward kernels are queued)."""
        st = self.streams
        buf, last_read = self._take(hidden.numel(), hidden.dtype)
        host = buf.view(hidden.shape)
        st.wait(st.d2h, st.record(st.compute()))
        st.wait(st.d2h, last_read)  # the buffer's previous contents have been read back (H2D)
        with st.on(st.d2h):
            host.copy_(hidden, non_blocking=True)
        st.hand_over(hidden, st.d2h)
        self.on_host[i] = (host, buf, st.record(st.d2h))

    def prefetch(self, i) -> None:
        """Queue the H2D of a layer call's input, if it was saved and is not on its way already."""
        if i not in self.on_host or i in self.on_device:
            return
        st = self.streams
        host, buf, saved = self.on_host.pop(i)
        st.wait(st.h2d, saved)
        with st.on(st.h2d):  # a copy even on the CPU device: the buffer is reused once this read is done
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
        ready = st.record(st.h2d)
        self._give(buf, ready)
        self.on_device[i] = (dev, ready)

    def load(self, i) -> torch.Tensor:
        """A layer call's input on the device, ordered before the compute stream's next kernel."""
        self.prefetch(i)
        dev, ready = self.on_device.pop(i)
        st = self.streams
        st.wait(st.compute(), ready)
        st.hand_over(dev, st.compute())
        return dev
