"""Where the persistent state lives on the host: ``host_state`` (one flat buffer per kind, one view
per layer), ``host_memory`` (the mappings and pinning), ``grad_hold``, ``nvme`` (the NVMe tier),
``device_state`` (optimizer state held on the GPU), ``layer_state`` (``LayerStates``: the one owner
of where layer i's state lives) and ``placement`` (the host threads' cores). The streaming core
reads and writes this state; it never imports upward.
"""

import importlib

from .device_state import DeviceOptimizerState
from .disk_space import DiskSpaceError, available_bytes, byte_count, reserve_file
from .host_limits import (
    CGROUP_ROOT,
    PROC_CGROUP,
    CgroupMemory,
    cgroup_memory,
    fmt_bytes,
    meminfo,
    memlock_limit,
    pinning_limits,
)
from .host_memory import host_buffer, release_all
from .host_state import HostLayerStore
from .layer_state import GradHome, LayerStates
from .nvme import NvmeSettings, check_path
from .placement import apply_placement, parse_setting
from .placement import resolve as resolve_placement

# imported on first use: the model's state and the resident parameters' state
_LAZY = {
    "ModelState": ("model_state", "ModelState"),
    "ParamHome": ("model_state", "ParamHome"),
    "LayerParamHome": ("model_state", "LayerParamHome"),
    "ResidentParamHome": ("model_state", "ResidentParamHome"),
    "ResidentState": ("resident_state", "ResidentState"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "DeviceOptimizerState",
    "DiskSpaceError",
    "available_bytes",
    "byte_count",
    "reserve_file",
    "CGROUP_ROOT",
    "PROC_CGROUP",
    "CgroupMemory",
    "cgroup_memory",
    "fmt_bytes",
    "meminfo",
    "memlock_limit",
    "pinning_limits",
    "host_buffer",
    "release_all",
    "HostLayerStore",
    "GradHome",
    "LayerStates",
    "NvmeSettings",
    "check_path",
    "apply_placement",
    "parse_setting",
    "resolve_placement",
    *_LAZY,
]
