"""The "auto" placements made after the first step, from what that step measured.

This module owns the decisions decisions.py leaves to the first step (``Decisions.auto_device_state`` for
``gpu_optimizer_layers: "auto"``, ``Decisions.auto_keep`` for ``keep_activations: "auto"``): the GPU memory the first
step left free above its peak (``auto_budget_bytes``), less the reserve, goes in a fixed order to the resident
parameters' optimizer state, kept layers and the optimizer state of leading layers (``place_auto``, which the
engine's ``_place_auto`` runs once, after step 1). Off CUDA nothing is measured, so nothing is placed.
"""
from __future__ import annotations

import torch

from .device_state import DeviceOptimizerState
from .log import ALL_RANKS, log


def auto_budget_bytes(device: torch.device, reserve: float) -> int | None:
    """GPU bytes free for optimizer state after the first step: what the driver reports free now (other
    processes and non-PyTorch memory accounted for), less the step's transient peak above what the caching
    allocator holds now, less the ``reserve`` fraction of the GPU. None off CUDA (nothing to place)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    transient = torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device)
    return int(free - max(transient, 0) - total * reserve)


def place_auto(engine) -> None:
    """The "auto" placements, once the first step has shown the working set (its measured peak): GPU memory
    the step left free goes, in this order, to (1) the resident parameters' optimizer state (embeddings,
    head: their update otherwise sits between the backward and the next forward), (2) kept layers (no
    recompute: a quarter of the FLOPs of each), (3) the optimizer state of leading layers. Later batches
    are assumed no larger than the first (a longer one may run out of memory: the error then names the
    keys). The reserve (``gpu_memory_reserve``) stays free. The budget is ``engine._auto_budget_bytes()``."""
    auto_state, auto_keep = engine._auto_device_state, engine._auto_keep
    engine._auto_device_state = engine._auto_keep = False
    budget = engine._auto_budget_bytes()
    if budget is None:
        return
    budget = engine.dp.min_int(budget)  # every rank keeps the same layers (the collectives' order: dp.py)
    start, placed = budget, []
    if auto_state and engine.optimizer is not None and not engine.resident.on_device:
        need = engine.resident.device_bytes()
        if 0 < need <= budget:
            engine.synchronize()
            engine.resident.move_state_to_device()
            budget -= need
            placed.append(f"resident optimizer state {need / 2**30:.1f} GiB")
    if auto_keep:
        budget -= _keep_layers(engine, budget, placed)
    # layers' state: fp32 masters only (a GPU-held layer keeps an fp32 master; bf16-master mode has none)
    if auto_state and engine.optimizer is not None and engine.layer_states.gpu_layers() is None and \
            engine.store.master_dtype == torch.float32:
        store = engine.store
        n_layers = min(len(store.layouts), store.disk_from)  # not the NVMe tier's (they trail)
        n = 0
        while n < n_layers and DeviceOptimizerState.nbytes(store, n + 1) <= budget:
            n += 1
        if n > 0:
            engine.move_layer_state_to_device(n)
        placed.append(f"{n} of {n_layers} layers' optimizer state on the GPU "
                      f"({DeviceOptimizerState.nbytes(store, n) / 2**30:.1f} GiB)")
    engine._auto_placed = "; ".join(p for p in placed if not p.startswith("0 of"))
    log(f"placed from the first step's peak ({max(start, 0) / 2**30:.1f} GiB free above it "
        f"and the reserve): {'; '.join(placed) or 'nothing'}", ranks=ALL_RANKS)


def _keep_layers(engine, budget: int, placed: list[str]) -> int:
    """Keep as many trailing layers (no recompute) as ``budget`` holds, each its largest graph + 10% and its own
    weight buffer; every rank the same number. Returns the bytes they take."""
    ex, layouts = engine.executor, engine.store.layouts
    weights = max(l.numel for l in layouts) * ex.slots[0].buf.element_size()  # noqa: E741
    per_layer = int(ex.graph_bytes * 1.1) + weights  # 10% above the largest graph a recompute built
    n = min(len(layouts), max(0, budget) // per_layer) if ex.graph_bytes else 0
    n = engine.dp.min_int(n)
    ex.set_keep(n)
    placed.append(f"{n} of {len(layouts)} layers kept without recompute ({n * per_layer / 2**30:.1f} GiB)")
    return n * per_layer
