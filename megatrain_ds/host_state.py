"""Host-resident state of the streamed layers: one flat buffer per kind, one view per layer.

Bytes per parameter (trainable, bf16 compute):
    master fp32 (4) + exp_avg fp32 (4) + exp_avg_sq fp32 (4) + wire bf16 (2, pinned) + grad (2 or 4)
    = 16 with GA 1 (gradients land in bf16 straight into their pinned home, as the GPU made them)
    = 18 with GA > 1 (an fp32 accumulator; landings go through a small pinned ring)
In fp32 mode the pinned master *is* the wire copy: 16 bytes with GA 1.

Flat buffers are allocated once, each in its own private mapping (huge pages, not inherited by fork), and
the streamed ones pinned with ``cudaHostRegister`` (the caching host allocator behind ``pin_memory=True``
rounds each block up to a power of two, which would cost up to 2x on a 12 GB buffer).
"""
from __future__ import annotations

import mmap
import queue
import warnings
import weakref
from dataclasses import dataclass

import torch

from .model_map import LayerLayout


def _anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping for engine state, advised (best effort, Linux) to use huge pages and to stay
    out of forked children.

    Huge pages: 512x fewer pages to fault in, to pin with ``cudaHostRegister`` and to free at exit (hundreds
    of GB at 14B+). Not inherited by ``fork()``: a DataLoader worker would otherwise share every page
    copy-on-write, so each page the optimizer writes afterwards would be copied while the worker lives (the
    host state would get a second copy), and pages pinned for DMA would be copied eagerly at each fork. A forked child
    cannot read the engine's state (it has no use for it; spawn a process instead).
    """
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        if hasattr(mmap, advice) and nbytes:
            try:
                mm.madvise(getattr(mmap, advice))
            except OSError:  # e.g. transparent huge pages compiled out: 4 KiB pages, same semantics
                pass
    return mm


class HostRegion:
    """A private anonymous mapping (see ``_anonymous_mapping``), page-locked with ``cudaHostRegister`` when
    ``pin`` and CUDA is available; owns the mapping until released.

    Why not ``torch.empty(pin_memory=True)``: the caching host allocator rounds each block up to a power of
    two (a 6.2 GB wire copy would take 8 GB). Why an mmap: a page-aligned mapping no other object shares, so
    registration never overlaps another allocation, and the mapping cannot be freed (and its addresses
    reused) while it is still registered: ``release()`` unregisters first.
    """

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool = True) -> None:
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        self.mm = _anonymous_mapping(nbytes)
        self.tensor = torch.frombuffer(self.mm, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
        self.ptr, self.nbytes, self.registered = self.tensor.data_ptr(), nbytes, False
        if pin and torch.cuda.is_available() and nbytes:
            # Fault the pages in first, on all intra-op threads (the mapping is zero-filled already, so this
            # writes nothing new): cudaHostRegister would otherwise fault hundreds of GB in on one thread.
            self.tensor.zero_()
            err = torch.cuda.cudart().cudaHostRegister(self.ptr, nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (CUDA error {int(err)}): "
                                   "not enough lockable host memory?")
            self.registered = True

    def release(self) -> None:
        if self.registered:
            self.registered = False
            err = torch.cuda.cudart().cudaHostUnregister(self.ptr)
            if int(err) != 0:
                warnings.warn(f"cudaHostUnregister failed with CUDA error {int(err)}", stacklevel=2)
        # the mapping itself is freed when the last tensor viewing it is gone


def host_buffer(numel: int, dtype: torch.dtype, pin: bool, regions: list) -> torch.Tensor:
    """A flat, zero-filled host tensor in its own mapping (``_anonymous_mapping``); page-locked when ``pin``.
    Recorded in ``regions`` for release."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX system: the plain allocator, unpinned
        return torch.zeros(numel, dtype=dtype)
    region = HostRegion(numel, dtype, pin)
    regions.append(region)
    return region.tensor


def _release_all(regions: list) -> None:
    for region in regions:
        region.release()
    regions.clear()


@dataclass(slots=True)
class LayerOffsets:
    full: int  # start of the layer in master/wire (all params)
    train: int  # start of the layer in exp_avg/exp_avg_sq/grad (trainable params only)


