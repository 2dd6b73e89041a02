"""Host-resident state of the streamed layers: one flat buffer per kind, one view per layer.

Bytes per parameter (trainable, bf16 compute):
    master fp32 (4) + exp_avg fp32 (4) + exp_avg_sq fp32 (4) + wire bf16 (2, pinned) + grad (2 or 4)
    = 16 with GA 1 (gradients land in bf16 straight into their pinned home, as the GPU made them)
    = 18 with GA > 1 (an fp32 accumulator; landings go through a small pinned ring)
In fp32 mode the pinned master *is* the wire copy: 16 bytes with GA 1.

Frozen parameters (a LoRA base, anything in no optimizer group) are never updated, so they need no
fp32 master, moments or gradient: they live in the wire copy only, in the compute dtype (bf16: **2
bytes per parameter**; fp32 mode: the wire is the master, 4). DeepSpeed keeps frozen parameters the
same way (16-bit, outside its fp32 partitions). So the master buffer holds each layer's trainable
region only (``compact``); ``master_of(i)`` is that region and ``param_master`` of a frozen
parameter is its wire view.

Opt-in bf16-master mode (DeepSpeed's ``bf16.bf16_master_weights_and_grads``; what the official
MegaTrain code does): the master is the bf16 wire copy itself, 2 bytes: 12 bytes per trained
parameter with GA 1 (14 with GA > 1), at the cost of updates smaller than bf16's resolution rounding
away. fp32 masters stay the default. With DeepSpeed's ``bf16.bf16_optimizer_states`` beside it the
moments are bf16 too: 8 bytes ([Note: compact moments] in host_update.py).

NVMe tier (nvme.py, ``offload_optimizer.device: nvme``): the Adam moments of a suffix of the layers
live in a swap file; their 8 bytes per parameter leave RAM (``disk_from``;
``acquire_moments``/``release_moments``). With ``offload_param.device: nvme`` too
(``NvmeSettings.masters``), those layers' fp32 masters join them on disk: 12 bytes per trained
parameter leave RAM, which keeps the wire copy and the gradient (4 bytes with GA 1). The master then
cannot be the wire (the forward streams the wire from RAM): a compact store only (a bf16 wire beside
an fp32 master). Such a layer's master is reached through ``acquire_state`` (the optimizer),
``read_master`` (a copy) and ``write_master``/``set_param_master``; ``master_of`` refuses it.

Flat buffers are allocated once, each in its own private mapping (huge pages, not inherited by
fork), and the streamed ones pinned with ``cudaHostRegister`` (the caching host allocator behind
``pin_memory=True`` rounds each block up to a power of two, which would cost up to 2x on a 12 GB
buffer): host_memory.py.
"""

from __future__ import annotations

import queue
import weakref
from dataclasses import dataclass

import torch

from .grad_hold import GradientHold

# importable from here too
from .host_memory import HostRegion, release_all, host_buffer  # noqa: F401
from ..model import LayerLayout


@dataclass(slots=True)
class LayerOffsets:
    full: int  # start of the layer in the wire copy (all params)
    train: int  # start of the layer in exp_avg/exp_avg_sq/grad (trainable params only)
    # start of the layer in the fp32 master (all params, or trainable only when compact)
    master: int = 0


