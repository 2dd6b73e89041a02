"""The "auto" placements made after the second step, from what the first two steps measured.

This module owns the decisions decisions.py leaves to the first steps
(``Decisions.auto_device_state`` for ``gpu_optimizer_layers: "auto"``, ``Decisions.auto_keep`` for
``keep_activations: "auto"``): the GPU memory the steps left free above their peak
(``auto_budget_bytes``), less the reserve, goes to the resident parameters' optimizer state, then to
kept layers and the optimizer state of leading layers, in the order the measured exposure of the
host update says ([Note: auto placement order]; ``AutoPlacer.after_step``, which the engine calls
after each of the first two steps). Off CUDA nothing is measured, so nothing is placed.

[Note: auto placement order] A kept layer (no recompute) saves its recompute, at most a quarter of
its compute, and takes its largest activation graph (about 2 GB per 3B layer at 16K tokens/step). A
layer whose optimizer state is on the GPU takes 16 bytes per parameter (1.2 GB per 3B layer) and
leaves the host update. The second step's forward is the first that waits for a host update, so the
placement is made after it: ``exposure`` is the time that forward waited for the host AdamW,
``update`` a layer's host update time at the rate the AdamW thread measured meanwhile. When the host
update was exposed (the forward waited at least half a layer's update), the step is bound by the
host: the GPU sat waiting, so a shorter GPU schedule (a kept layer) would only wait longer, while
each layer whose state moves takes its update off the critical path. Optimizer state then goes
first, for as many layers as the exposure pays for with a margin (``ceil(EXPOSURE_MARGIN * exposure
/ update)``), kept layers take what is left, and what they leave goes to further layers' state (the
host is the bound: a layer's update off it is worth more than idle memory). Otherwise (the host
update is hidden: long sequences) kept layers go first. The second step's wall time measures neither
a layer's recompute nor the step: that step still carries warm-up work, so neither rule reads it.

The margin: the second step's host rate is not the settled one. In the one-lease depth runs
(benchmarks/results/2026-11-29_h200_depth_one_lease, 1.5B width) the rate the cap was computed from
(as the cap it placed and the printed exposure imply it) was 1.3-1.46x the settled steps' measured
one (84 layers: about 5.3 against 3.64 Gparam/s; 120: 7.8 against 5.9; 180: 7.6 against 5.6), so
``ceil(exposure / update)`` left the settled steps waiting for the host (84 layers: the forward
0.17 s for the update and the landings 0.08 s for the moments pass, of a 1.36 s step).
The costs are not symmetric: a layer of state too few leaves its whole
update (about 13 ms there) on the step, one too many displaces about half a kept layer (2 ms of
recompute, at about 4 ms a layer) where memory is short, and nothing where it is not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..host import DeviceOptimizerState
from ..log import ALL_RANKS, log
from ..planning import fmt_bytes, kept_layer_bytes

if TYPE_CHECKING:
    from ..host import HostLayerStore, LayerStates
    from ..optim import ResidentParams
    from ..parallel import DataParallel
    from ..streaming import StepTimer


# the state-first cap over what the second step's exposure pays for ([Note: auto placement order])
EXPOSURE_MARGIN = 1.5


@dataclass(frozen=True)
class PlacementParts:
    """What the placement reads and moves, handed to it by the engine (``placement_parts()``)
    after each of the first two steps: the engine's parts as they are then, never the engine."""

    timer: StepTimer  # the steps' host spans (``host``); ``enabled``: the breakdown resets them
    device: torch.device
    dp: DataParallel  # every rank places the same (``min_int``)
    has_optimizer: bool  # without one there is no optimizer state to place
    resident: ResidentParams  # its optimizer state goes first (``move_state_to_device``)
    layer_states: LayerStates  # whether layers are GPU-held already (``gpu_layers``)
    store: HostLayerStore  # the layers' layouts, the NVMe tier's first layer, the master dtype
    graph_bytes: int  # the largest layer graph a recompute built (CUDA; 0: not measured)
    weight_itemsize: int  # bytes per element of a layer's weight buffer on the device
    set_keep: Callable[[int], None]  # keep the last n layers' activations (no recompute)
    # hold n layers' weights from forward to backward (None: the count asked last, chosen again);
    # returns them (executor.set_weight_cache)
    set_weight_cache: Callable[[int | None], list[int]]
    move_layer_state_to_device: Callable[[int], None]  # the first n layers' state to the GPU
    synchronize: Callable[[], None]  # waits for every queued host task and device work


