"""The capacity check's counting: ``Counting`` sums, for one plan's ``Decisions``, what the engine
holds on every tier by the rules capacity.py's docstring describes (the model of memory): the GPU's
persistent bytes and its peak per micro-batch (``_gpu_at``: the largest phase of the step), the
host's state and what is beside it (host_bytes.py's parts), the NVMe tier's disk, the largest
micro-batch that fits, and the verdicts (what clearly does not fit, which tier binds, what to
change); each step returns a value (``HostCount``, ``GpuCount``, ``Verdicts``) the next is given,
and ``Counting.prediction`` puts them into prediction.py's ``Prediction``. capacity.py's
``check_capacity`` builds one ``Counting`` per set of decisions (also inside the resolver's NVMe
split, for the step's host memory) and is its only caller; the constants (``CUDA_CONTEXT_BYTES``,
``GPU_HEADROOM``, ...) are re-exported there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .settings import TrainConfig
from .decisions import Decisions
from ..host import DeviceOptimizerState, memlock_limit, pinning_limits
from .host_bytes import (
    NVME_BUFFER_COUNT,
    MiB,
    HostBudget,
    disk_free_bytes,
    layer_store_bytes,
    meminfo,
    nvme_layer_bytes,
    nvme_settings,
    optimizer_scratch_bytes,
    resident_host_bytes,
    staging_buffers,
)
from ..model import LayerLayout
from ..streaming import weight_cache_layers
from .plan_gpu import ActivationModel, dtype_size
from .prediction import Prediction, fmt_bytes as _fmt

# CUDA context, loaded kernels, cuDNN/cuBLAS handles (an estimate; not torch's)
CUDA_CONTEXT_BYTES = 768 * MiB
NCCL_BYTES = 512 * MiB  # NCCL's own buffers per rank with several ranks (an estimate; not torch's)
# torch's cuBLAS workspace on the compute stream, Hopper (torch's allocator)
CUBLAS_WORKSPACE_BYTES = 32 * MiB
CUBLAS_WORKSPACE_BYTES_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8  # torch's default before sm90


def kept_layer_bytes(graph: int, numel: int, itemsize: int) -> int:
    """What keeping one more layer without recompute takes: its largest graph + 10% and its own
    weight buffer (``numel`` elements of ``itemsize`` bytes). engine_auto places kept layers by it
    from the measured graph; the plan's "auto" note counts them by it from the predicted one."""
    return int(graph * 1.1) + numel * itemsize


GPU_HEADROOM = 0.05  # of the memory left after the context: the caching allocator's fragmentation


@dataclass(frozen=True)
class HostCount:
    """Host RAM and the NVMe tier's disk of one plan (``Counting.count_host``)."""

    nvme: bool  # the NVMe tier is configured
    nvme_path: str | None
    buffer_count: int  # the tier's staging buffers (aio.buffer_count)
    budget: int  # bytes the host state and what is beside it may take
    budget_setting: object  # megatrain.host_memory_budget as given (GiB, "auto" or None)
    budget_source: str  # where the budget comes from, in words
    available: int | None  # MemAvailable, MemTotal
    total: int | None
    scratch: int  # the host optimizer's scratch (every rank's)
    disk: frozenset  # the layers on the NVMe tier
    parts: dict  # the host bytes by part, as the prediction's table shows them
    state: int  # the engine's host state (= host_memory())
    disk_bytes: int  # the NVMe tier's file(s)
    need_now: int  # host bytes at the configured micro-batch
    disk_free: int | None  # free bytes on the NVMe path (None: no path)


@dataclass(frozen=True)
class GpuCount:
    """The device of one plan (``Counting.count_gpu``)."""

    total: int | None  # the device's bytes (None: not known, or a CPU run)
    source: str  # where ``total`` comes from
    # what allocations may take: less the context and the fragmentation headroom
    usable: float | None
    allocated: int  # the step's peak at the configured micro-batch
    parts: dict  # its parts
    phase: str  # the phase of the step the peak is in
    # allocated + context (None: no sequence length, the activations are not counted)
    need: int | None
    notes: tuple = ()


