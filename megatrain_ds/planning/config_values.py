"""The value checks of config parsing: DeepSpeed's defaults (``ds_default``), its pydantic models
(``ds_model``), and the key, number and bool checks every block of config.py goes through, each
error naming its key."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, validation_error_parts


# DeepSpeed 0.19.8's values, used only when the installed DeepSpeed lacks the constant (or DeepSpeed
# is absent).
_FALLBACK_DEFAULTS = {
    "GRADIENT_CLIPPING_DEFAULT": 1.0,
    "STEPS_PER_PRINT_DEFAULT": None,
    "WALL_CLOCK_BREAKDOWN_DEFAULT": False,
    "DATALOADER_DROP_LAST_DEFAULT": False,
    "FP16_ENABLED_DEFAULT": False,
    "FP16_AUTO_CAST_DEFAULT": False,
    "FP16_LOSS_SCALE_DEFAULT": 0,
    "FP16_INITIAL_SCALE_POWER_DEFAULT": 16,
    "FP16_LOSS_SCALE_WINDOW_DEFAULT": 1000,
    "FP16_HYSTERESIS_DEFAULT": 2,
    "FP16_CONSECUTIVE_HYSTERESIS_DEFAULT": False,
    "FP16_MIN_LOSS_SCALE_DEFAULT": 1,
    "LOAD_UNIVERSAL_CHECKPOINT_DEFAULT": False,
    "USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT": False,
    "CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT": False,
}


def ds_default(name: str):
    """A default from the installed DeepSpeed's ``deepspeed.runtime.constants`` (so it follows its
    version)."""
    try:
        from deepspeed.runtime import constants
    except ImportError:  # deepspeed is a dependency; a box without it gets 0.19.8's values
        constants = None
    return getattr(constants, name, _FALLBACK_DEFAULTS[name])


def check_keys(block: dict, allowed: set[str], where: str) -> None:
    for key in block:
        if key not in allowed:
            raise ConfigError(
                f"unknown key '{where}.{key}' (allowed: {', '.join(sorted(allowed))})"
            )


def ds_model(module: str, name: str, block: dict, where: str):
    """``block`` validated (and coerced) by DeepSpeed's own pydantic model ``module.name``; None
    when the installed DeepSpeed has no such model (the caller then checks what it needs itself)."""
    try:
        model = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return None
    try:
        return model(**block)
    except Exception as exc:  # pydantic.ValidationError (or a DeepSpeed assert in a validator)
        key, why = validation_error_parts(exc)
        raise ConfigError(f"{where}.{key}: {why}" if key else f"{where}: {why}") from None


def reject_auto(value: Any, key: str) -> None:
    if value == "auto":
        raise ConfigError(
            f"'{key}' is \"auto\": resolve it before initialize() (accelerate and the HF "
            "Trainer fill it in; a plain script must give a value)"
        )
    if isinstance(value, dict):
        for k, v in value.items():
            reject_auto(v, f"{key}.{k}")


def as_num(value: Any, key: str, cast=float, minimum: float | None = None):
    """A number (bools are not numbers); ``cast=int`` also rejects fractions (``2.5``
    micro-batches)."""
    reject_auto(value, key)
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
        if cast is int and not number.is_integer():
            raise ValueError
        number = cast(number) if cast is int else number
    except (TypeError, ValueError, OverflowError):
        kind = "an integer" if cast is int else "a number"
        raise ConfigError(f"'{key}' must be {kind}, got {value!r}") from None
    if minimum is not None and not number >= minimum:  # "not >=" also rejects nan
        raise ConfigError(f"'{key}' must be >= {minimum}, got {value!r}")
    return number


def as_bool(value: Any, key: str) -> bool:
    """true/false only: ``bool("false")`` is True, so a string here would silently flip the
    setting."""
    reject_auto(value, key)
    if not isinstance(value, bool):
        raise ConfigError(f"'{key}' must be true or false, got {value!r}")
    return value


# the monitor blocks (api/monitor.py writes the events), validated by DeepSpeed's own config model
# at parse
MONITOR_BLOCKS = ("tensorboard", "wandb", "csv_monitor", "comet")


def monitor_config(cfg: dict):
    """DeepSpeed's monitor config for ``cfg`` when a monitor block is enabled, else None. Any
    monitor block present is validated, enabled or not (as DeepSpeed does): a bad key or value
    raises ConfigError naming it."""
    present = [k for k in MONITOR_BLOCKS if k in cfg]
    if not present:
        return None
    for k in present:
        if not isinstance(cfg[k], dict):
            raise ConfigError(
                f"'{k}' must be a block like {{\"enabled\": true, ...}}, got {cfg[k]!r}"
            )
    from deepspeed.monitor.config import get_monitor_config

    try:
        monitor = get_monitor_config(cfg)
    except Exception as exc:  # pydantic.ValidationError: its key is "<block>.<key>"
        key, why = validation_error_parts(exc)
        raise ConfigError(f"{key}: {why}") from None
    return monitor if monitor.enabled else None
