"""One owner of "where layer i's state lives" (issue 28): its fp32 master, Adam moments and
gradient.

A streamed layer's state has one home (``Home``): host RAM (host_state.py), the NVMe tier (nvme.py:
its moments, and with ``offload_param.device: nvme`` its master, in a swap file), the GPU
(device_state.py: the leading ``gpu_optimizer_layers``), or another data-parallel rank (dp.py: each
rank holds the layers it owns). ``LayerStates`` alone answers ``where(i)`` and reads, writes and
moves that state; checkpoints, exports, the DeepSpeed surface, ``GatheredParameters`` and the engine
ask it instead of checking the store, the tier and the device state themselves.

The GPU-held layers may be placed after the first step ("auto": engine_auto.py); ``place_on_device``
is the one transition that changes a home (RAM -> GPU for the leading layers; it asserts none was
placed before), and each layer's answer is computed there, not per ask. The executor, its gradient
landing and the host optimizer are given this object when they are built and ask it: where a layer's
gradient lands (``grad_home``: decided here once, for the landing and the optimizer alike), the
buffers on its way (``landing_slab``, ``fold_grad``, ``take_grad``), the GPU-held layers' device
tensors (``device_master``, ``device_update_state``); they never reach for the device state, the
gradient hold or the store's flags themselves. Nothing else holds the device state or the gradient
hold.
"""

from __future__ import annotations

import enum

import torch

from .device_state import DeviceOptimizerState
from .host_state import HostLayerStore


class Home(enum.Enum):
    """Where a streamed layer's fp32 master, Adam moments and gradient live (on this rank's
    view)."""

    RAM = "ram"
    """Host RAM: views of the host store's flat buffers (host_state.py)."""
    NVME = "nvme"
    """The NVMe tier: the moments (and, with ``offload_param.device: nvme``, the master) are in a
    swap file and are read as copies (nvme.py); the wire copy and the gradient stay in RAM."""
    GPU = "gpu"
    """The GPU (``gpu_optimizer_layers``, device_state.py): the live master, moments and gradient
    are device tensors; the host copies are stale until ``sync_to_host``."""
    OTHER_RANK = "other_rank"
    """Another data-parallel rank owns the layer (dp.py): this rank holds none of its state."""


class GradHome(enum.Enum):
    """Where layer i's gradient lands and accumulates over a window (``LayerStates.grad_home``)."""

    DEVICE = "device"
    """A GPU-held layer (device_state.py): accumulated in fp32 on the device; only its norm goes to
    the host."""
    HOLD = "hold"
    """Held on the device by the gradient hold (grad_hold.py), in the home dtype; the update takes
    it through a pinned slab (``take_grad``)."""
    DIRECT = "direct"
    """GA 1: lands straight into its pinned host home, in the wire dtype (or fp32), its norm taken
    on the GPU."""
    STAGED = "staged"
    """GA > 1: lands in a slab of the pinned ring (``landing_slab``) and is folded into the fp32
    accumulator on the host (``fold_grad``)."""
    OTHER_RANK = "other_rank"
    """Another data-parallel rank owns the layer: nothing lands here."""


