"""``deepspeed.zero`` for a host-resident engine: ``Init``, ``GatheredParameters``,
``ZeroParamStatus``.

After ``initialize`` a streamed layer's parameter owns no storage (like a ZeRO-3 partitioned
parameter: ``ds_shape``, ``ds_numel``, ``ds_id``, ``ds_status``, ``ds_tensor``); its weights live in
the engine's fp32 host master. ``GatheredParameters`` materialises them into ``param.data`` (fp32,
on the host: never the whole model on the GPU) for reading or modifying; with a ``modifier_rank``
the values are written back on exit (master, wire copy, any GPU-held master) and the slots holding
the old values are invalidated. Resident parameters (embeddings, norms, head) are gathered the same
way from their fp32 masters, onto the engine's device (HF's ``model.device`` is the embedding's:
``generate`` moves its inputs there). A forward inside the block computes on the engine's weights,
not on the gathered copies (a generate under a whole-model gather: [Note: generation under ZeRO-3]
in zero_offload.py). Every such parameter also carries ``_z3_optimizer`` (``ZeroOptimizerView``), so
that DeepSpeed's own ``deepspeed.utils.safe_get_full_fp32_param`` and its siblings read and write
the engine's state for it.

``Init`` builds the model on the CPU: the engine moves the layers into host buffers at
``initialize``, so the model is never materialised on the GPU.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import math
import warnings

import torch

from ..host import ParamHome  # noqa: F401 (a parameter's home: LayerParamHome | ResidentParamHome)
from .zero_offload import DeviceCopies

_ids = itertools.count()


class _OwnZeroParamStatus(enum.Enum):
    """DeepSpeed's member names and values; used only where deepspeed itself cannot be imported."""

    AVAILABLE = 1  # param.data holds the full tensor
    NOT_AVAILABLE = 2  # param.data is empty; the weights are in the engine's host master
    INFLIGHT = 3  # kept for compatibility; megatrain_ds never leaves a parameter half-gathered


@functools.cache
def _status_enum() -> type[enum.Enum]:
    """DeepSpeed's own ``ZeroParamStatus`` enum. Client code compares ``p.ds_status`` with the class
    it imports from ``deepspeed.runtime.zero.partition_parameters`` -- a ``from deepspeed...
    import`` line reaches real DeepSpeed even in a script that says ``import megatrain_ds as
    deepspeed`` -- and members of two different enum classes never compare equal (DeepSpeed-Chat's
    and OpenRLHF's ``_z3_params_to_fetch`` would then gather nothing). Resolved on first use, not at
    import: importing deepspeed costs a second or two, and under the switch (compat/) importing
    deepspeed re-enters megatrain_ds."""
    try:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    except ImportError:
        return _OwnZeroParamStatus
    return ZeroParamStatus


def __getattr__(name: str):
    """``megatrain_ds.api.zero.ZeroParamStatus`` is DeepSpeed's enum (see ``_status_enum``), looked
    up lazily."""
    if name == "ZeroParamStatus":
        return _status_enum()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _state_of(param):
    """The model state answering deepspeed.utils' calls for ``param`` (host/model_state.py)."""
    home = getattr(param, "megatrain_home", None)
    if home is None:
        raise ValueError(
            "this parameter is no longer trained by a megatrain_ds engine (engine.destroy() was "
            "called): its fp32 master, gradient and optimizer state are gone"
        )
    return home.model_state


class ZeroOptimizerView:
    """``param._z3_optimizer`` of every parameter an engine holds. Real DeepSpeed's
    ``deepspeed.utils`` functions (``safe_get_full_fp32_param``, ``safe_set_full_fp32_param``,
    ``safe_get_full_grad``, ``safe_get/set_full_optimizer_state``) see ``ds_id`` on a parameter and
    call these methods of its "ZeRO-3 optimizer"; here the model state holding the parameter answers
    (``ModelState.full_fp32_param``...). A script's ``from deepspeed.utils import
    safe_get_full_fp32_param`` (real DeepSpeed even with the alias import) and the switch (compat/)
    then get the right values, not an AttributeError. The rest of a ZeRO-3 optimizer (local
    partitions, writing gradients) raises AttributeError naming the method."""

    def get_full_hp_param(self, param, optim_state_key=None):
        state = _state_of(param)
        if optim_state_key is None:
            return state.full_fp32_param(param)
        return state.full_optimizer_state(param, optim_state_key)

    def set_full_hp_param(self, value, param, optim_state_key=None) -> None:
        state = _state_of(param)
        if optim_state_key is None:
            state.set_full_fp32_param(param, value)
        else:
            state.set_full_optimizer_state(param, value, optim_state_key)

    def get_fp32_grad_for_param(self, param):
        return _state_of(param).full_grad(param)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"param._z3_optimizer.{name}: megatrain_ds answers deepspeed.utils' "
            "safe_get_full_fp32_param, "
            "safe_set_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state and "
            "safe_set_full_optimizer_state; the local-partition and gradient-writing functions are "
            "not provided"
        )


