"""Host memory for engine state: private anonymous mappings (huge pages, kept out of forked
children), page-locked with ``cudaHostRegister`` when they stream (``HostRegion``), and the flat
buffers made of them (``host_buffer``).

The host layer store (host_state.py), the NVMe tier's staging buffers (nvme.py), the resident
optimizer state (optimizer.py) and the host activations (activations.py) allocate here; this module
imports nothing of the package, so none of them has to import another for its memory. A page-locking
failure names the limits it ran into (host_limits.py, [Note: which limits bind host memory]).
"""

from __future__ import annotations

import mmap
import threading
import warnings

import torch

from .host_limits import cgroup_memory, meminfo, memlock_limit, pinning_limits

# page-locked by every HostRegion of this process now (what a failure reports)
_registered_bytes = 0
_registered_lock = threading.Lock()  # regions register from the host threads too (activations.py)


def _anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping for engine state, advised (best effort, Linux) to use huge pages
    and to stay out of forked children.

    Huge pages: 512x fewer pages to fault in, to pin with ``cudaHostRegister`` and to free at exit
    (hundreds of GB at 14B+). Not inherited by ``fork()``: a DataLoader worker would otherwise share
    every page copy-on-write, so each page the optimizer writes afterwards would be copied while the
    worker lives (the host state would get a second copy), and pages pinned for DMA would be copied
    eagerly at each fork. A forked child cannot read the engine's state (it has no use for it; spawn
    a process instead).
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
    """A private anonymous mapping (see ``_anonymous_mapping``), page-locked with
    ``cudaHostRegister`` when ``pin`` and CUDA is available; owns the mapping until released.

    Why not ``torch.empty(pin_memory=True)``: the caching host allocator rounds each block up to a
    power of two (a 6.2 GB wire copy would take 8 GB). Why an mmap: a page-aligned mapping no other
    object shares, so registration never overlaps another allocation, and the mapping cannot be
    freed (and its addresses reused) while it is still registered: ``release()`` unregisters first.
    """

    def __init__(
        self, numel: int, dtype: torch.dtype, pin: bool = True, defer: bool = False
    ) -> None:
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        self.mm = _anonymous_mapping(nbytes)
        self.tensor = (
            torch.frombuffer(self.mm, dtype=dtype, count=numel)
            if numel
            else torch.empty(0, dtype=dtype)
        )
        self.ptr, self.nbytes, self.registered = self.tensor.data_ptr(), nbytes, False
        # ``register(written=True)`` pins it once its contents are written
        self.pending = pin and defer
        if pin and not defer:
            self.register(written=False)

    def register(self, written: bool) -> None:
        """Page-lock the mapping (CUDA only). ``written``: every page was written already (faulted
        in)."""
        self.pending = False
        if not torch.cuda.is_available() or not self.nbytes or self.registered:
            return
        if not written:
            # Fault the pages in first, on all intra-op threads (the mapping is zero-filled already,
            # so this writes nothing new): cudaHostRegister would otherwise fault hundreds of GB in
            # on one thread.
            self.tensor.zero_()
        err = torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(pin_failure_message(self.nbytes, _registered_bytes, int(err)))
        self.registered = True
        _count_registered(self.nbytes)

    def release(self) -> None:
        if self.registered:
            self.registered = False
            _count_registered(-self.nbytes)
            err = torch.cuda.cudart().cudaHostUnregister(self.ptr)
            if int(err) != 0:
                warnings.warn(f"cudaHostUnregister failed with CUDA error {int(err)}", stacklevel=2)
        # the mapping itself is freed when the last tensor viewing it is gone


def _count_registered(delta: int) -> None:
    global _registered_bytes
    with _registered_lock:
        _registered_bytes += delta


def pin_failure_message(
    nbytes: int, pinned: int, error: int, limits: list[str] | None = None
) -> str:
    """What a failed ``cudaHostRegister`` of ``nbytes`` says, with ``pinned`` bytes page-locked
    already: each limit it ran into, with its numbers and by how much (host_limits.pinning_limits,
    read now unless ``limits`` is given), or every limit's value when none is short."""
    if limits is None:
        cgroup, (available, _), memlock = cgroup_memory(), meminfo(), memlock_limit()
        limits = pinning_limits(pinned, nbytes, memlock=memlock, cgroup=cgroup, available=available)
        if not limits:
            locked = "unlimited" if memlock is None else f"{memlock / 2**30:.2f} GiB"
            room = (
                "none"
                if cgroup is None
                else f"{cgroup.path}, {cgroup.headroom / 2**30:.2f} GiB left"
            )
            limits = [
                f"none is short (RLIMIT_MEMLOCK {locked}; memory cgroup {room}; MemAvailable "
                f"{available / 2**30:.2f} GiB)"
            ]
    return (
        f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed (CUDA error {error}) with "
        f"{pinned / 2**30:.2f} GiB page-locked by this process already; limits: "
        + "; ".join(limits)
    )


def host_buffer(
    numel: int, dtype: torch.dtype, pin: bool, regions: list, defer: bool = False
) -> torch.Tensor:
    """A flat, zero-filled host tensor in its own mapping (``_anonymous_mapping``); page-locked when
    ``pin`` (at once, or with ``defer`` by ``register`` once written). Recorded in ``regions`` for
    release."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX system: the plain allocator, unpinned
        return torch.zeros(numel, dtype=dtype)
    region = HostRegion(numel, dtype, pin, defer)
    regions.append(region)
    return region.tensor


def release_all(regions: list) -> None:
    for region in regions:
        region.release()
    regions.clear()
