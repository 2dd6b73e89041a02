"""``deepspeed.utils`` for scripts that say ``import megatrain_ds as deepspeed``.

The full-state accessors of one parameter -- ``safe_get_full_fp32_param``,
``safe_set_full_fp32_param``, ``safe_get_full_grad``, ``safe_get_full_optimizer_state``,
``safe_set_full_optimizer_state`` -- answer from the model state holding the parameter
(``ModelState.full_fp32_param`` ... in host/model_state.py): its fp32 master, its gradient (fp32,
before clipping; call it between ``backward()`` and ``step()``), its Adam moments (``"exp_avg"``,
``"exp_avg_sq"``). Values are copies on the engine's device, as DeepSpeed returns them. A parameter
no megatrain_ds engine holds goes to DeepSpeed's own function.

Every other name (``logger``, ``RepeatingLoader``, ``set_z3_leaf_modules``, ``groups``,
``zero_to_fp32``, ...) is DeepSpeed's own, looked up on first use (importing deepspeed costs
seconds; under the switch, compat/, it re-enters megatrain_ds).
"""

from __future__ import annotations

import importlib


def _state(param):
    """The model state holding ``param`` (host/model_state.py), or None: not an engine's
    parameter."""
    home = getattr(param, "megatrain_home", None)
    return None if home is None else home.model_state


def _deepspeed_utils():
    return importlib.import_module("deepspeed.utils")


def safe_get_full_fp32_param(param):
    state = _state(param)
    if state is None:
        return _deepspeed_utils().safe_get_full_fp32_param(param)
    return state.full_fp32_param(param)


def safe_set_full_fp32_param(param, value) -> None:
    state = _state(param)
    if state is None:
        return _deepspeed_utils().safe_set_full_fp32_param(param, value)
    state.set_full_fp32_param(param, value)


def safe_get_full_grad(param):
    state = _state(param)
    if state is None:
        return _deepspeed_utils().safe_get_full_grad(param)
    return state.full_grad(param)


def safe_get_full_optimizer_state(param, optim_state_key: str):
    state = _state(param)
    if state is None:
        return _deepspeed_utils().safe_get_full_optimizer_state(param, optim_state_key)
    return state.full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param, value, optim_state_key: str) -> None:
    state = _state(param)
    if state is None:
        return _deepspeed_utils().safe_set_full_optimizer_state(param, value, optim_state_key)
    state.set_full_optimizer_state(param, value, optim_state_key)


def __getattr__(name: str):
    """DeepSpeed's ``deepspeed.utils.<name>`` (an attribute, or a submodule such as
    ``zero_to_fp32``)."""
    if name.startswith("__"):  # module protocol probes (inspect, pickle, pytest)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    utils = _deepspeed_utils()
    if hasattr(utils, name):
        return getattr(utils, name)
    try:
        return importlib.import_module(f"deepspeed.utils.{name}")
    except ModuleNotFoundError as exc:
        # the submodule exists but needs something missing
        if exc.name != f"deepspeed.utils.{name}":
            raise
        raise AttributeError(
            f"deepspeed.utils.{name}: neither megatrain_ds.api.utils nor DeepSpeed's "
            "deepspeed.utils "
            f"has {name!r}"
        ) from None