@dataclass(frozen=True)
class Verdicts:
    """What clearly does not fit (CapacityError), other problems, what to change, and the binding
    tier."""

    refuse: list
    problems: list
    advice: list
    binding: str
    notes: tuple = ()


def _cublas_workspace_bytes(device: torch.device, gpu_memory: int | None) -> int:
    """The cuBLAS workspace torch allocates per (handle, stream) through its caching allocator: only
    the compute stream runs GEMMs here. ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KiB:COUNT" ...) when
    set; else torch's default for the device here (planning for another GPU: Hopper's)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        try:
            parts = [p for p in config.split(":") if p]
            return sum(
                int(parts[k]) * 1024 * int(parts[k + 1]) for k in range(0, len(parts) - 1, 2)
            )
        except ValueError:
            pass
    if gpu_memory is None and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index)[0] < 9:
            return CUBLAS_WORKSPACE_BYTES_PRE_HOPPER
    return CUBLAS_WORKSPACE_BYTES


def _gpu_at(
    b: int,
    layouts,
    dec: Decisions,
    acts: ActivationModel | None,
    persistent: dict[str, int],
    offload: bool,
    device_state_layers: int,
) -> tuple[int, dict[str, int], str]:
    """(peak allocated bytes, parts at the peak, the phase) for micro-batch ``b``: persistent + the
    largest phase."""
    base = sum(persistent.values())
    if acts is None:
        return base, dict(persistent), "initialize (no sequence length: activations not counted)"
    c = dtype_size(dec.compute)
    costs = acts.layer_costs(b)
    s = acts.input_bytes(b)
    n = len(layouts)
    # layer-call arguments + input ids and labels
    batch = acts.call_arg_bytes(b) + 2 * 8 * b * acts.seq
    head_grad = acts.head.weight.numel() * c if acts.head_trainable else 0
    emb_grad = (
        acts.embedding.weight.numel() * c if (acts.embedding_trainable and not acts.tied) else 0
    )
    land = 4 if (dec.ga == 1 and dec.grad == "fp32") else c  # the flat gradient in flight on d2h
    # executor._land_local: the flat gradient (compute dtype) converted on the GPU before its D2H
    # when it lands in another dtype: the fp32 home (GA 1), the wire-dtype ring slab (GA > 1: copy_
    # converts on the source device)
    convert = dtype_size(dec.grad if dec.ga == 1 else dec.wire)
    convert = 0 if convert == c else convert

    def saved(j: int) -> int:  # saved inputs of layers 0..j on the device
        return min(j + 1, 2) * s if offload else (j + 1) * s

    kept = [i for i in range(n - dec.keep, n)]
    kept_graphs = sum(costs[i].graph for i in kept)
    phases: list[tuple[int, dict[str, int], str]] = []
    for j in range(n):
        phases.append(
            (
                saved(j) + costs[j].forward,
                {"saved layer inputs": saved(j), "layer forward (no graph)": costs[j].forward},
                f"the forward of layer {j}",
            )
        )
    norm = acts.norm_graph(b)
    loss_fwd, _, loss_bwd = acts.loss_bytes(b)
    for way, loss in (("forward", loss_fwd), ("backward", loss_bwd)):
        phases.append(
            (
                saved(n - 1) + kept_graphs + norm + loss,
                {
                    "saved layer inputs": saved(n - 1),
                    "kept layers' graphs": kept_graphs,
                    "final norm graph": norm,
                    f"LM head + loss {way} ({acts.loss})": loss,
                },
                f"the loss {way}",
            )
        )
    for j in range(n - 1, -1, -1):
        inflight = (
            land * layouts[j + 1].n_train if (j + 1 < n and j + 1 >= device_state_layers) else 0
        )
        graphs = sum(costs[i].graph for i in kept if i < j)
        common = {
            "saved layer inputs": saved(j),
            "kept layers' graphs": graphs,
            "LM head gradient": head_grad,
            "incoming gradient": s,
            "previous layer's gradient in flight": inflight,
        }
        phases.append(
            (
                sum(common.values()) + costs[j].backward,
                {**common, "layer recompute + backward": costs[j].backward},
                f"the backward of layer {j}",
            )
        )
        # a GPU-held layer accumulates in place: no conversion, no D2H
        on_gpu = j < device_state_layers
        landing = 0 if on_gpu else convert * layouts[j].n_train
        phases.append(
            (
                sum(common.values()) + costs[j].after + landing,
                {
                    **common,
                    "layer gradients + outputs": costs[j].after,
                    "gradient converted for landing": landing,
                },
                f"the gradient landing of layer {j}",
            )
        )
    embed = head_grad + emb_grad + s + (s * 4 // c if acts.embedding_trainable else 0)
    phases.append(
        (
            embed,
            {
                "LM head gradient": head_grad,
                "embedding gradient": emb_grad,
                "incoming gradient + embedding backward": embed - head_grad - emb_grad,
            },
            "the embedding backward",
        )
    )
    top, parts, phase = max(phases, key=lambda p: p[0])
    return base + batch + top, {**persistent, "batch + layer-call arguments": batch, **parts}, phase


class Counting:
    """The counting of one plan, for decisions ``dec``: what the GPU holds (persistent, then per
    micro-batch: ``gpu``), what the host holds (the engine's state for a set of disk layers:
    ``host_for``; beside it). Its fields are the plan's inputs, set in ``__init__``; each counting
    step returns its numbers as a value (``HostCount``, ``GpuCount``, the largest micro-batch,
    ``Verdicts``) that the next ones and ``prediction`` are given."""

    def __init__(
        self,
        layouts: list[LayerLayout],
        resident: list[tuple[int, bool]],
        config: TrainConfig,
        dec: Decisions,
        device: torch.device,
        gpu_memory: int | None,
        world: int,
        acts: ActivationModel | None,
        owned,
        resident_owned,
    ) -> None:
        self.layouts, self.resident, self.config, self.dec = layouts, resident, config, dec
        self.world, self.acts, self.n, self.device = world, acts, len(layouts), device
        self.dev = "cuda" if device.type == "cuda" else "cpu"
        # the layers each rank of the host holds (dp.owned_mask)
        self.owned = [list(mask) for mask in owned]
        # the resident state each holds
        self.resident_owned = [list(mask) for mask in resident_owned]
        self.mb, self.offload = config.micro_batch_size, bool(config.megatrain.offload_activations)
        self.persistent = self._persistent(device, gpu_memory)
        self.gpu_min = sum(self.persistent.values())
        self.overhead = (
            (CUDA_CONTEXT_BYTES + (NCCL_BYTES if world > 1 else 0)) if self.dev == "cuda" else 0
        )

    def _persistent(self, device: torch.device, gpu_memory: int | None) -> dict[str, int]:
        """GPU bytes initialize allocates: weight slots (and their fp32 staging), kept layers'
        buffers, resident copies (and their state when GPU-held), the GPU-held layers' state, the
        cuBLAS workspace."""
        dec, layouts, n, c = self.dec, self.layouts, self.n, dtype_size(self.dec.compute)
        max_numel = max((lay.numel for lay in layouts), default=0)
        slots = min(self.config.megatrain.num_slots, n)
        persistent = {
            f"weight slots ({slots} x largest layer, {dec.compute})": slots * max_numel * c
        }
        if dec.wire != dec.compute:
            persistent[f"{dec.wire} staging of the slots (stream_fp32_master)"] = (
                slots * max_numel * dtype_size(dec.wire)
            )
        persistent["kept layers' weight buffers"] = (
            sum(layouts[i].numel for i in range(n - dec.keep, n)) * c
        )
        if dec.weight_cache:  # the layers the executor picks (the same rule)
            kept, held = range(n - dec.keep, n), range(dec.n_device_layers)
            cached = weight_cache_layers(n, kept, slots, held, dec.weight_cache)
            persistent["weight-cached layers' buffers"] = sum(layouts[i].numel for i in cached) * c
        persistent["resident parameters (compute copies)"] = sum(m for m, _ in self.resident) * c
        if dec.resident_on_device:  # rank 0's (data parallel: the resident parameters it holds)
            persistent["resident fp32 state (GPU-held optimizer)"] = 16 * sum(
                m for (m, t), mine in zip(self.resident, self.resident_owned[0]) if t and mine
            )
        # DeviceOptimizerState.nbytes, rank 0's
        persistent["GPU-held layers' master, moments, gradient"] = sum(
            self._layer_state_bytes(layouts[i])
            for i in range(dec.n_device_layers)
            if self.owned[0][i]
        )
        # grad_hold.py: every streamed layer's gradient rank 0 holds, until its update fetches it
        if dec.grad_hold:
            persistent[f"{dec.grad} gradients held until the norm (gradient_hold)"] = dtype_size(
                dec.grad
            ) * sum(lay.n_train for lay, mine in zip(layouts, self.owned[0]) if mine)
        if self.dev == "cuda":
            persistent["cuBLAS workspace"] = _cublas_workspace_bytes(device, gpu_memory)
        return persistent

    def _layer_state_bytes(self, layout: LayerLayout) -> int:
        """A GPU-held layer's state (DeviceOptimizerState): its fp32 master covers every element
        when the master is the wire, the trained ones otherwise."""
        master = layout.numel if self.dec.wire == "fp32" else layout.n_train
        return DeviceOptimizerState.state_bytes(master, layout.n_train)

    def gpu(self, b: int) -> tuple[int, dict[str, int], str]:
        return _gpu_at(
            b,
            self.layouts,
            self.dec,
            self.acts,
            self.persistent,
            self.offload,
            self.dec.n_device_layers,
        )

    def offloaded(self, b: int) -> int:
        """Pinned host copies of every layer's saved input during a step: one buffer of exactly its
        size per layer (activations.py)."""
        if not (self.offload and self.acts is not None):
            return 0
        return self.world * self.n * self.acts.input_bytes(b)

    def compute_on_host(self, b: int) -> int:
        """No GPU: the compute working set is host memory too."""
        return self.gpu(b)[0] if (self.dev == "cpu" and self.acts is not None) else 0

    def host_for(self, disk: frozenset[int], staging: int) -> dict[str, int]:
        """The engine's host state (per rank, summed; = host_memory()) with the ``disk`` layers on
        NVMe."""
        dec, parts = self.dec, {}
        for r in range(self.world):
            for k, v in layer_store_bytes(
                self.layouts,
                self.owned[r],
                dec.wire,
                dec.grad,
                dec.ga,
                disk,
                dec.master,
                staging,
                disk_masters=dec.nvme_masters,
                moments=dec.moments,
                hold=dec.grad_hold,
            ).items():
                parts[f"layers: {k}"] = parts.get(f"layers: {k}", 0) + v
        # each held by one rank (dp.py)
        parts["resident (embeddings, norms, head)"] = sum(
            resident_host_bytes(
                [item for item, mine in zip(self.resident, mask) if mine],
                dec.compute,
                self.dev,
                dec.resident_on_device,
            )
            for mask in self.resident_owned
        )
        return parts

    def host_need(self, state: int, scratch: int, b: int) -> int:
        return state + scratch + self.offloaded(b) + self.compute_on_host(b)

    def count_host(self, nvme_path: str | None, measured: HostBudget, budget_setting) -> HostCount:
        """Host RAM (the state, beside it what is not in it) and the NVMe tier's disk, against the
        budget."""
        dec, layouts, n = self.dec, self.layouts, self.n
        nvme, nvme_path_config, buffer_count = nvme_settings(self.config)
        nvme_path = nvme_path or nvme_path_config
        available, total = meminfo()
        budget, budget_source = measured.bytes, measured.source
        scratch = (
            sum(optimizer_scratch_bytes(layouts, mask, dec.master) for mask in self.owned)
            if self.config.optimizer is not None
            else 0
        )
        disk = frozenset(range(n - dec.disk_layers, n))
        parts = self.host_for(disk, staging_buffers(buffer_count) if nvme else 0)
        state = sum(parts.values())
        disk_bytes = sum(
            nvme_layer_bytes(layouts[i].n_train, dec.nvme_masters)
            for i in disk
            if layouts[i].n_train
        )
        need_now = self.host_need(state, scratch, self.mb)
        parts["host optimizer scratch (one layer, fp32)"] = scratch
        parts["offloaded layer inputs (pinned, per step)"] = self.offloaded(self.mb)
        if self.dev == "cpu" and self.acts is not None:
            parts["compute working set (the CPU is the device)"] = self.gpu(self.mb)[0]
        disk_free = disk_free_bytes(nvme_path) if (nvme or nvme_path) else None
        return HostCount(
            nvme,
            nvme_path,
            buffer_count,
            budget,
            budget_setting,
            budget_source,
            available,
            total,
            scratch,
            disk,
            parts,
            state,
            disk_bytes,
            need_now,
            disk_free,
        )

    def count_gpu(self, gpu_memory: int | None) -> GpuCount:
        """The device: its memory (given, this machine's, or unknown), what is usable, the step's
        peak."""
        total, source = None, "CPU"
        if self.dev == "cuda":
            total, source = _device_memory(self.device, gpu_memory)
        usable = None if total is None else (total - self.overhead) * (1 - GPU_HEADROOM)
        allocated, parts, phase = self.gpu(self.mb)
        need = allocated + self.overhead if self.acts is not None else None
        notes = (
            ()
            if self.acts is not None
            else ("no sequence length: the GPU's activations are not counted",)
        )
        if total is not None and need is not None:
            notes += self._auto_room(total, need)
        return GpuCount(total, source, usable, allocated, parts, phase, need, notes)

    def _auto_room(self, total: int, need: int) -> tuple[str, ...]:
        """What "auto" may place after the second step, predicted from this plan's peak: the room
        above it and ``gpu_memory_reserve`` of the device (engine_auto.placement_budget, with the
        whole device for this process), and how many units of each placement fit it: the resident
        parameters' state first, then a layer's optimizer state or a kept layer (its graph + 10%
        and its weight buffer, as engine_auto counts it). The order between the last two is the
        second step's measurement. The caching allocator's own overhead (2-5.5 GiB at 7B on 24 GiB,
        2026-11-30) is not in the plan's peak: the engine's budget is that much smaller."""
        dec = self.dec
        if not (dec.auto_device_state or dec.auto_keep or dec.auto_weight_cache):
            return ()
        if not self.layouts:
            return ()
        room = int(total - need - self.config.megatrain.gpu_memory_reserve * total)
        head = (
            f'"auto" (predicted from this plan): {_fmt(max(room, 0))} above the peak and the '
            f"{self.config.megatrain.gpu_memory_reserve:.0%} reserve, before the caching "
            "allocator's own overhead"
        )
        if room <= 0:
            return (head + ": nothing to place",)
        units, first = [], ""
        if dec.auto_device_state:
            resident = 16 * sum(m for m, t in self.resident if t)
            if 0 < resident <= room:
                first = f"the resident parameters' state first ({_fmt(resident)}), then "
                room -= resident
            state = max(self._layer_state_bytes(lay) for lay in self.layouts)
            if state and not self.config.bf16_masters:  # bf16 masters: the resident state only
                n_state = min(room // state, self.n - dec.disk_layers)  # not the NVMe tier's
                units.append(f"{n_state} layers' optimizer state ({_fmt(state)} each)")
        if dec.auto_keep:
            keep = kept_layer_bytes(
                max(c.graph for c in self.acts.layer_costs(self.mb)),
                max(lay.numel for lay in self.layouts),
                dtype_size(dec.compute),
            )
            units.append(f"{min(room // keep, self.n)} kept layers ({_fmt(keep)} each)")
        if dec.auto_weight_cache:  # engine_auto places it last, in what the others leave
            held = max(lay.numel for lay in self.layouts) * dtype_size(dec.compute)
            units.append(
                f"{min(room // held, self.n)} layers' weights held from forward to backward "
                f"({_fmt(held)} each)"
            )
        if not units:  # bf16 masters without kept layers: the resident state only
            return (head + ": " + first.removesuffix(", then "),) if first else ()
        return (head + ": " + first + " or ".join(units),)

    def largest_micro_batch(self, host: HostCount, gpu: GpuCount) -> tuple[int | None, str]:
        """(the largest b with host(b) <= budget and GPU(b) <= usable, what stops b + 1). When host
        RAM does not fit whatever the micro-batch (its state alone), the GPU alone decides (and the
        plan does not fit anyway)."""
        host_fixed = host.state + host.scratch
        host_counts = host_fixed <= host.budget or self.dev == "cpu"

        def stops(b: int) -> str | None:
            if host_counts and self.host_need(host.state, host.scratch, b) > host.budget:
                return "host RAM"
            if gpu.usable is not None and self.gpu(b)[0] > gpu.usable:
                return "GPU"
            return None

        if self.acts is not None and self.dev == "cuda" and gpu.usable is None and not self.offload:
            return None, "the GPU's memory is not known: " + gpu.source
        if self.acts is None:
            return None, "no sequence length"
        lo, hi = 0, 1
        while hi <= 1 << 24 and stops(hi) is None:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if stops(mid) is None else (lo, mid)
        limit = stops(hi) or "nothing below 16M sequences"
        if self.dev == "cuda" and gpu.usable is None:
            limit += " (the GPU's memory is not known: " + gpu.source + ")"
        if not host_counts:
            limit += (
                "; host RAM does not fit at any micro-batch (the state alone needs "
                f"{_fmt(host_fixed)})"
            )
        return lo, limit

    def verdicts(self, host: HostCount, gpu: GpuCount, max_mb: int | None) -> Verdicts:
        """What clearly does not fit (CapacityError), other problems, what to change, and the
        binding tier."""
        use = {"host RAM": host.need_now / max(host.budget, 1)}
        if host.nvme:
            use["disk"] = (
                host.disk_bytes / host.disk_free
                if host.disk_free
                else (math.inf if host.disk_bytes else 0.0)
            )
        if gpu.total is not None:
            use["GPU"] = (
                gpu.need if gpu.need is not None else self.gpu_min + self.overhead
            ) / gpu.total
        refuse, problems, advice = [], [], []
        if host.need_now > host.budget:
            self._host_verdict(host, refuse, advice)
        if host.nvme and host.disk_free is not None and host.disk_bytes > host.disk_free:
            refuse.append(
                f"disk: needs {_fmt(host.disk_bytes)} on {host.nvme_path}, {_fmt(host.disk_free)} "
                "free"
            )
            advice.append("free space on the NVMe path, or set megatrain.nvme_layers lower")
        if host.nvme and not host.nvme_path and self.dec.disk_layers:
            refuse.append(
                "disk: zero_optimization.offload_optimizer.device is nvme but no nvme_path is given"
            )
            advice.append("set zero_optimization.offload_optimizer.nvme_path")
        self._gpu_verdict(gpu, max_mb, refuse, problems, advice)
        notes = (
            ("no GPU here: GPU bytes are predicted, not checked (--gpu-memory GiB plans for one)",)
            if self.dev == "cuda" and gpu.total is None
            else ()
        )
        # RLIMIT_MEMLOCK: [Note: which limits bind host memory] (host_limits.py)
        if self.dev == "cuda":
            pinned = self.pinned_bytes(host)
            notes += tuple(
                f"page-locked host buffers about {_fmt(pinned)}: {limit}"
                for limit in pinning_limits(
                    0, pinned, memlock=memlock_limit(), cgroup=None, available=None
                )
            )
            notes += self._wire_note(host)
        return Verdicts(refuse, problems, advice, max(use, key=use.get), notes)

    def _wire_note(self, host: HostCount) -> tuple[str, ...]:
        """The bf16 wire as an option, where the fp32 master streams (the default) on one GPU: the
        host bytes its copy takes against the budget left, and the PCIe bytes of one pass over the
        layers with and without it. Measured both ways (2026-11-30_h200x2_7b_24gib_every_peer):
        +6-8% where the step waited on PCIe, -2% where the host update was the step."""
        dec = self.dec
        if not dec.stream_fp32_master or dec.compute == "fp32" or self.world != 1:
            return ()  # fp32 compute: the master is the compute dtype's wire already
        if not self.layouts:
            return ()
        numel = sum(lay.numel for lay in self.layouts)
        copy = numel * dtype_size(dec.compute)
        left = host.budget - host.need_now
        fits = "fits" if copy <= left else "does not fit"
        return (
            f"megatrain.stream_fp32_master false: a {dec.compute} wire copy on the host "
            f"({_fmt(copy)} more; {_fmt(max(left, 0))} of the host budget left: {fits}) halves "
            f"what a pass over the layers moves across PCIe ({_fmt(4 * numel)} -> "
            f"{_fmt(copy)}); measured +6-8% where the step waited on PCIe (7B, 8K tokens a step, "
            "24 GiB of GPU) and -2% where the host update was the step (3B, every layer's "
            "optimizer state on the host): the breakdown's h2d against its compute says which",
        )

    def pinned_bytes(self, host: HostCount) -> int:
        """The host parts page-locked on CUDA (host_memory.HostRegion): the wire copy (the master
        when it is the wire), the GA landing ring, the held gradients' slabs, the offloaded layer
        inputs; not the resident parameters' small wire and landing copies."""
        pinned = ("wire copy", "landing ring", "gradient slabs", "offloaded layer inputs")
        if self.dec.wire == self.dec.master:
            pinned += (f"{self.dec.master} master",)
        return sum(v for k, v in host.parts.items() if any(p in k for p in pinned))

    def _host_verdict(self, host: HostCount, refuse: list[str], advice: list[str]) -> None:
        dec, layouts, masters, nvme = self.dec, self.layouts, self.dec.nvme_masters, host.nvme
        refuse.append(
            f"host RAM: needs {_fmt(host.need_now)}, budget {_fmt(host.budget)} "
            f"({host.budget_source})"
        )
        lean = (
            host.need_now
            - (12 if masters else 8)
            * sum(layouts[i].n_train for i in range(self.n) if i not in host.disk)
            + self.world
            * staging_buffers(host.buffer_count if nvme else NVME_BUFFER_COUNT)
            * max((nvme_layer_bytes(lay.n_train, masters) for lay in layouts), default=0)
            - sum(v for k, v in host.parts.items() if k.endswith("NVMe staging buffers"))
        )
        optimizer = self.config.optimizer is not None
        # [Note: compact moments]
        if optimizer and not nvme and dec.master != "fp32" and dec.moments == "fp32":
            compact = host.need_now - 4 * sum(layouts[i].n_train for i in range(self.n))
            advice.append(
                f"bf16.bf16_optimizer_states: true (bf16 Adam moments beside the bf16 masters, "
                "rounded "
                f"each step; host RAM then {_fmt(compact)})"
            )
        if not nvme and optimizer and lean <= host.budget:
            advice.append(
                f"set zero_optimization.offload_optimizer.device=nvme (and nvme_path): the Adam "
                "moments of "
                "trailing layers go to disk (host RAM with every layer's moments on disk: "
                f"{_fmt(lean)})"
            )
        elif optimizer and lean > host.budget:
            advice.append(
                f"even with every layer's Adam moments{' and masters' if masters else ''} on NVMe "
                "host RAM "
                f"needs {_fmt(lean)}: a host with more memory"
                + (
                    ""
                    if masters or dec.master != "fp32" or dec.compute == "fp32"
                    else ", zero_optimization.offload_param.device=nvme as well (the NVMe layers' "
                    "fp32 masters "
                    "go to disk too: about 4 host bytes per parameter are left of 16)"
                )
                + (
                    ""
                    if dec.master != "fp32" or dec.compute != "bf16"
                    else ", bf16.bf16_master_weights_and_grads: true (bf16 masters: 4 host bytes "
                    "less per "
                    "parameter)"
                )
                + ", or train adapters (LoRA: the frozen base takes 2 bytes per parameter)"
            )
        elif nvme:
            advice.append(f"megatrain.nvme_layers: \"auto\" (or more than {dec.disk_layers})")
        if self.offload:
            advice.append(
                "megatrain.offload_activations: false (the saved layer inputs then stay on the GPU)"
            )
        if host.budget_source.startswith("memory cgroup"):
            advice.append(
                "ask the scheduler for more memory (SLURM --mem, Kubernetes "
                "resources.limits.memory, "
                "docker --memory): the memory cgroup's limit binds"
            )
        elif host.budget_setting not in (None, "auto"):
            advice.append(
                f"raise megatrain.host_memory_budget (MemAvailable here: {_fmt(host.available)})"
            )

    def _gpu_verdict(
        self,
        gpu: GpuCount,
        max_mb: int | None,
        refuse: list[str],
        problems: list[str],
        advice: list[str],
    ) -> None:
        gpu_over, mb, acts = False, self.mb, self.acts
        if gpu.total is not None:
            need_now = gpu.need if gpu.need is not None else self.gpu_min + self.overhead
            if need_now > gpu.total:
                gpu_over = True
                refuse.append(
                    f"GPU: needs {_fmt(need_now)} at micro-batch {mb}"
                    f"{'' if acts is not None else ' before any activation'}, the device has "
                    f"{_fmt(gpu.total)}"
                )
            elif gpu.need is not None and gpu.allocated > gpu.usable:
                problems.append(
                    f"GPU: needs {_fmt(gpu.need)} at micro-batch {mb}: less than {GPU_HEADROOM:.0%}"
                    " "
                    f"of the device's {_fmt(gpu.total)} stays free for fragmentation"
                )
                gpu_over = True
        if gpu_over and acts is not None:
            if max_mb:
                advice.append(
                    f"lower the micro-batch to {max_mb} (train_micro_batch_size_per_gpu; raise "
                    "gradient_accumulation_steps to keep the batch)"
                )
            if not self.offload:
                advice.append(
                    f"megatrain.offload_activations: true (the saved layer inputs, "
                    f"{_fmt(self.n * acts.input_bytes(mb))} per GPU, move to pinned host memory)"
                )
            if self.dec.keep:
                advice.append("megatrain.keep_activations: 0")
            if self.dec.n_device_layers:
                advice.append("megatrain.gpu_optimizer_layers: 0")
        elif gpu_over:
            advice.append(
                "megatrain.num_slots: 2, gpu_optimizer_layers: 0, keep_activations: 0; or a larger "
                "GPU"
            )

    def prediction(
        self,
        model_name: str,
        seq: int | None,
        host: HostCount,
        gpu: GpuCount,
        largest: tuple[int | None, str],
        verdict: Verdicts,
    ) -> Prediction:
        dec, resident, acts = self.dec, self.resident, self.acts
        max_mb, limit = largest
        return Prediction(
            model=model_name,
            n_layers=self.n,
            params=sum(lay.numel for lay in self.layouts) + sum(m for m, _ in resident),
            trainable=sum(lay.n_train for lay in self.layouts) + sum(m for m, t in resident if t),
            compute=dec.compute,
            wire=dec.wire,
            grad=dec.grad,
            ga=dec.ga,
            micro_batch=self.mb,
            seq=seq if acts is not None else None,
            world=self.world,
            device=self.dev,
            host_parts=host.parts,
            host_state_bytes=host.state,
            host_need_bytes=host.need_now,
            host_budget_bytes=host.budget,
            host_budget_source=host.budget_source,
            host_available_bytes=host.available,
            host_total_bytes=host.total,
            nvme=host.nvme,
            nvme_path=host.nvme_path,
            disk_layers=dec.disk_layers,
            nvme_masters=dec.nvme_masters,
            disk_bytes=host.disk_bytes,
            disk_free_bytes=host.disk_free,
            gpu_parts=gpu.parts if self.dev == "cuda" else {},
            gpu_phase=gpu.phase,
            gpu_allocated_bytes=gpu.allocated if acts is not None else None,
            gpu_min_bytes=self.gpu_min,
            gpu_overhead_bytes=self.overhead,
            gpu_total_bytes=gpu.total,
            gpu_source=gpu.source,
            max_micro_batch=max_mb,
            max_micro_batch_limit=limit,
            binding=verdict.binding,
            fits=not verdict.refuse,
            problems=verdict.refuse + verdict.problems,
            advice=verdict.advice,
            notes=[*dec.notes, *gpu.notes, *verdict.notes],
            decisions=dec,
        )


def _device_memory(device: torch.device, gpu_memory: int | None) -> tuple[int | None, str]:
    """(the GPU's bytes, where that number comes from): ``--gpu-memory``, this machine's GPU, or
    unknown."""
    if gpu_memory is not None:
        return int(gpu_memory), f"--gpu-memory {_fmt(int(gpu_memory))}"
    if torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.mem_get_info(index)[
            1
        ], f"{torch.cuda.get_device_name(index)} (cuda:{index})"
    return None, "no GPU here (--gpu-memory GiB plans for one)"