def auto_budget_bytes(device: torch.device, reserve: float) -> int | None:
    """GPU bytes free for optimizer state after the first step: what the driver reports free now
    (other processes and non-PyTorch memory accounted for), less the step's transient peak above
    what the caching allocator holds now, less the ``reserve`` fraction of the memory this process
    can use. None off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    transient = torch.cuda.max_memory_reserved(device) - held
    return placement_budget(free, total, held, transient, reserve)


def placement_budget(free: int, total: int, held: int, transient: int, reserve: float) -> int:
    """The "auto" budget from the driver's ``free`` and ``total`` bytes, the bytes this process's
    allocator ``held``, and the step's ``transient`` peak above them. The reserve is a fraction of
    what this process can use (``free + held``, at most ``total``), not of the whole GPU: on a GPU
    that other processes share (or a 24 GiB card's worth left of a large one), a fraction of the
    whole would keep free more than the process ever had."""
    usable = min(total, free + held)
    return int(free - max(transient, 0) - usable * reserve)


class AutoPlacer:
    """The "auto" placements of one engine, as a value the engine holds (``engine.auto_placer``):
    what is still to place (given by the resolver's ``Decisions``), the marks of the first step, and
    what was placed (for the out-of-memory message and the harness). ``after_step`` is called after
    each step while ``pending``; it places after the second."""

    def __init__(
        self, device_state: bool, keep: bool, reserve: float, weight_cache: bool = False
    ) -> None:
        self.device_state = device_state  # gpu_optimizer_layers "auto", not yet placed
        self.keep = keep  # keep_activations "auto", not yet placed
        self.weight_cache = weight_cache  # weight_cache_layers "auto", not yet placed
        self.reserve = reserve  # the fraction of the GPU left free (gpu_memory_reserve)
        # what the placement put on the GPU ("" before it, or when it placed nothing)
        self.placed = ""
        self.marks: tuple[float, dict] | None = None  # (time, host spans) after the first step

    @property
    def pending(self) -> bool:
        return self.device_state or self.keep or self.weight_cache

    def budget_bytes(self, parts: PlacementParts) -> int | None:
        """GPU bytes free for the placements now on the engine's device (``auto_budget_bytes``);
        None off CUDA."""
        return auto_budget_bytes(parts.device, self.reserve)

    def after_step(self, parts: PlacementParts) -> None:
        """After each of the first two steps; places after the second (``_place``). After the first
        it only notes the host spans and the time, so the second step's exposure of the host update
        can be measured."""
        host = dict(parts.timer.host)  # kept with or without wall_clock_breakdown (cumulative then)
        if self.marks is None:  # the first step of this engine (a resumed run's too)
            self.marks = (time.perf_counter(), host)
            return
        t0, before = self.marks
        wall = time.perf_counter() - t0
        if parts.timer.enabled:  # the breakdown resets the spans at each step: the second's whole
            before = {}
        delta = {k: v - before.get(k, 0.0) for k, v in host.items()}
        auto_state, auto_keep, auto_cache = self.device_state, self.keep, self.weight_cache
        self.device_state = self.keep = self.weight_cache = False  # placed once
        budget = self.budget_bytes(parts)
        if budget is not None:
            self.placed = _place(parts, auto_state, auto_keep, budget, wall, delta, auto_cache)

    def oom_hint(self) -> str | None:
        """What to tell a device OOM after the placement used the memory the first steps left free;
        None before."""
        if not self.placed:
            return None
        return (
            f"after the second step, \"auto\" placed {self.placed} in the GPU memory that step "
            "left free; this "
            "batch needs more: set megatrain.keep_activations, megatrain.gpu_optimizer_layers "
            "and/or megatrain.weight_cache_layers to 0 (or a smaller count), or raise "
            "megatrain.gpu_memory_reserve"
        )


def host_update_exposure(wall: float, delta: dict, layer_params: list[int]) -> tuple[float, float]:
    """(exposure s, one layer's host update s) from the second step's host spans ``delta`` ([Note:
    auto placement order]); ``wall`` is unused by the rule and kept for the caller's record."""
    busy = delta.get("optimizer_s", 0.0) + delta.get("speculative_s", 0.0)
    params = delta.get("updated_params", 0.0)
    per_layer = max(layer_params) if layer_params else 0
    update = per_layer * busy / params if params > 0 and busy > 0 else 0.0
    return delta.get("wait_for_optimizer_s", 0.0), update


def _place(
    parts: PlacementParts,
    auto_state: bool,
    auto_keep: bool,
    budget: int,
    wall: float,
    delta: dict,
    auto_cache: bool = False,
) -> str:
    """The "auto" placements, once the first steps have shown the working set (its measured peak)
    and the host update's exposure: GPU memory the steps left free (``budget``) goes to (1) the
    resident parameters' optimizer state (embeddings, head: their update otherwise sits between the
    backward and the next forward), then (2) kept layers (no recompute) and (3) the optimizer state
    of leading layers, or, when the host update was exposed, (3) up to the exposure's cap, (2), and
    (3) again for further layers in what the kept layers left ([Note: auto placement order]). Later
    batches are assumed no larger than the first (a longer one may run out of memory: the error
    then names the keys). The reserve (``gpu_memory_reserve``) stays free. Returns what was
    placed."""
    budget = parts.dp.min_int(budget)  # every rank keeps the same layers (the collectives' order)
    start, placed = budget, []
    if auto_state and parts.has_optimizer and not parts.resident.on_device:
        need = parts.resident.device_bytes()
        if 0 < need <= budget:
            parts.synchronize()
            parts.resident.move_state_to_device()
            budget -= need
            placed.append(f"resident optimizer state {need / 2**30:.1f} GiB")
    store = parts.store
    # layers' state: fp32 masters only (a GPU-held layer keeps an fp32 master; bf16-master mode has
    # none)
    state_ok = (
        auto_state
        and parts.has_optimizer
        and parts.layer_states.gpu_layers() is None
        and store.master_dtype == torch.float32
    )
    n_layers = min(len(store.layouts), store.disk_from)  # not the NVMe tier's (they trail)
    exposure, update = host_update_exposure(wall, delta, [lay.n_train for lay in store.layouts])
    state_first = bool(
        state_ok and auto_keep and n_layers and update > 0 and exposure >= 0.5 * update
    )  # a host-bound step: the GPU waited ([Note: auto placement order])
    state_first = bool(parts.dp.min_int(int(state_first)))  # every rank the same order and cap
    if state_first:
        cap = parts.dp.min_int(min(n_layers, math.ceil(EXPOSURE_MARGIN * exposure / update)))
        placed.append(
            f"the host update held the forward {exposure:.2f} s of a {wall:.2f} s step: optimizer "
            f"state first (cap {cap} layers)"
        )
        first = _state_count(store, budget, cap)
        n_keep, per_keep = _keep_count(parts, budget - _state_bytes(store, first))
        # what the kept layers leave goes to further layers' state: the host is the bound
        n_state = parts.dp.min_int(_state_count(store, budget - n_keep * per_keep, n_layers))
        budget -= _move_state(parts, n_state, placed)
        budget -= _set_keep(parts, n_keep, per_keep, placed)
    else:
        n_keep, per_keep = _keep_count(parts, budget) if auto_keep else (0, 0)
        if auto_keep:
            budget -= _set_keep(parts, n_keep, per_keep, placed)
        n_state = _state_count(store, budget, n_layers) if state_ok else 0
        if state_ok:
            budget -= _move_state(parts, n_state, placed)
    if auto_cache:  # last: the smallest unit, what the others left ([Note: weight cache])
        budget -= _set_weight_cache(parts, budget, placed)
    elif auto_state:  # an explicit count, chosen at initialize: not the layers now GPU-held
        parts.set_weight_cache(None)
    placed += _unplaced(
        store,
        budget,
        n_state if state_ok else None,
        n_layers,
        n_keep if auto_keep else None,
        per_keep,
    )
    log(
        f"placed from the first steps' peak ({max(start, 0) / 2**30:.1f} GiB free above it "
        f"and the reserve{_allocator_gap(parts.device)}): {'; '.join(placed) or 'nothing'}",
        ranks=ALL_RANKS,
    )
    done = "; ".join(p for p in placed if not p.startswith("0 of"))
    return (
        f"{done} (of {max(start, 0) / 2**30:.1f} GiB free above the peak and the reserve)"
        if done
        else ""
    )


def _unplaced(
    store: HostLayerStore,
    left: int,
    n_state: int | None,
    n_layers: int,
    n_keep: int | None,
    per_keep: int,
) -> list[str]:
    """For the placement's line: the memory it left free (above the reserve) and why, the next unit
    of each placement being larger: one more layer's optimizer state, one more kept layer (None:
    that placement was not "auto"). [] when nothing is left or nothing more could be placed. (7B
    on 24 GiB: a layer's state is 3.45 GiB, a kept layer at 8K tokens 1.7 GiB, 14% and 7% of the
    card; 2026-11-30.)"""
    units = []
    if n_state is not None and n_state < n_layers:
        nxt = _state_bytes(store, n_state + 1) - _state_bytes(store, n_state)
        units.append(f"one more layer's optimizer state takes {fmt_bytes(nxt)}")
    if n_keep is not None and per_keep and n_keep < len(store.layouts):
        units.append(f"one more kept layer {fmt_bytes(per_keep)}")
    if left <= 0 or not units:
        return []
    return [f"{fmt_bytes(left)} left unplaced ({', '.join(units)})"]


def _allocator_gap(device: torch.device) -> str:
    """For the placement's log line: how far the caching allocator's reserved peak ran over its
    allocated peak (memory the placement budgets around: split and cached blocks), when that is
    at least 1 GiB; "" otherwise or off CUDA. (2026-11-30, 7B on 24 GiB, at the run's end: 5 GiB,
    all in the compute stream's pool.)"""
    if device.type != "cuda":
        return ""
    gap = torch.cuda.max_memory_reserved(device) - torch.cuda.max_memory_allocated(device)
    if gap < 2**30:
        return ""
    return (
        f"; the caching allocator's reserved peak was {gap / 2**30:.1f} GiB over its allocated "
        "peak (PYTORCH_CUDA_ALLOC_CONF sets how it splits and caches blocks)"
    )


def _state_bytes(store: HostLayerStore, n: int) -> int:
    """GPU bytes of the leading ``n`` layers' optimizer state (0 for none)."""
    return DeviceOptimizerState.nbytes(store, n) if n else 0


def _state_count(store: HostLayerStore, budget: int, limit: int) -> int:
    """How many leading layers' optimizer state (up to ``limit``) ``budget`` holds."""
    n = 0
    while n < limit and DeviceOptimizerState.nbytes(store, n + 1) <= budget:
        n += 1
    return n


def _move_state(parts: PlacementParts, n: int, placed: list[str]) -> int:
    """Move the optimizer state of the leading ``n`` layers to the GPU; returns the bytes."""
    store = parts.store
    if n > 0:
        parts.move_layer_state_to_device(n)
    placed.append(
        f"{n} of {min(len(store.layouts), store.disk_from)} layers' optimizer state on the GPU "
        f"({_state_bytes(store, n) / 2**30:.1f} GiB)"
    )
    return _state_bytes(store, n)


def _keep_bytes_per_layer(parts: PlacementParts) -> int:
    """What keeping one more layer would take: its largest graph + 10% and its own weight buffer (0
    when the recompute's graph was not measured)."""
    if not parts.graph_bytes:
        return 0
    numel = max(lay.numel for lay in parts.store.layouts)
    return kept_layer_bytes(parts.graph_bytes, numel, parts.weight_itemsize)


def _keep_count(parts: PlacementParts, budget: int) -> tuple[int, int]:
    """(how many trailing layers to keep without recompute in ``budget``, the bytes each takes: its
    largest graph + 10% and its own weight buffer); every rank the same number."""
    per_layer = _keep_bytes_per_layer(parts)
    n_layers = len(parts.store.layouts)
    n = min(n_layers, max(0, budget) // per_layer) if per_layer else 0
    return parts.dp.min_int(n), per_layer


def _set_weight_cache(parts: PlacementParts, budget: int, placed: list[str]) -> int:
    """Hold as many layers' weights from forward to backward as ``budget`` takes, each its own
    buffer in the compute dtype (executor.py's [Note: weight cache]); every rank the same number.
    Returns the bytes they take."""
    per_layer = max(lay.numel for lay in parts.store.layouts) * parts.weight_itemsize
    n = parts.dp.min_int(max(0, budget) // per_layer if per_layer else 0)
    chosen = parts.set_weight_cache(n)
    took = sum(parts.store.layouts[i].numel for i in chosen) * parts.weight_itemsize
    placed.append(
        f"{len(chosen)} layers' weights held from forward to backward ({took / 2**30:.1f} GiB)"
        if chosen
        else f"0 of the layers' weights held from forward to backward (one takes "
        f"{per_layer / 2**30:.2f} GiB)"
    )
    return took


def _set_keep(parts: PlacementParts, n: int, per_layer: int, placed: list[str]) -> int:
    """Keep the trailing ``n`` layers (no recompute); returns the bytes they take."""
    parts.set_keep(n)
    placed.append(
        f"{n} of {len(parts.store.layouts)} layers kept without recompute "
        f"({n * per_layer / 2**30:.1f} GiB)"
    )
    return n * per_layer
