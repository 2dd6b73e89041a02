"""fp16 with DeepSpeed's semantics: loss scaling (``fp16.loss_scale``, ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``), the log
lines of a skipped step, and ``fp16.auto_cast``'s input cast.

DeepSpeed's own ``DynamicLossScaler`` cannot be reused here: its ``update_scale`` asks DeepSpeed's
comm backend for the rank and asserts when no process group exists (a plain one-process ``python
train.py``). The update rule below is its (``deepspeed/runtime/fp16/loss_scaler.py``, the scaler of
its ZeRO optimizers, whose layout megatrain_ds mirrors): on overflow, spend one unit of hysteresis
or halve the scale (not below the minimum; an overflow at the minimum stops the run) and skip the
step; after ``loss_scale_window`` overflow-free steps, double it.
"""

from __future__ import annotations

from dataclasses import dataclass

# DeepSpeed's words for a skipped step (LossScalerBase.update_scale), printed by the engine whenever
# a step is skipped without a dynamic fp16 scaler to say more: fp32, bf16, static fp16 loss scale.
SKIP_MESSAGE = "OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated."


class LossScaleAtMinimumError(FloatingPointError):
    """The gradients overflow at the minimum loss scale (DeepSpeed raises here: "Exiting run.")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaling:
    """fp16's loss-scaling settings as the config gives them: a value. The engine builds the live
    ``LossScaler`` from it (``scaler()``), which the optimizer updates every step."""

    scale: float
    dynamic: bool = True
    window: int = 1000  # overflow-free steps before the scale doubles
    min_scale: float = 1.0
    hysteresis: int = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False  # refill the hysteresis after every overflow-free step
    raise_error_at_min_scale: bool = True  # as DeepSpeed's ZeRO optimizers (CreateLossScaler)

    def scaler(self) -> "LossScaler":
        """A fresh live scaler starting from these settings."""
        return LossScaler(**{name: getattr(self, name) for name in self.__slots__})


@dataclass(kw_only=True, slots=True)
class LossScaler:
    scale: float
    dynamic: bool = True
    window: int = 1000  # overflow-free steps before the scale doubles
    min_scale: float = 1.0
    hysteresis: int = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False  # refill the hysteresis after every overflow-free step
    raise_error_at_min_scale: bool = True  # as DeepSpeed's ZeRO optimizers (CreateLossScaler)
    _hysteresis_left: int = 0
    _iter: int = 0
    _last_overflow: int = -1

    def __post_init__(self) -> None:
        self._hysteresis_left = self.hysteresis

    def state(self) -> dict:
        """Every field by its name: what a checkpoint saves (its ``loss_scaler`` entry) and
        ``load_state`` puts back."""
        return {name: getattr(self, name) for name in self.__slots__}

    def load_state(self, state: dict) -> None:
        """The fields ``state`` names (a checkpoint's ``loss_scaler`` entry), set in place."""
        for name, value in state.items():
            setattr(self, name, value)

    def progress(self) -> tuple[int, int, int]:
        """Where the update rule stands: (steps seen, the step of the last overflow, hysteresis
        left), DeepSpeed's ``cur_iter``, ``last_overflow_iter`` and ``cur_hysteresis``."""
        return self._iter, self._last_overflow, self._hysteresis_left

    def update(self, overflow: bool) -> str | None:
        """Call once per optimizer step with whether the gradients held inf/nan. Returns DeepSpeed's
        log line for a skipped step (None when there was no overflow). Raises
        ``LossScaleAtMinimumError`` when the scale must halve but is already at
        ``min_loss_scale``."""
        if not self.dynamic:
            return SKIP_MESSAGE if overflow else None
        message = None
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                if self.scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16: the gradients overflow at the minimum loss scale "
                        "(fp16.min_loss_scale="
                        f"{self.min_scale:g}): cannot decrease the scale anymore (DeepSpeed exits "
                        "the run here). "
                        "Lower the learning rate, check the data for inf/nan, or train in bf16."
                    )
                new = max(self.scale / 2.0, self.min_scale)
                message = (
                    f"OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {int(self.scale)}, "
                    "reducing "
                    f"to {int(new)}"
                )
                self.scale = new
            else:
                message = (
                    f"OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {int(self.scale)}, but "
                    f"hysteresis is {self._hysteresis_left}. Reducing hysteresis to "
                    f"{self._hysteresis_left - 1}"
                )
                self._hysteresis_left -= 1
            self._last_overflow = self._iter
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            stable = self._iter - self._last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self._iter += 1
        return message


def cast_inputs_half(value):
    """``fp16.auto_cast``: DeepSpeed's ``_cast_inputs_half``: floating-point tensors in (nested
    lists, tuples and dicts of) the forward's POSITIONAL inputs become half; other values are
    returned as they are. DeepSpeed leaves keyword arguments alone: so does the engine."""
    if isinstance(value, (list, tuple)):
        return value.__class__([cast_inputs_half(v) for v in value])
    if isinstance(value, dict):
        return {k: cast_inputs_half(v) for k, v in value.items()}
    if hasattr(value, "half") and value.is_floating_point():
        return value.half()
    return value
