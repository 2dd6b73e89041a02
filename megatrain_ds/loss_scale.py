"""fp16 loss scaling with DeepSpeed's semantics (``fp16.loss_scale``, ``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``).

DeepSpeed's own ``DynamicLossScaler`` cannot be reused here: its ``update_scale`` asks DeepSpeed's comm
backend for the rank and asserts when no process group exists (a plain one-process ``python train.py``).
The update rule below is the documented one: on overflow, spend one unit of hysteresis or halve the scale
(not below the minimum) and skip the step; after ``loss_scale_window`` overflow-free steps, double it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class LossScaler:
    scale: float
    dynamic: bool = True
    window: int = 1000  # overflow-free steps before the scale doubles
    min_scale: float = 1.0
    hysteresis: int = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False  # refill the hysteresis after every overflow-free step
    _hysteresis_left: int = 0
    _iter: int = 0
    _last_overflow: int = -1

    def __post_init__(self) -> None:
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Call once per optimizer step with whether the gradients held inf/nan."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
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
