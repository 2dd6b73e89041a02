"""Decisions made before the first step: the config parse (``config``, ``config_values``) into
values (``settings``), the one resolver (``decisions``), the byte models of host, disk and GPU
(``host_bytes``, ``plan_gpu``), the capacity check (``capacity``), ``megatrain-ds plan`` (``plan``,
``plan_cli``) and the named shapes (``shapes``). Reads the packages below for their constants and
byte counts; builds nothing.
"""

import importlib

from .capacity import Prediction, check_capacity
from .capacity_count import kept_layer_bytes
from .config import (
    collective_timeout_of,
    load_config_source,
    parse_config,
    precision_blocks,
    warn_not_acted_on,
)
from .config_values import MONITOR_BLOCKS, monitor_config
from .decisions import Decisions, HostShare, resolve
from .host_bytes import host_budget_bytes
from .prediction import fmt_bytes
from .settings import OptimizerSettings, TrainConfig

# imported on first use: ``python -m megatrain_ds.planning.plan_cli`` runs plan_cli as __main__,
# which an eager import here would have imported already (runpy's RuntimeWarning, and two copies of
# the module)
_LAZY = {"add_plan_arguments": ("plan_cli", "add_arguments"), "run_plan": ("plan_cli", "run")}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "Prediction",
    "check_capacity",
    "kept_layer_bytes",
    "OptimizerSettings",
    "TrainConfig",
    "collective_timeout_of",
    "load_config_source",
    "parse_config",
    "precision_blocks",
    "warn_not_acted_on",
    "MONITOR_BLOCKS",
    "monitor_config",
    "Decisions",
    "HostShare",
    "resolve",
    "host_budget_bytes",
    "fmt_bytes",
    *_LAZY,
]