class LayerStates:
    """The state of every streamed layer, wherever it lives: built once by the engine
    (engine_build.py)."""

    def __init__(self, store: HostLayerStore, device: torch.device) -> None:
        self.store, self._device = store, device
        self._device_state: DeviceOptimizerState | None = None  # set once, by place_on_device
        # each layer's answer, recomputed by the transition only
        self.homes: list[Home] = self._homes()
        self._grad_homes: list[GradHome] = self._answer(self._grad_home)  # (the same)

    # ------------------------------------------------------------------ where
    @property
    def device_state(self) -> DeviceOptimizerState | None:
        """The GPU-held layers' state (device_state.py), or None: none placed (yet)."""
        return self._device_state

    @property
    def hold(self):
        """The gradients held on the device (grad_hold.py ``GradientHold``), or None: they land on
        the host."""
        return self.store.hold

    def gpu_layers(self) -> range | None:
        """The layers whose state was placed on the GPU (this rank holds those it owns), or None:
        none placed."""
        ds = self.device_state
        return None if ds is None else range(ds.lo, ds.hi)

    def place_on_device(self, n: int, moments_from_host: bool = False) -> None:
        """Keep the state of the leading ``n`` layers on the device from now on (at build, or after
        the first step with the moments so far: ``moments_from_host``)."""
        assert self._device_state is None, (
            "place_on_device: layers were placed on the device already (once only)"
        )
        assert all(h is not Home.GPU for h in self.homes)
        self._device_state = DeviceOptimizerState(
            self.store, 0, n, self._device, moments_from_host=moments_from_host
        )
        self.homes = self._homes()
        self._grad_homes = self._answer(self._grad_home)

    @property
    def layouts(self):
        """Every streamed layer's ``LayerLayout`` (model_map.py): where each parameter sits in its
        flat buffers."""
        return self.store.layouts

    def __len__(self) -> int:
        return len(self.store.layouts)

    def where(self, i: int) -> Home:
        """Layer i's home on this rank (as of the last transition)."""
        return self.homes[i]

    def _homes(self) -> list[Home]:
        return self._answer(self._home)

    def _answer(self, ask) -> list:
        return [ask(i) for i in range(len(self.store.layouts))]

    def _home(self, i: int) -> Home:
        if not self.holds(i):
            return Home.OTHER_RANK
        if self.on_gpu(i):
            return Home.GPU
        if self.moments_on_disk(i):
            return Home.NVME
        return Home.RAM

    def grad_home(self, i: int) -> GradHome:
        """Where layer i's gradient lands (as of the last transition): the landing puts it there
        and the optimizer takes it from there, both by this answer."""
        return self._grad_homes[i]

    def _grad_home(self, i: int) -> GradHome:
        if not self.holds(i):
            return GradHome.OTHER_RANK
        if self.on_gpu(i):
            return GradHome.DEVICE
        if self.store.hold is not None:
            return GradHome.HOLD
        return GradHome.DIRECT if self.store.grad_direct else GradHome.STAGED

    def holds(self, i: int) -> bool:
        """This rank holds layer i's state (one process: every layer)."""
        return self.store.owned[i]

    def owned(self) -> list[bool]:
        """Which layers' state this rank holds (data parallel: its own; one process: all)."""
        return list(getattr(self.store, "owned", None) or [True] * len(self.store.layouts))

    def owned_layers(self) -> list[int]:
        """The layers this rank holds, in order."""
        return [i for i, mine in enumerate(self.owned()) if mine]

    def on_gpu(self, i: int) -> bool:
        """Layer i's live state is GPU-held (its host copies are stale until ``sync_to_host``)."""
        ds = self.device_state
        return ds is not None and ds.owns(i)

    def moments_on_disk(self, i: int) -> bool:
        """Layer i's moments are on the NVMe tier."""
        return self.store.on_disk(i)

    def master_on_disk(self, i: int) -> bool:
        """Layer i's fp32 master is on the NVMe tier too (``offload_param.device: nvme``)."""
        return self.store.master_on_disk(i)

    # ------------------------------------------------------------------ masters
    def sync_to_host(self) -> None:
        """Copy the GPU-held masters and moments into the host buffers (blocking; the caller has
        synchronized)."""
        if self.device_state is not None:
            self.device_state.sync_to_host()

    def _refresh_host(self, i: int) -> None:
        """A GPU-held layer's host master from the device (this layer only)."""
        if self.on_gpu(i):
            self.store.master_of(i).copy_(self.device_state.master_of(i))

    def refresh_host_masters(self, layers) -> None:
        """The GPU-held ones among ``layers``: their host masters from the device, each once (a
        whole-model gather then reads every parameter with ``param_master``; refreshed per
        parameter, a 1.5B model's gather moved its layers D2H a dozen times over)."""
        for i in layers:
            self._refresh_host(i)

    def master(self, i: int) -> torch.Tensor:
        """Layer i's master (its trainable region when compact) on the host: a view (RAM) or a copy
        (NVMe). A GPU-held layer's is as of the last ``sync_to_host``."""
        return self.store.read_master(i)

    def full_master(self, i: int) -> torch.Tensor:
        """Layer i's whole ``[trainable | frozen]`` weights in fp32 on the host
        (``HostLayerStore.full_master``)."""
        return self.store.full_master(i)

    def frozen(self, i: int) -> torch.Tensor:
        """Layer i's frozen region where it is kept (``HostLayerStore.frozen_of``)."""
        return self.store.frozen_of(i)

    def param_master(self, i: int, name: str) -> torch.Tensor:
        """One parameter of layer i where the host keeps it (``HostLayerStore.param_master``)."""
        return self.store.param_master(i, name)

    def device_param(self, i: int, name: str) -> torch.Tensor | None:
        """A trainable parameter of a GPU-held layer: a view of its device master (the current
        value; the host copy is as of the last ``sync_to_host``); None for any other parameter (its
        host master is current)."""
        if not self.on_gpu(i):
            return None
        slot = self.store.slot_of(i, name)
        if not slot.trainable:
            return None
        return self.device_master(i)[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def device_master(self, i: int) -> torch.Tensor:
        """A GPU-held layer's live fp32 master (a device view): what the forward casts its weights
        from."""
        return self.device_state.master_of(i)

    def device_update_state(self, i: int) -> tuple[torch.Tensor, ...]:
        """A GPU-held layer's (master, gradient, exp_avg, exp_avg_sq) to update in place on the
        device (views)."""
        ds = self.device_state
        return (ds.master_of(i), ds.grad_of(i), *ds.moments_of(i))

    def ds_tensor(self, i: int, slot) -> torch.Tensor:
        """A streamed parameter's ``ds_tensor``: a view of where it is kept (``param_master``); an
        NVMe layer's master has no RAM view, so its wire copy (compute dtype, as DeepSpeed's own
        ``ds_tensor``); empty for a layer another rank holds (data parallel)."""
        if not self.holds(i):
            return torch.empty(0)
        if self.master_on_disk(i) and slot.trainable:
            return self.store.wire_of(i)[slot.offset : slot.offset + slot.numel].view(slot.shape)
        return self.store.param_master(i, slot.name)

    def set_param_master(self, i: int, name: str, value: torch.Tensor) -> None:
        """Overwrite one parameter's master wherever layer i lives, and the copies made from it
        (wire, device)."""
        store, gpu = self.store, self.on_gpu(i)
        # the host copy of a GPU-held layer is stale: refresh it before the whole layer is copied
        # back (the other weights must stay)
        if gpu:
            self._refresh_host(i)
        # a frozen parameter of a compact store: its wire copy
        store.set_param_master(i, name, value)
        if gpu:
            self.device_state.master_of(i).copy_(store.master_of(i))

    def load_masters(self, layer_values) -> dict:
        """Write each ``(i, slot, value)`` into the masters of the layers this rank holds (NVMe
        ones: staged); then ``finish_loading_masters`` refreshes every wire copy and the GPU-held
        masters (``load_master_state_dict``). Returns the staged NVMe masters for
        ``finish_loading_masters``."""
        # NVMe layers' masters: assembled here, written once per layer (below)
        store, staged = self.store, {}
        for i, slot, value in layer_values:
            if not store.owned[i]:  # data parallel: each rank writes the layers it holds
                continue
            if store.master_on_disk(i) and slot.trainable:
                if i not in staged:
                    staged[i] = store.read_master(i).clone()
                staged[i][slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
            else:
                store.param_master(i, slot.name).copy_(value.reshape(slot.shape))
        return staged

    def finish_loading_masters(self, staged: dict) -> None:
        """After ``load_masters`` (and the resident parameters): write the staged NVMe masters,
        refresh the wire copies and the GPU-held masters."""
        store = self.store
        for i in range(len(store.layouts)):
            if i in staged:
                store.write_master(i, staged[i])  # and its wire
            elif store.owned[i] and not store.master_on_disk(i):
                store.refresh_wire(i)
        ds = self.device_state
        if ds is not None:
            ds.master.copy_(store.master[ds.full0 : ds.full1])

    # ------------------------------------------------------------------ moments and gradients
    def moments(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's live (exp_avg, exp_avg_sq) to read: the device's (GPU-held), RAM views, or
        copies staged from the NVMe tier (``commit_moments`` writes a changed copy back). Not while
        the optimizer runs."""
        if self.on_gpu(i):
            return self.device_state.moments_of(i)
        return self.store.read_moments(i)

    def host_moments(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's moments in the host buffers (RAM views, or NVMe copies), even for a GPU-held
        layer."""
        return self.store.read_moments(i)

    def commit_moments(self, i: int) -> None:
        """After writing into ``moments(i)``: an NVMe layer's staged copy goes back to disk."""
        if self.moments_on_disk(i):
            m, v = self.store.read_moments(i)
            self.store.write_moments(i, m, v)

    def write_moments(self, i: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Overwrite layer i's host moments (flat) wherever they live (``push_moments_to_device``
        follows)."""
        self.store.write_moments(i, exp_avg, exp_avg_sq)

    def push_moments_to_device(self) -> None:
        """The GPU-held layers' moments from the host buffers (after a load)."""
        ds = self.device_state
        if ds is not None:
            ds.exp_avg.copy_(self.store.exp_avg[ds.train0 : ds.train1])
            ds.exp_avg_sq.copy_(self.store.exp_avg_sq[ds.train0 : ds.train1])

    def grad(self, i: int) -> torch.Tensor:
        """Layer i's accumulated gradient buffer: the device's (GPU-held) or the host's."""
        if self.on_gpu(i):
            return self.device_state.grad_of(i)
        return self.store.grad_of(i)

    def has_disk_tier(self) -> bool:
        """Some layers' moments are on the NVMe tier (its read-ahead follows the order they are
        asked in)."""
        return self.store.tier is not None

    # ---------------------------------------------------- the gradient's way (``grad_home``)
    def landing_slab(self) -> torch.Tensor:
        """A free slab of the pinned landing ring (``GradHome.STAGED``) to D2H a gradient into:
        blocks while the landing thread's folds are the ring's length behind. ``return_slab``
        once folded."""
        return self.store.ring.get()

    def return_slab(self, slab: torch.Tensor) -> None:
        """A slab folded by ``fold_grad``: only now may a later D2H overwrite it."""
        self.store.ring.put(slab)

    def extra_landing(self, numel: int, pin: bool) -> torch.Tensor:
        """A temporary host buffer in the gradient home's dtype for a second landing of a window
        in a ``GradHome.DIRECT`` home (two forwards into one loss): ``fold_grad`` adds it to the
        first."""
        return torch.empty(numel, dtype=self.store.grad.dtype, pin_memory=pin)

    def fold_grad(self, i: int, landed: torch.Tensor, first: bool) -> torch.Tensor:
        """Landing thread: fold a landed gradient into layer i's host home and return the home:
        the window's first landing is copied, a later one added (a landing in the wire dtype into
        an fp32 accumulator through an fp32 scratch: a converting copy and an fp32 add are much
        faster on the CPU than one mixed add_)."""
        grad = self.store.grad_of(i)
        if first:
            grad.copy_(landed)
        elif landed.dtype != grad.dtype:
            grad.add_(self.store.scratch[: grad.numel()].copy_(landed))
        else:
            grad.add_(landed)
        return grad

    def expect_grad_takes(self, order, ready) -> None:
        """Main thread, at the optimizer step: this step's updates take the host layers' gradients
        (``take_grad``) in ``order``, once ``ready`` (the event after the backward) has passed;
        the gradients held on the device are copied to the host in that order, each ahead of its
        update."""
        hold = self.store.hold
        if hold is not None:
            hold.begin([i for i in order if self._grad_homes[i] is GradHome.HOLD], ready)

    def take_grad(self, i: int) -> torch.Tensor:
        """AdamW thread: layer i's gradient on the host for its update: its home (a view), or,
        held on the device, the pinned slab its copy landed in (the next one's copy started
        behind it). ``give_grad`` after the update."""
        if self._grad_homes[i] is GradHome.HOLD:
            return self.store.hold.take(i)
        return self.store.grad_of(i)

    def give_grad(self, i: int) -> None:
        """AdamW thread, after layer i's update (or its failure): what ``take_grad`` lent is
        returned."""
        if self._grad_homes[i] is GradHome.HOLD:
            self.store.hold.give(i)
