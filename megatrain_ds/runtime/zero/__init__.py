"""``deepspeed.runtime.zero`` by attribute: megatrain_ds's ``Init`` and ``GatheredParameters``
(api/zero.py) and ``partition_parameters``; DeepSpeed's own ``config`` and ``offload_config``
(pydantic models and enums)."""

from __future__ import annotations

import importlib

from . import partition_parameters
from ...api import GatheredParameters, Init

_REAL = ("config", "offload_config")


def __getattr__(name: str):
    if name in _REAL:
        return importlib.import_module(f"deepspeed.runtime.zero.{name}")
    # deepspeed.runtime.zero.ZeroParamStatus: DeepSpeed's enum (see zero.py)
    if name == "ZeroParamStatus":
        return partition_parameters.ZeroParamStatus
    raise AttributeError(
        f"deepspeed.runtime.zero.{name} (megatrain_ds imported as deepspeed) is not provided: "
        "megatrain_ds offers Init, GatheredParameters, partition_parameters.ZeroParamStatus, "
        "config and offload_config here"
    )


__all__ = ["GatheredParameters", "Init", "partition_parameters", *_REAL]