Z3_VIEW = ZeroOptimizerView()


def mark_partitioned(param: torch.nn.Parameter, home) -> None:
    """DeepSpeed's ZeRO-3 attributes on ``param``, and its home (host/model_state.py:
    ``ModelState.mark_params`` calls this for every parameter the engine holds)."""
    param.ds_shape = tuple(home.shape)
    param.ds_numel = int(torch.Size(home.shape).numel())
    param.ds_id = next(_ids)
    status = _status_enum()
    param.ds_status = status.AVAILABLE if home.materialized else status.NOT_AVAILABLE
    # empty outside a forward: [Note: generation under ZeRO-3] (zero_offload.py)
    param.ds_active_sub_modules = set()
    param.megatrain_home = home
    # see ZeroOptimizerView: DeepSpeed's safe_get_full_* reach the engine
    param._z3_optimizer = Z3_VIEW


class Init:
    """``with deepspeed.zero.Init(...): model = ...``: build on the CPU (never on the GPU), in
    DeepSpeed's dtype.

    - ``dtype``: floating-point parameters (and tensors made without a dtype) are made in it, as
      DeepSpeed casts every floating tensor made in the context; the engine's fp32 masters then
      start from these values, as DeepSpeed's do.
    - ``config_dict_or_path`` (or the deprecated ``config``) without ``dtype``: the config's
      precision, as DeepSpeed: bf16 / fp16 when enabled, else fp32; its
      ``zero_optimization.offload_param.device`` is the ``remote_device`` when none is given.
    - neither: the model's own dtype. (DeepSpeed would pick fp16, or bf16 where its accelerator
      lacks fp16; the masters made from an fp32 build are only more exact.)
    - ``remote_device="nvme"``: a warning (parameters are built in host memory; the NVMe tier holds
      Adam moments, set by ``offload_optimizer.device``: nvme.py).
    - one process only, and it leaves ``torch.distributed`` initialized (as DeepSpeed's ``Init``).
    Other arguments (process groups, ``pin_memory``, ``mem_efficient_linear``) concern partitioning:
    none here.
    """

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled=True,
        dtype=None,
        mpu=None,
        **kwargs,
    ) -> None:
        self.enabled = enabled and module is None
        if config is not None and config_dict_or_path is None:
            config_dict_or_path = config
        cfg = None
        if config_dict_or_path is not None:
            from ..planning import load_config_source

            cfg = load_config_source(config_dict_or_path)
        if dtype is None and cfg is not None:
            dtype = _config_dtype(cfg)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"zero.Init(dtype={dtype!r}): a floating-point torch.dtype is needed")
        if remote_device is None and cfg is not None:
            remote_device = ((cfg.get("zero_optimization") or {}).get("offload_param") or {}).get(
                "device"
            )
        if remote_device == "nvme":
            warnings.warn(
                "zero.Init(remote_device='nvme'): megatrain_ds builds the parameters in host "
                "memory "
                "(its NVMe tier holds the Adam moments: "
                "zero_optimization.offload_optimizer.device=nvme)",
                stacklevel=2,
            )
        self.dtype = dtype
        self._device_ctx = torch.device("cpu")
        self._saved_dtype = None

    def __enter__(self):
        if self.enabled:
            from ..parallel import ensure_deepspeed_comm

            ensure_deepspeed_comm()
            self._device_ctx.__enter__()
            if self.dtype is not None:
                # Floating tensors made without a dtype get this one; parameters get it even when
                # the model's constructor sets its own default dtype (transformers does), as
                # DeepSpeed's creation wrappers.
                self._saved_dtype, self._saved_new = (
                    torch.get_default_dtype(),
                    torch.nn.Parameter.__dict__["__new__"],
                )
                torch.set_default_dtype(self.dtype)
                torch.nn.Parameter.__new__ = _parameter_new_in(
                    self.dtype, torch.nn.Parameter.__new__
                )
        return self

    def __exit__(self, *exc):
        if self.enabled:
            if self._saved_dtype is not None:
                torch.set_default_dtype(self._saved_dtype)
                torch.nn.Parameter.__new__ = self._saved_new
                self._saved_dtype = None
            self._device_ctx.__exit__(*exc)
        return False


def _parameter_new_in(dtype: torch.dtype, original_new):
    def new(cls, data=None, requires_grad=True):
        if data is not None and data.is_floating_point() and data.dtype != dtype:
            data = data.to(dtype)
        return original_new(cls, data, requires_grad)

    return new


