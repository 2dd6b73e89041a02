"""Layer-boundary activations in pinned host memory (``megatrain.offload_activations``).

By default each streamed layer saves its input on the GPU for the backward recompute: L x (tokens x
hidden) in the compute dtype, the one part of GPU memory that grows with depth (3B, 16K tokens: 2.4
GB; a 180-layer model at 128K tokens would need far more). With this option the input leaves on the
d2h stream right after the layer's forward is queued and comes back on the h2d stream one layer
ahead of its backward (while layer i recomputes, the input of layer i-1 loads). See [Note: stream
and event ordering]: the ``saved`` event (d2h) orders the host buffer's write before its read-back;
the ``ready`` event (h2d) orders the read-back before the recompute; ``hand_over`` keeps each device
copy alive until the other stream is done.

Host buffers. Each input goes to a byte buffer in a mapping of its own (host_memory.HostRegion,
page-locked on CUDA), of exactly its size when made, kept in a pool and reused by later saves that
fit in it (the smallest free one that does). torch's pinned allocator would round each up to a power
of two: a 7B layer input at 384K tokens (2.6 GiB) takes a 4 GiB block, 38 GiB more over 28 layers
(computed from the sizes). When no free buffer fits (longer sequences than before) the free ones too
small to hold it are released first, so batches of varying length do not pile up buffers: the pool
holds at most what one step keeps in flight, at the largest size seen. Reuse is ordered on the GPU:
a buffer goes back to the pool with the event of its H2D read-back, and the next D2H into it waits
for that event on the ``d2h`` stream (writes are all on ``d2h``, reads all on ``h2d``); a buffer is
released only once its last read is done.
"""

from __future__ import annotations

import weakref

import torch

from ..host import release_all, host_buffer


class HostActivations:
    def __init__(self, streams, device: torch.device) -> None:
        self.streams, self.device = streams, device
        self.pin = device.type == "cuda"
        # keyed by the layer call (layer_call.LayerCall), not the layer index: two forwards before
        # one backward (a policy and a reference pass, gradient accumulation in one graph) each
        # keep their own inputs call -> (copy, buffer, saved event)
        self.on_host: dict[object, tuple[torch.Tensor, tuple, object]] = {}
        # call -> (device copy, ready event)
        self.on_device: dict[object, tuple[torch.Tensor, object]] = {}
        # a buffer is (uint8 tensor, its HostRegion or None); the free ones with the event of their
        # last read
        self.pool: list[tuple[tuple, object]] = []
        self.regions: list = []  # the buffers' mappings (unpinned when the engine goes)
        self.nbytes = 0  # host bytes of the buffers held (in use or pooled)
        weakref.finalize(self, release_all, self.regions)

    def _take(self, nbytes: int) -> tuple[tuple, object]:
        """A buffer of at least ``nbytes`` and the event its next write must wait for (None:
        none)."""
        fits = [entry for entry in self.pool if entry[0][0].numel() >= nbytes]
        if fits:
            entry = min(fits, key=lambda e: e[0][0].numel())
            self.pool = [e for e in self.pool if e is not entry]
            return entry
        # every free buffer is too small: released (outgrown)
        for (buf, region), last_read in self.pool:
            if last_read is not None:
                last_read.synchronize()  # no H2D may still read it when it is unpinned
            if region is not None:
                region.release()
                self.regions.remove(region)
            self.nbytes -= buf.numel()
        self.pool = []
        made = len(self.regions)
        buf = host_buffer(nbytes, torch.uint8, self.pin, self.regions)
        self.nbytes += buf.numel()
        return (buf, self.regions[-1] if len(self.regions) > made else None), None

    def _give(self, buffer: tuple, last_read) -> None:
        self.pool.append((buffer, last_read))

    def clear(self) -> None:
        """Drop every saved input (a backward failed: its graph is gone); their buffers go back to
        the pool."""
        for _, buffer, saved in self.on_host.values():
            self._give(buffer, saved)
        self.on_host.clear()
        self.on_device.clear()

    def save(self, i, hidden: torch.Tensor) -> None:
        """Queue the D2H of a layer call's input (call after the layer's forward kernels are
        queued)."""
        st = self.streams
        nbytes = hidden.numel() * hidden.element_size()
        buffer, last_read = self._take(max(nbytes, 1))
        host = buffer[0][:nbytes].view(hidden.dtype).view(hidden.shape)
        st.wait(st.d2h, st.record(st.compute()))
        st.wait(st.d2h, last_read)  # the buffer's previous contents have been read back (H2D)
        with st.on(st.d2h):
            host.copy_(hidden, non_blocking=True)
        st.hand_over(hidden, st.d2h)
        self.on_host[i] = (host, buffer, st.record(st.d2h))

    def prefetch(self, i) -> None:
        """Queue the H2D of a layer call's input, if it was saved and is not on its way already."""
        if i not in self.on_host or i in self.on_device:
            return
        st = self.streams
        host, buffer, saved = self.on_host.pop(i)
        st.wait(st.h2d, saved)
        # a copy even on the CPU device: the buffer is reused once this read is done
        with st.on(st.h2d):
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
        ready = st.record(st.h2d)
        self._give(buffer, ready)
        self.on_device[i] = (dev, ready)

    def load(self, i) -> torch.Tensor:
        """A layer call's input on the device, ordered before the compute stream's next kernel."""
        self.prefetch(i)
        dev, ready = self.on_device.pop(i)
        st = self.streams
        st.wait(st.compute(), ready)
        st.hand_over(dev, st.compute())
        return dev
