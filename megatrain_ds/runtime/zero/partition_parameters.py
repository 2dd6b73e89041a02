"""``deepspeed.runtime.zero.partition_parameters`` by attribute (DeepSpeed-Chat's ``lora.py``
compares ``p.ds_status ==
deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE``).

``ZeroParamStatus`` is DeepSpeed's own enum (megatrain_ds/api/zero.py, ``_status_enum``), so the
comparison holds whichever way the script reached it."""

from __future__ import annotations

from ...api import GatheredParameters, Init


def __getattr__(name: str):
    if name == "ZeroParamStatus":
        from ...api import zero

        return zero.ZeroParamStatus
    raise AttributeError(
        f"deepspeed.runtime.zero.partition_parameters.{name} (megatrain_ds imported as deepspeed) "
        "is not provided: ZeroParamStatus, Init and GatheredParameters are"
    )


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]  # noqa: F822 (module __getattr__)