class HostLayerStore:
    """fp32 master, Adam moments, wire copy and gradients for every streamed layer."""

    def __init__(
        self,
        layouts: list[LayerLayout],
        wire_dtype: torch.dtype,
        grad_accum_fp32: bool,
        pin: bool,
        grad_dtype: torch.dtype | None = None,
        owned: list[bool] | None = None,
        disk_from: int | None = None,
        nvme=None,
        rank: int = 0,
        nvme_backend: str = "auto",
        master_dtype: torch.dtype = torch.float32,
        moments_dtype: torch.dtype = torch.float32,
        hold_device: torch.device | None = None,
    ) -> None:
        self.layouts = layouts
        self.wire_dtype = wire_dtype
        # bf16-master mode (opt-in, DeepSpeed's bf16.bf16_master_weights_and_grads): the master *is*
        # the bf16 wire copy, as fp32 mode's master is its fp32 one; the optimizer updates it
        # through an fp32 copy of one layer
        if master_dtype not in (torch.float32, wire_dtype):
            raise ValueError(
                f"master dtype {master_dtype} must be fp32 or the wire dtype {wire_dtype}"
            )
        self.master_dtype = master_dtype
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"moments dtype {moments_dtype} must be fp32 or bf16")
        self.moments_dtype = moments_dtype  # bf16: [Note: compact moments] in host_update.py
        # Data parallel (dp.py): this process holds the state of the layers it owns only. A layer it
        # does not own takes no bytes (its offsets are those of the next owned layer) and has no
        # views (``_owned``).
        self.owned = list(owned) if owned is not None else [True] * len(layouts)
        self.wire_is_master = wire_dtype == master_dtype
        # frozen parameters live in the wire copy only (module docstring); in fp32 mode the wire is
        # the master
        self.compact = not self.wire_is_master
        self.offsets: list[LayerOffsets] = []
        full = train = 0
        for layout, mine in zip(layouts, self.owned):
            self.offsets.append(LayerOffsets(full, train, train if self.compact else full))
            if mine:
                full += layout.numel
                train += layout.n_train
        self.n_full, self.n_train = full, train
        self.n_master = train if self.compact else full
        # NVMe tier (nvme.py): the Adam moments of the owned layers from ``disk_from`` on live in a
        # swap file; the RAM moments buffers hold the layers before it, at the same offsets (a
        # suffix is cut off)
        n_layers = len(layouts)
        self.disk_from = n_layers if disk_from is None else max(0, min(int(disk_from), n_layers))
        ram_train = self.offsets[self.disk_from].train if self.disk_from < n_layers else train
        disk = {
            i: layouts[i].n_train
            for i in range(self.disk_from, n_layers)
            if self.owned[i] and layouts[i].n_train
        }
        self.tier = None
        # (layer, exp_avg, exp_avg_sq[, master]): the last copy read of a disk layer
        self._read_copy = None
        self.masters_on_disk = bool(disk) and bool(getattr(nvme, "masters", False))
        if self.masters_on_disk and not self.compact:
            raise ValueError(
                "the masters can go to NVMe only beside a separate wire copy (a bf16 wire and fp32 "
                f"masters); here the {master_dtype} master is the wire itself"
            )
        if disk and moments_dtype != torch.float32:
            raise ValueError("the NVMe tier holds fp32 moments: bf16 moments stay in RAM")
        if disk:
            from .nvme import NvmeMoments

            self.tier = NvmeMoments(disk, nvme, rank=rank, backend=nvme_backend)
        self.regions: list[HostRegion] = []
        # In fp32 mode the master is what streams to the GPU, so it is the pinned one. The wire is
        # pinned once ``load_layer`` has written every layer (``finish_loading``): pinning faults
        # every page in, and until the layers are loaded the model still holds its own copy of them
        # (peak host memory: one copy + one layer).
        self.master = host_buffer(
            ram_train if self.masters_on_disk else self.n_master,
            master_dtype,
            pin and self.wire_is_master,
            self.regions,
            defer=True,
        )
        self.exp_avg = host_buffer(ram_train, moments_dtype, False, self.regions)
        self.exp_avg_sq = host_buffer(ram_train, moments_dtype, False, self.regions)
        self.wire = (
            self.master
            if self.wire_is_master
            else host_buffer(full, wire_dtype, pin, self.regions, defer=True)
        )
        # Gradients: landed directly in their home (GA 1; in the wire dtype, or fp32 when
        # ``grad_dtype`` says so: the GPU converts before the D2H), or landed in a pinned ring and
        # accumulated into fp32 by the host worker (GA > 1).
        self.grad_direct = not grad_accum_fp32
        home_dtype = (grad_dtype or wire_dtype) if self.grad_direct else torch.float32
        self.max_train = max((l.n_train for l, mine in zip(layouts, self.owned) if mine), default=0)
        # [Note: gradients held on the device] (grad_hold.py): no host home, three slabs instead
        self.hold = None
        if hold_device is not None:
            self.hold = GradientHold(
                train, self.max_train, home_dtype, hold_device, pin, self.regions, self.train_slice
            )
        self.grad = (
            torch.zeros(0, dtype=home_dtype)
            if self.hold is not None
            else host_buffer(train, home_dtype, pin and self.grad_direct, self.regions)
        )
        self.grad.zero_()
        self.ring: queue.Queue | None = None
        self.scratch = None
        if not self.grad_direct:
            self.ring = queue.Queue()
            slabs = host_buffer(4 * self.max_train, wire_dtype, pin, self.regions)
            for k in range(4):
                self.ring.put(slabs[k * self.max_train : (k + 1) * self.max_train])
            # fp32 view of a landed slab
            self.scratch = torch.empty(self.max_train, dtype=torch.float32)
        weakref.finalize(self, release_all, self.regions)
        if self.tier is not None:
            weakref.finalize(self, self.tier.close)

    # views ---------------------------------------------------------------------------------------
    def _owned(self, i: int) -> None:
        if not self.owned[i]:
            raise KeyError(
                f"layer {i}'s host state is held by another rank (data parallel: see dp.py)"
            )

    def master_numel(self, i: int) -> int:
        """Elements of layer i in the fp32 master: its trainable region when compact, else the whole
        layer."""
        layout = self.layouts[i]
        return layout.n_train if self.compact else layout.numel

    def master_of(self, i: int) -> torch.Tensor:
        """Layer i's fp32 master: ``[trainable | frozen]``, or its trainable region only when
        ``compact``. A view of RAM: a layer whose master is on NVMe has none (``read_master``,
        ``acquire_state``, ``write_master``)."""
        self._owned(i)
        if self.master_on_disk(i):
            raise RuntimeError(
                f"layer {i}'s master is on NVMe: read_master(i) (a copy) or acquire_state(i)"
            )
        o = self.offsets[i].master
        return self.master[o : o + self.master_numel(i)]

    def frozen_of(self, i: int) -> torch.Tensor:
        """Layer i's frozen region, where it is kept: in the master (fp32 mode) or the wire (compute
        dtype)."""
        layout = self.layouts[i]
        flat = self.wire_of(i) if self.compact else self.master_of(i)
        return flat[layout.n_train : layout.numel]

    def full_master(self, i: int) -> torch.Tensor:
        """Layer i's whole ``[trainable | frozen]`` weights in fp32: a view of the master, or
        (compact, with frozen parameters) a copy assembled from the master and the wire."""
        layout = self.layouts[i]
        if self.master_dtype != torch.float32:  # bf16-master mode: an fp32 copy
            return self.master_of(i).float()
        master = self.read_master(i) if self.master_on_disk(i) else self.master_of(i)
        if not self.compact or layout.n_frozen == 0:
            return master
        return torch.cat([master, self.frozen_of(i).float()])

    def refresh_wire(self, i: int, master: torch.Tensor | None = None) -> None:
        """The wire copy of layer i's trainable region from its master (after the master changed);
        ``master``: the master where the caller holds it (an NVMe layer's staged copy), else
        ``master_of(i)``."""
        if not self.wire_is_master:
            n_train = self.layouts[i].n_train
            master = self.master_of(i) if master is None else master
            self.wire_of(i)[:n_train].copy_(master[:n_train])

    def wire_of(self, i: int) -> torch.Tensor:
        self._owned(i)
        o = self.offsets[i].full
        return self.wire[o : o + self.layouts[i].numel]

    def train_slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        self._owned(i)
        o = self.offsets[i].train
        return flat[o : o + self.layouts[i].n_train]

    def grad_of(self, i: int) -> torch.Tensor:
        """Layer i's gradient home: host memory, or the device with ``hold`` (grad_hold.py)."""
        return self.hold.view(i) if self.hold is not None else self.train_slice(self.grad, i)

    # Adam moments (and masters): in RAM (views) or, for a layer on disk, through the NVMe tier ----
    def on_disk(self, i: int) -> bool:
        return self.tier is not None and i in self.tier.n_train

    def master_on_disk(self, i: int) -> bool:
        return self.masters_on_disk and i in self.tier.n_train

    def acquire_moments(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (exp_avg, exp_avg_sq) to update in place; pair with ``release_moments``. RAM:
        views."""
        if self.on_disk(i):
            self._read_copy = None
            return self.tier.acquire(i)[:2]
        return self.train_slice(self.exp_avg, i), self.train_slice(self.exp_avg_sq, i)

    def release_moments(self, i: int, dirty: bool = True) -> None:
        if self.on_disk(i):
            self.tier.release(i, dirty)

    def acquire_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's (master, exp_avg, exp_avg_sq) to update in place, wherever each lives; pair
        with ``release_moments`` (which writes an NVMe layer's region back, its master included)."""
        if self.master_on_disk(i):
            self._read_copy = None
            m, v, master = self.tier.acquire(i)
            return master, m, v
        return (self.master_of(i), *self.acquire_moments(i))

    def _read(self, i: int) -> tuple:
        # the last layer read is kept (a checkpoint reads a layer once per parameter)
        if self._read_copy is None or self._read_copy[0] != i:
            self._read_copy = (i, *self.tier.read(i))
        return self._read_copy[1:]

    def read_moments(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's moments to read: views (RAM) or copies (disk). Not while the optimizer runs."""
        if self.on_disk(i):
            return self._read(i)[:2]
        return self.train_slice(self.exp_avg, i), self.train_slice(self.exp_avg_sq, i)

    def read_master(self, i: int) -> torch.Tensor:
        """Layer i's master (trainable region when compact) to read: a view (RAM) or a copy
        (NVMe)."""
        if self.master_on_disk(i):
            self._owned(i)
            return self._read(i)[2]
        return self.master_of(i)

    def write_master(self, i: int, master: torch.Tensor) -> None:
        """Overwrite layer i's master (flat, ``master_numel(i)`` elements) wherever it lives and
        refresh its wire."""
        if self.master_on_disk(i):
            self.tier.write(i, master=master)
            self._read_copy = None
        else:
            self.master_of(i).copy_(master.reshape(-1))
        self.refresh_wire(i, master.reshape(-1))

    def set_param_master(self, i: int, name: str, value: torch.Tensor) -> None:
        """Overwrite one parameter of layer ``i`` where it is kept (``param_master``: its master, or
        the wire copy of a frozen one) and refresh the wire copy of what changed."""
        slot = self.slot_of(i, name)
        if self.master_on_disk(i) and slot.trainable:
            master = self.read_master(i).clone()
            master[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
            self.write_master(i, master)
            return
        self.param_master(i, name).copy_(value.reshape(slot.shape))
        if slot.trainable:
            self.refresh_wire(i)

    def write_moments(self, i: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Overwrite layer i's moments (flat, its trainable elements) wherever they live."""
        if self.on_disk(i):
            self.tier.write(i, exp_avg, exp_avg_sq)
            self._read_copy = None
        else:
            self.train_slice(self.exp_avg, i).copy_(exp_avg.reshape(-1))
            self.train_slice(self.exp_avg_sq, i).copy_(exp_avg_sq.reshape(-1))

    def expect_moments(self, order) -> None:
        """The optimizer will update these layers next, in this order: read the disk ones ahead."""
        if self.tier is not None:
            self.tier.expect(order)

    def disk_nbytes(self) -> int:
        """Bytes of the NVMe tier's swap file (0 without one)."""
        return 0 if self.tier is None else self.tier.file_bytes

    def load_layer(self, i: int, layer: torch.nn.Module) -> None:
        """Copy ``layer``'s weights into the master (and wire) and release the module's own storage
        (a layer another rank owns: only released)."""
        by_name = dict(layer.named_parameters(remove_duplicate=False))
        if not self.owned[i]:
            for slot in self.layouts[i].slots:
                release_storage(by_name[slot.name])
            return
        layout = self.layouts[i]
        disk = self.master_on_disk(i)
        # staged, then written once
        master = torch.empty(layout.n_train, dtype=torch.float32) if disk else None
        for slot in layout.slots:
            param = by_name[slot.name]
            if disk and slot.trainable:
                master[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
            else:
                self.param_master(i, slot.name).view(-1).copy_(param.detach().reshape(-1))
            release_storage(param)
        if disk:  # the whole region at once: the master, and moments that start at zero
            zeros = torch.zeros(layout.n_train, dtype=torch.float32)
            self.tier.write(i, zeros, zeros, master, flush=False)
        self.refresh_wire(i, master)

    def finish_loading(self) -> None:
        """Every layer is loaded: page-lock the buffers whose pinning waited for it (their pages are
        written) and wait for the NVMe layers' first writes."""
        for region in self.regions:
            if region.pending:
                region.register(written=True)
        if self.tier is not None:
            self.tier.flush()

    def slot_of(self, i: int, name: str):
        """Layer i's layout slot named ``name`` (where the parameter sits in the layer's flat
        buffers)."""
        for slot in self.layouts[i].slots:
            if slot.name == name:
                return slot
        raise KeyError(f"layer {i} has no parameter {name!r}")

    def param_master(self, i: int, name: str) -> torch.Tensor:
        """Where one parameter of layer ``i`` is kept (a view, shaped like the parameter): its fp32
        master; for a frozen parameter of a ``compact`` store, its wire copy (compute dtype). An
        NVMe layer's master: a view of a copy (reading only; ``set_param_master`` writes)."""
        slot = self.slot_of(i, name)
        flat = self.read_master(i) if slot.trainable else self.frozen_of(i)
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def nbytes(self) -> int:
        """Bytes of every host buffer (the wire copy counted once when it is the master)."""
        tensors = {
            id(t): t for t in (self.master, self.exp_avg, self.exp_avg_sq, self.wire, self.grad)
        }
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return total + self.fixed_nbytes()

    def fixed_nbytes(self) -> int:
        """Bytes that do not grow with the model: the landing ring and its scratch (a few layers'
        worth), the NVMe tier's staging buffers."""
        staging = 0 if self.tier is None else self.tier.staging_bytes()
        # (not staging: the held gradients' slabs)
        staging += 0 if self.hold is None else self.hold.host_bytes()
        if self.ring is None:
            return staging
        return (
            staging
            + 4 * self.max_train * torch.tensor([], dtype=self.wire_dtype).element_size()
            + self.scratch.numel() * 4
        )

    def close(self) -> None:
        release_all(self.regions)
        if self.tier is not None:
            self.tier.close()


def release_storage(param: torch.Tensor) -> None:
    """Drop a parameter's storage but keep the object (and its identity) for the user and the
    optimizer.

    Like a ZeRO-3 partitioned parameter: ``ds_shape``/``ds_numel`` tell what the full tensor looks
    like.
    """
    param.ds_shape = tuple(param.shape)
    param.ds_numel = param.numel()
    param.data = torch.empty(0, dtype=param.dtype)
