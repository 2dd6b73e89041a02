"""The engine's parts (``megatrain_ds/engine.py`` holds the engine itself): ``construction`` is the
one construction path (``build_engine``), ``engine_build`` the builders it calls in order,
``engine_forward`` the batch's way in and the exact fused loss, ``engine_auto`` the placements made
after the second step, ``lifecycle`` the guards around a run.
"""

from .construction import EngineHooks, EngineParts, build_engine
from .engine_auto import AutoPlacer, PlacementParts
from .engine_build import (
    apply_liger_kernels,
    buffers_to_device,
    build_executor,
    build_optimizer,
    build_store,
    build_workers,
    check_capacity_for,
    count,
    decide,
    host_share,
    host_view,
    log_tier,
    param_groups,
    place_initial,
    step_counters,
    sync_initial_weights,
)
from .engine_forward import LogitsNotComputed, forward_fused_loss, fused_loss_call, to_device
from .lifecycle import (
    close_tiers_at_exit,
    deferred_interrupt,
    refuse_a_model_in_use,
    refuse_empty_sequences,
)

# the names the engine (megatrain_ds/engine.py) uses: test_structure.py's face rule
__all__ = [
    "EngineHooks",
    "EngineParts",
    "build_engine",
    "AutoPlacer",
    "PlacementParts",
    "apply_liger_kernels",
    "buffers_to_device",
    "build_executor",
    "build_optimizer",
    "build_store",
    "build_workers",
    "check_capacity_for",
    "count",
    "decide",
    "host_share",
    "host_view",
    "log_tier",
    "param_groups",
    "place_initial",
    "step_counters",
    "sync_initial_weights",
    "LogitsNotComputed",
    "forward_fused_loss",
    "fused_loss_call",
    "to_device",
    "close_tiers_at_exit",
    "deferred_interrupt",
    "refuse_a_model_in_use",
    "refuse_empty_sequences",
]