def _config_dtype(cfg: dict) -> torch.dtype:
    """DeepSpeed's ``Init._set_dtype`` from a config: bf16, else fp16, else fp32 (values as its
    models read them: ``"true"`` is true)."""
    from ..errors import ConfigError
    from ..planning import precision_blocks

    # An "auto" not resolved yet (transformers builds the model before accelerate / the Trainer fill
    # the rest): read as DeepSpeed's models read it, the default; initialize() still refuses a
    # config that keeps it.
    cfg = {
        k: (
            {kk: vv for kk, vv in v.items() if vv != "auto"}
            if k in ("fp16", "bf16", "bfloat16") and isinstance(v, dict)
            else v
        )
        for k, v in cfg.items()
    }
    fp16, bf16 = precision_blocks(cfg)
    if fp16["enabled"] and bf16["enabled"]:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one")
    return (
        torch.bfloat16 if bf16["enabled"] else torch.float16 if fp16["enabled"] else torch.float32
    )


class GatheredParameters:
    """Materialise engine-held parameters for the duration of the ``with`` block."""

    def __init__(
        self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if hasattr(p, "megatrain_home")] if enabled else []
        self.modifier_rank = modifier_rank
        self._saved = []
        self._bindings: list[DeviceCopies] = []

    def __enter__(self):
        states = {
            id(p.megatrain_home.model_state): p.megatrain_home.model_state for p in self.params
        }
        # data parallel: where this rank is, should a peer not arrive (dp.py)
        for state in states.values():
            state.mark("gather")
        # the device copies a forward in the block computes on hold the last step
        for state in states.values():
            if any(
                p.megatrain_home.materialized and p.megatrain_home.model_state is state
                for p in self.params
            ):
                # (before p.data is swapped: it writes into the device copies)
                state.refresh_device_copies()
        # id(param) -> its gathered value, where the state made them on its device at once
        ready = {}
        for state in states.values():
            mine = [p for p in self.params if p.megatrain_home.model_state is state]
            values = _gather_on_device(state, mine)
            if values is not None:
                ready.update(zip(map(id, mine), values))
            else:  # one wait, and each GPU-held layer's master to the host once
                state.settle_reads([p.megatrain_home for p in mine])
        for p in self.params:
            self._saved.append((p, p.data, p.ds_status))
            value = ready.get(id(p))
            if value is None:
                with _watch(p, "gathering"):
                    value = p.megatrain_home.read_master(settled=True)
            p.data = value
            p.ds_status = _status_enum().AVAILABLE
        # a forward in the block runs on the device copies, not on the host copies
        for state in states.values():
            resident = [
                p
                for p in self.params
                if p.megatrain_home.model_state is state and p.megatrain_home.materialized
            ]
            if resident:
                self._bindings.append(DeviceCopies(state.module, resident))
        return self

    def __exit__(self, *exc):
        for binding in self._bindings:
            binding.close()
        self._bindings = []
        for p, old, status in reversed(self._saved):
            if self.modifier_rank is not None and exc[0] is None:
                with _watch(p, "writing back"):
                    p.megatrain_home.write_master(p.data)
            p.data = old
            p.ds_status = status
        self._saved.clear()
        return False


def _gather_on_device(state, params: list) -> list[torch.Tensor] | None:
    """The values a ``GatheredParameters`` block hands out for ``params`` (fp32 copies of their
    masters), made on the model state's device as DeepSpeed gathers: a GPU-held layer's from its
    device master (no device→host copy), the others from their host masters, a resident one from
    wherever its master is. One process only, and on CUDA only when the copies and the inference
    cache (inference.py: what a generate in the block uploads) take at most half the free device
    memory: a model larger than the GPU, the engine's case, is gathered in host memory, and the
    gather never pushes a rollout off the cache into streaming every token. None: the caller reads
    them on the host (``ModelState.settle_reads``, then each home's ``read_master``). (A 1.5B
    model's whole-model gather before each GRPO rollout took 1.1 s on the host path, on an H200.)"""
    if state.parallel is not None or not params:
        return None
    device = state.device
    # the copies, and the inference cache a generate in the block will want
    if device.type == "cuda":
        need = (
            sum(4 * math.prod(getattr(p, "ds_shape", p.shape)) for p in params)
            + state.pending_device_bytes()
        )  # (an allocated cache is already not free)
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if need > 0.5 * free:
            return None
    state.synchronize()  # no update is writing the masters
    return [p.megatrain_home.device_copy(device) for p in params]


def _watch(param, doing: str):
    """Data parallel: gathering or writing back a parameter is a collective over the engine's gloo
    group, bounded by ``megatrain.collective_timeout``; its failure names the parameter and the
    ranks that did not arrive (dp.py's ``CollectiveError``)."""
    home = param.megatrain_home
    dp = home.model_state.parallel
    if dp is None:
        return contextlib.nullcontext()
    return dp.watch(f"GatheredParameters {doing} {home.describe()}")
