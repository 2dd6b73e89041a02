"""The DeepSpeed surface beyond ``initialize``: ``deepspeed.zero`` (``zero``, ``zero_offload``),
``deepspeed.utils``, ``deepspeed.checkpointing``, the monitors, the throughput timer and the engine
attributes scripts touch (``surface``). ``megatrain_ds.zero`` and the other ``deepspeed.<name>``
mirrors stay reachable at the top (``megatrain_ds/__init__.py``).
"""

from . import checkpointing, utils, zero
from .monitor import Monitor
from .surface import EngineSurface, adopt_zero3_model, module_getattr
from .zero import Z3_VIEW, GatheredParameters, Init, mark_partitioned
from .zero_offload import ParameterOffload

# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "checkpointing",
    "utils",
    "zero",
    "Monitor",
    "EngineSurface",
    "adopt_zero3_model",
    "module_getattr",
    "Z3_VIEW",
    "GatheredParameters",
    "Init",
    "mark_partitioned",
    "ParameterOffload",
]