class HostLayerStore:
    """fp32 master, Adam moments, wire copy and gradients for every streamed layer."""

    def __init__(self, layouts: list[LayerLayout], wire_dtype: torch.dtype, grad_accum_fp32: bool,
                 pin: bool, grad_dtype: torch.dtype | None = None, owned: list[bool] | None = None) -> None:
        self.layouts = layouts
        self.wire_dtype = wire_dtype
        # Data parallel (dp.py): this process holds the state of the layers it owns only. A layer it does not own
        # takes no bytes (its offsets are those of the next owned layer) and has no views (``_owned``).
        self.owned = list(owned) if owned is not None else [True] * len(layouts)
        self.offsets: list[LayerOffsets] = []
        full = train = 0
        for layout, mine in zip(layouts, self.owned):
            self.offsets.append(LayerOffsets(full, train))
            if mine:
                full += layout.numel
                train += layout.n_train
        self.n_full, self.n_train = full, train
        self.regions: list[HostRegion] = []
        self.wire_is_master = wire_dtype == torch.float32
        # in fp32 mode the master is what streams to the GPU, so it is the pinned one
        self.master = host_buffer(full, torch.float32, pin and self.wire_is_master, self.regions)
        self.exp_avg = host_buffer(train, torch.float32, False, self.regions)
        self.exp_avg_sq = host_buffer(train, torch.float32, False, self.regions)
        self.wire = self.master if self.wire_is_master else host_buffer(full, wire_dtype, pin, self.regions)
        # Gradients: landed directly in their home (GA 1; in the wire dtype, or fp32 when
        # ``grad_dtype`` says so: the GPU converts before the D2H), or landed in a pinned ring and
        # accumulated into fp32 by the host worker (GA > 1).
        self.grad_direct = not grad_accum_fp32
        home_dtype = (grad_dtype or wire_dtype) if self.grad_direct else torch.float32
        self.grad = host_buffer(train, home_dtype, pin and self.grad_direct, self.regions)
        self.grad.zero_()
        self.max_train = max((l.n_train for l, mine in zip(layouts, self.owned) if mine), default=0)
        self.ring: queue.Queue | None = None
        self.scratch = None
        if not self.grad_direct:
            self.ring = queue.Queue()
            slabs = host_buffer(4 * self.max_train, wire_dtype, pin, self.regions)
            for k in range(4):
                self.ring.put(slabs[k * self.max_train:(k + 1) * self.max_train])
            self.scratch = torch.empty(self.max_train, dtype=torch.float32)  # fp32 view of a landed slab
        weakref.finalize(self, _release_all, self.regions)

    # views ---------------------------------------------------------------------------------------
    def _owned(self, i: int) -> None:
        if not self.owned[i]:
            raise KeyError(f"layer {i}'s host state is held by another rank (data parallel: see dp.py)")

    def master_of(self, i: int) -> torch.Tensor:
        self._owned(i)
        o = self.offsets[i].full
        return self.master[o:o + self.layouts[i].numel]

    def wire_of(self, i: int) -> torch.Tensor:
        self._owned(i)
        o = self.offsets[i].full
        return self.wire[o:o + self.layouts[i].numel]

    def train_slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        self._owned(i)
        o = self.offsets[i].train
        return flat[o:o + self.layouts[i].n_train]

    def grad_of(self, i: int) -> torch.Tensor:
        return self.train_slice(self.grad, i)

    def load_layer(self, i: int, layer: torch.nn.Module) -> None:
        """Copy ``layer``'s weights into the master (and wire) and release the module's own storage (a layer
        another rank owns: only released)."""
        by_name = dict(layer.named_parameters(remove_duplicate=False))
        if not self.owned[i]:
            for slot in self.layouts[i].slots:
                release_storage(by_name[slot.name])
            return
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
        return total + self.fixed_nbytes()

    def fixed_nbytes(self) -> int:
        """Bytes that do not grow with the model: the landing ring and its scratch (a few layers' worth)."""
        if self.ring is None:
            return 0
        return 4 * self.max_train * torch.tensor([], dtype=self.wire_dtype).element_size() + self.scratch.numel() * 4

    def close(self) -> None:
        _release_all(self.regions)


def release_storage(param: torch.Tensor) -> None:
    """Drop a parameter's storage but keep the object (and its identity) for the user and the optimizer.

    Like a ZeRO-3 partitioned parameter: ``ds_shape``/``ds_numel`` tell what the full tensor looks like.
    """
    param.ds_shape = tuple(param.shape)
    param.ds_numel = param.numel()
    param.data = torch.empty(0, dtype=param.dtype)
