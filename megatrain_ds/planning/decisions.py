"""The resolver: every decision about a run that can be made before its first step, made once, here.

``resolve(config, layouts, device_type, share)`` turns the parsed config (config.py's
``TrainConfig``) and the model's layer layouts (model_map.py) into one frozen ``Decisions``: the
dtypes (compute, what crosses PCIe, the masters, what gradients land in and accumulate in), every
"auto" that is decidable at initialize (``stream_fp32_master``, ``host_kernel``, ``liger_kernels``
in fp32 compute, ``gpu_optimizer_layers`` from ``offload_optimizer.ratio``, ``nvme_layers`` from the
host budget, ``check_recompute`` and its tolerance), which streamed layers are GPU-held, in RAM or
on the NVMe tier, the kept layers, and where the resident parameters' optimizer state lives. The
engine builds what it says (engine_build.py); the planner counts what it says (capacity.py's
``check_capacity``, plan.py's ``plan_model``): one decision, which is why the plan's host bytes
equal ``engine.host_memory()`` to the byte. Cross-field conflicts between settings are config.py's
(``parse_config`` refuses them); the byte arithmetic the NVMe split needs is host_bytes.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .settings import TrainConfig
from ..errors import ConfigError
from .host_bytes import (
    layer_store_bytes,
    nvme_masters,
    nvme_settings,
    nvme_split,
    optimizer_scratch_bytes,
    resident_host_bytes,
    staging_buffers,
)
from ..optim import lands_fp32, resolve_kernel
from ..model import LayerLayout, TOLERANCE, steps_to_check

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class Decisions:
    """Every init-time decision of a run (see the module docstring). Dtypes are named "fp32" /
    "bf16" / "fp16"; the ``*_dtype`` properties give torch's.

    Left "auto" here, flagged, and decided after step 2 by engine.auto_placer
    (training/engine_auto.py) from the first steps' measured GPU peak: the optimizer state of the
    resident parameters and of leading layers on the GPU (``auto_device_state``:
    ``gpu_optimizer_layers`` "auto"; ``n_device_layers`` is then 0 until that step), the kept layers
    (``auto_keep``: ``keep_activations`` "auto"; ``keep`` is then 0), the weight cache
    (``auto_weight_cache``: ``weight_cache_layers`` "auto"). Decided by the part that needs
    them, from the machine or the call rather than from the config and the layouts: ``tiled_mlp``
    "auto" (per layer call, from its tokens: tiling.py), ``inference_cache`` "auto" (at a no-grad
    forward, from free device memory: inference.py), ``host_threads`` "auto" (the GPU's NUMA node
    and the local ranks: placement.py), ``nvme_backend`` "auto" (whether DeepSpeed's aio op builds:
    nvme.py), whether liger-kernel is installed and knows the model type
    (engine_build.apply_liger_kernels, with ``liger_kernels`` as decided here).
    ``host_memory_budget`` "auto" is a measurement (host_bytes.host_budget_bytes), which the caller
    passes in ``HostShare``."""

    compute: str  # the compute dtype: "bf16" | "fp16" | "fp32"
    # the fp32 master crosses PCIe (cast on the GPU) instead of a compute-dtype wire copy
    stream_fp32_master: bool
    # what crosses PCIe and is kept for frozen weights: "fp32" (the master) or the compute dtype
    wire: str
    # the streamed layers' master weights: "fp32", or the compute dtype
    # (bf16_master_weights_and_grads)
    master: str
    # the streamed layers' Adam moments: "fp32", or "bf16" (bf16_optimizer_states: compact moments)
    moments: str
    # what a layer's gradient lands in from the GPU (host_update.lands_fp32; with GA 1 its home)
    landing: str
    grad: str  # the gradient home: ``landing`` with GA 1, "fp32" with GA > 1 (an fp32 accumulator)
    ga: int
    # gradient_hold "gpu": the gradients wait for the norm on the device (grad_hold.py)
    grad_hold: bool
    host_kernel: str  # the host AdamW: "native" | "torch" (host_update.resolve_kernel)
    # the update after the norm in two native passes, moments last (host_update.py's Note)
    deferred_moments: bool
    # what engine_build.apply_liger_kernels applies: "auto" is False in fp32 compute
    liger_kernels: bool | str
    n_layers: int  # streamed layers
    # trailing layers on the NVMe tier (their moments; their masters too with ``nvme_masters``)
    disk_layers: int
    # offload_param.device nvme beside the tier: the disk layers' fp32 masters leave RAM too
    nvme_masters: bool
    # leading layers whose optimizer state is on the GPU from initialize (before the NVMe ones)
    n_device_layers: int
    # the resident parameters' fp32 optimizer state is on the GPU from initialize
    resident_on_device: bool
    keep: int  # trailing layers kept without recompute from initialize
    # gpu_optimizer_layers "auto": decided after step 2 by engine.auto_placer
    auto_device_state: bool
    auto_keep: bool  # keep_activations "auto": decided after step 2 by engine.auto_placer
    # layers whose weights keep a device buffer from forward to backward, from initialize
    # (weight_cache_layers; executor.py's [Note: weight cache])
    weight_cache: int
    # weight_cache_layers "auto": decided after step 2 by engine.auto_placer, after the other two
    auto_weight_cache: bool
    # optimizer steps whose recomputes are checked (None: every step)
    check_recompute_steps: int | None
    # the relative error a recompute may differ by ("auto": by compute dtype)
    check_recompute_tolerance: float
    notes: tuple[str, ...] = ()  # what the planner says about the decisions left to the first step

    @property
    def disk_from(self) -> int:
        """The first layer on the NVMe tier (``n_layers`` when none is)."""
        return self.n_layers - self.disk_layers

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.compute]

    @property
    def wire_dtype(self) -> torch.dtype:
        return DTYPES[self.wire]

    @property
    def master_dtype(self) -> torch.dtype:
        return DTYPES[self.master]

    @property
    def moments_dtype(self) -> torch.dtype:
        return DTYPES[self.moments]

    @property
    def landing_dtype(self) -> torch.dtype:
        return DTYPES[self.landing]


@dataclass(frozen=True)
class HostShare:
    """Whose host state an "auto" decision (the NVMe split, ``gradient_hold``) must fit, and in how
    many bytes: the resident parameters (``(elements, trainable)`` each), the streamed layers each
    rank sharing the budget holds (``owned``, one mask per rank of the host: the engine and the
    planner pass every rank on it), the resident parameters each of those ranks holds the state of
    (``resident_owned``, one mask per rank; None: as one shard of those ranks divides them,
    dp.resident_positions), the bytes they may take (``budget``), what else those bytes must hold
    beside the state (``beside``: bytes, or a function of the decisions before the split; the
    planner's offloaded activations and, on a CPU device, its working set), and ``hold``:
    ``gradient_hold`` "auto" as decided by the caller (None: here; data parallel: the engine holds
    on every rank when one rank must)."""

    resident: tuple[tuple[int, bool], ...]
    owned: tuple[tuple[bool, ...], ...]
    budget: int
    beside: int | Callable[[Decisions], int] = 0
    resident_owned: tuple[tuple[bool, ...], ...] | None = None
    hold: bool | None = None

    def resident_masks(self) -> tuple[tuple[bool, ...], ...]:
        if self.resident_owned is not None:
            return self.resident_owned
        from ..parallel import resident_positions

        positions = resident_positions(list(self.resident), len(self.owned))
        return tuple(tuple(p is None or p == r for p in positions) for r in range(len(self.owned)))


def stream_fp32_master(config: TrainConfig, layouts: list[LayerLayout]) -> bool:
    """``megatrain.stream_fp32_master``: whether the fp32 master itself crosses PCIe. Never with
    bf16 masters (there is no fp32 master) or with the NVMe layers' masters on disk (the
    compute-dtype wire streams from RAM). "auto": the master, unless most streamed weights are
    frozen (LoRA): their compute-dtype wire copy is then their only copy."""
    if config.bf16_masters or nvme_masters(config):
        return False
    setting = config.megatrain.stream_fp32_master
    if setting == "auto":
        return sum(lay.n_frozen for lay in layouts) <= sum(lay.n_train for lay in layouts)
    return bool(setting)


def liger_setting(config: TrainConfig) -> bool | str:
    """``megatrain.liger_kernels`` as applied: "auto" in fp32 compute is False (fp32 training is the
    exact mode, and liger's kernels round differently from the model's own, below bf16's precision);
    else the setting (True requires them, "auto" applies them where liger-kernel is installed and
    knows the model type)."""
    setting = config.megatrain.liger_kernels
    return False if (setting == "auto" and config.compute_dtype == "fp32") else setting


def recompute_tolerance(config: TrainConfig) -> float:
    """``megatrain.check_recompute_tolerance``: the setting, or ("auto") recompute_check.py's for
    the compute dtype."""
    setting = config.megatrain.check_recompute_tolerance
    return (
        float(setting) if setting != "auto" else TOLERANCE.get(DTYPES[config.compute_dtype], 1e-4)
    )


def defer_moments(setting: bool | str, kernel: str) -> bool:
    """``megatrain.deferred_moments``: "auto" and true need the native kernel (true refuses without
    it); per layer the optimizer also needs it in RAM and AdamW (or no weight decay) ([Note:
    deferred moments] in host_update.py)."""
    if setting is True and kernel != "native":
        raise ConfigError(
            "megatrain.deferred_moments: true needs the native host kernel (host_kernel \"native\" "
            "or \"auto\" with a C compiler); set it to \"auto\" or false"
        )
    return setting is not False and kernel == "native"


def resolve(
    config: TrainConfig,
    layouts: list[LayerLayout],
    device_type: str = "cuda",
    share: HostShare | None = None,
) -> Decisions:
    """The decisions for ``config`` over ``layouts`` (every streamed layer's, whoever holds it) on a
    ``device_type`` ("cuda" or "cpu") device. ``share``: what an "auto" NVMe split must fit
    (``HostShare``); without it an "auto" ``nvme_layers`` puts no layer on disk. Builds the native
    host kernel now when it is chosen (host_update.py)."""
    mt, n = config.megatrain, len(layouts)
    compute, notes = config.compute_dtype, []
    stream = stream_fp32_master(config, layouts)
    kernel = resolve_kernel(mt.host_kernel)  # built now (about a second), not in the first step
    landing = "fp32" if lands_fp32(mt.fp32_grad_landing, stream, kernel) else compute
    ga = config.gradient_accumulation_steps
    n_device = mt.gpu_optimizer_layers
    # from DeepSpeed's offload_optimizer.ratio (the fraction of optimizer state on the CPU)
    if n_device == -1:
        ratio = config.offload_optimizer_ratio
        n_device = "auto" if ratio is None else round((1.0 - ratio) * n)
    # bf16-master mode: the resident parameters' state only (their masters are fp32; the layers'
    # bf16 masters have no GPU-held form): engine_auto.AutoPlacer
    auto_state = n_device == "auto" and config.optimizer is not None
    if auto_state:
        notes.append(
            "gpu_optimizer_layers \"auto\": after the second step the engine moves optimizer state "
            "to "
            "the GPU memory that step left free (not counted here; host state shrinks by as much)"
            + (": the resident parameters' only, with bf16 masters" if config.bf16_masters else "")
        )
    n_device = 0 if n_device == "auto" else min(int(n_device), n)
    auto_keep = mt.keep_activations == "auto"
    if auto_keep:
        notes.append(
            "keep_activations \"auto\": after the second step, layers whose graph fits in the GPU "
            "memory "
            "left free skip their recompute (not counted here)"
        )
    auto_cache = mt.weight_cache_layers == "auto"
    if auto_cache:
        notes.append(
            "weight_cache_layers \"auto\": after the second step, the GPU memory left after the "
            "optimizer state and the kept layers holds layers' weights from their forward to their "
            "backward (one H2D a step for each, not two; not counted here)"
        )
    nvme, _, buffer_count = nvme_settings(config)
    hold = mt.gradient_hold == "gpu"
    if hold and ga > 1:
        raise ConfigError(
            "megatrain.gradient_hold \"gpu\" keeps one gradient per layer until the norm: it needs "
            f"gradient_accumulation_steps 1, got {ga}"
        )
    if hold and nvme:
        raise ConfigError(
            "megatrain.gradient_hold \"gpu\" does not combine with the NVMe tier "
            "(zero_optimization."
            "offload_optimizer.device \"nvme\"): use one or the other"
        )
    before_split = Decisions(
        compute=compute,
        stream_fp32_master=stream,
        wire="fp32" if stream else compute,
        master=compute if config.bf16_masters else "fp32",
        moments="bf16" if config.bf16_moments else "fp32",
        landing=landing,
        grad="fp32" if ga > 1 else landing,
        ga=ga,
        grad_hold=hold,
        host_kernel=kernel,
        deferred_moments=defer_moments(mt.deferred_moments, kernel) and not hold,
        liger_kernels=liger_setting(config),
        n_layers=n,
        disk_layers=0,
        nvme_masters=nvme and nvme_masters(config),
        n_device_layers=n_device,
        resident_on_device=n_device > 0,
        keep=0 if auto_keep else min(int(mt.keep_activations), n),
        auto_device_state=auto_state,
        auto_keep=auto_keep,
        weight_cache=0 if auto_cache else min(int(mt.weight_cache_layers), n),
        auto_weight_cache=auto_cache,
        check_recompute_steps=steps_to_check(mt.check_recompute),
        check_recompute_tolerance=recompute_tolerance(config),
        notes=tuple(notes),
    )
    if (
        mt.gradient_hold == "auto"
        and not nvme
        and ga == 1
        and device_type == "cuda"
        and share is not None
        and config.optimizer is not None
        and (
            share.hold
            if share.hold is not None
            else _host_bytes(before_split, layouts, device_type, share) > share.budget
        )
    ):
        held = replace(before_split, grad_hold=True, deferred_moments=False)
        if share.hold or _host_bytes(held, layouts, device_type, share) <= share.budget:
            why = (
                "another rank's host state needs" if share.hold else "the host state fits only with"
            )
            before_split = replace(
                held,
                notes=held.notes
                + (
                    f"gradient_hold \"auto\": {why} the gradients held on the GPU until the norm "
                    "(12 host bytes/param "
                    "instead of 14; no speculative step, one-pass updates)",
                ),
            )
    disk = 0
    if nvme and config.optimizer is not None:
        if mt.nvme_layers != "auto":
            disk = min(int(mt.nvme_layers), n)
        elif share is not None:
            disk = _nvme_auto(before_split, layouts, device_type, share, buffer_count)
    n_device = min(n_device, n - disk)  # GPU-held layers lead; NVMe layers trail
    return replace(
        before_split, disk_layers=disk, n_device_layers=n_device, resident_on_device=n_device > 0
    )


def _host_bytes(
    dec: Decisions,
    layouts: list[LayerLayout],
    device_type: str,
    share: HostShare,
    disk: frozenset[int] = frozenset(),
) -> int:
    """The share's host bytes with the ``disk`` layers' moments (and masters, with ``nvme_masters``)
    out of RAM: what ``check_capacity`` counts (each rank's ``HostLayerStore``, its
    ``ResidentParams`` host tensors, the optimizer's scratch) and what the share holds beside
    them."""
    total = sum(
        sum(
            layer_store_bytes(
                layouts,
                list(mask),
                dec.wire,
                dec.grad,
                dec.ga,
                disk,
                dec.master,
                disk_masters=dec.nvme_masters,
                moments=dec.moments,
                hold=dec.grad_hold,
            ).values()
        )
        for mask in share.owned
    )
    total += sum(
        resident_host_bytes(
            [item for item, mine in zip(share.resident, mask) if mine],
            dec.compute,
            device_type,
            dec.resident_on_device,
        )
        for mask in share.resident_masks()
    )
    total += sum(optimizer_scratch_bytes(layouts, list(mask), dec.master) for mask in share.owned)
    return total + (share.beside(dec) if callable(share.beside) else share.beside)


def _nvme_auto(
    dec: Decisions,
    layouts: list[LayerLayout],
    device_type: str,
    share: HostShare,
    buffer_count: int,
) -> int:
    """``nvme_layers: "auto"``: the fewest trailing layers whose moments (and masters, with
    ``nvme_masters``) go to disk so that the share's host state fits its budget, by
    host_bytes.nvme_split over the bytes ``check_capacity`` counts (each rank's ``HostLayerStore``
    without moments, its ``ResidentParams`` host tensors, the optimizer's scratch) and what the
    share holds beside them."""
    without = _host_bytes(dec, layouts, device_type, share, frozenset(range(len(layouts))))
    per = 12 if dec.nvme_masters else 8
    moment_bytes = [
        per * lay.n_train if any(mask[i] for mask in share.owned) else 0
        for i, lay in enumerate(layouts)
    ]
    return nvme_split(
        without,
        moment_bytes,
        staging_buffers(buffer_count) * len(share.owned),
        share.budget,
        "auto",
        dec.nvme_masters,
    )
