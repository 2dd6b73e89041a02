"""``deepspeed.zero`` for a host-resident engine: ``Init``, ``GatheredParameters``, ``ZeroParamStatus``.

After ``initialize`` a streamed layer's parameter owns no storage (like a ZeRO-3 partitioned parameter:
``ds_shape``, ``ds_numel``, ``ds_id``, ``ds_status``, ``ds_tensor``); its weights live in the engine's fp32
host master. ``GatheredParameters`` materialises them into ``param.data`` (fp32, on the host) for reading
or modifying; with a ``modifier_rank`` the values are written back on exit (master, wire copy, any
GPU-held master) and the slots holding the old values are invalidated. Resident parameters (embeddings,
norms, head) are gathered the same way from their fp32 masters.

``Init`` builds the model on the CPU: the engine moves the layers into host buffers at ``initialize``, so
the model is never materialised on the GPU.
"""
from __future__ import annotations

import enum
import itertools

import torch

_ids = itertools.count()


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # param.data holds the full tensor
    NOT_AVAILABLE = 2  # param.data is empty; the weights are in the engine's host master
    INFLIGHT = 3  # kept for compatibility; megatrain_ds never leaves a parameter half-gathered


class ParamHome:
    """Where a parameter's fp32 master lives: a streamed layer's slot in the host store, or a resident
    parameter's own master."""

    def __init__(self, engine, layer: int | None, name: str | None, resident_index: int | None) -> None:
        self.engine, self.layer, self.name, self.resident_index = engine, layer, name, resident_index

    def read(self) -> torch.Tensor:
        return self.engine._read_master(self)

    def write(self, value: torch.Tensor) -> None:
        self.engine._write_master(self, value)


def mark_partitioned(param: torch.nn.Parameter, home: ParamHome, shape: tuple[int, ...]) -> None:
    param.ds_shape = tuple(shape)
    param.ds_numel = int(torch.Size(shape).numel())
    param.ds_id = next(_ids)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE if home.layer is not None else ZeroParamStatus.AVAILABLE
    param._megatrain_home = home


class Init:
    """``with deepspeed.zero.Init(): model = ...``: build on the CPU (never on the GPU)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs) -> None:
        self.enabled, self.dtype = enabled and module is None, dtype
        self._device_ctx = torch.device("cpu")

    def __enter__(self):
        if self.enabled:
            self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._device_ctx.__exit__(*exc)
        return False


class GatheredParameters:
    """Materialise engine-held parameters for the duration of the ``with`` block."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if hasattr(p, "_megatrain_home")] if enabled else []
        self.modifier_rank = modifier_rank
        self._saved = []

    def __enter__(self):
        for p in self.params:
            self._saved.append((p, p.data, p.ds_status))
            p.data = p._megatrain_home.read()
            p.ds_status = ZeroParamStatus.AVAILABLE
        return self

    def __exit__(self, *exc):
        for p, old, status in reversed(self._saved):
            if self.modifier_rank is not None and exc[0] is None:
                p._megatrain_home.write(p.data)
            p.data = old
            p.ds_status = status
        self._saved.clear()
        return False
