"""``engine.tput_timer``: DeepSpeed's own ``ThroughputTimer``, driven as DeepSpeed's engine drives
it.

    # DeepSpeed-Chat's training scripts, once per epoch
    engine.tput_timer.update_epoch_count()
    # samples/s over the optimizer steps after the first two
    engine.tput_timer.avg_samples_per_sec()

DeepSpeed's engine starts the timer at the top of ``forward`` and stops it at the end of ``step`` (a
global step at an accumulation boundary); every ``steps_per_print`` global steps the timer logs
``epoch=…/micro_step=…/global_step=…, RunningAvgSamplesPerSec=…`` through DeepSpeed's logger.
megatrain_ds makes the same two calls (``MegaTrainEngine.forward`` / ``step``).

One difference, on purpose: DeepSpeed's timers config (``"timers": {"throughput": {"synchronized":
true}}``, true by default) synchronizes the device at each start and stop. megatrain_ds's ``step``
returns while the host optimizer and the next layer's H2D copy still run, so a device sync there
would stall that pipeline and still not time the host work. Here the timer synchronizes only when
the config sets ``synchronized`` explicitly; by default it times what the training loop sees (the
wall clock between calls).
"""

from __future__ import annotations


def make_throughput_timer(raw_config: dict, train_batch_size: int, steps_per_print: float):
    """DeepSpeed's ``ThroughputTimer`` for this config (it needs neither a process group nor
    DeepSpeed's engine)."""
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    from deepspeed.utils.timer import ThroughputTimer

    from ..errors import ConfigError, validation_error_parts

    block = ((raw_config or {}).get("timers") or {}).get("throughput") or {}
    try:
        # see the docstring
        timer_config = DeepSpeedThroughputTimerConfig(**{"synchronized": False, **block})
    except Exception as exc:  # pydantic.ValidationError from DeepSpeed's model: name the key
        key, why = validation_error_parts(exc)
        raise ConfigError(f"timers.throughput.{key}: {why}") from None
    every = None if steps_per_print in (None, float("inf")) else int(steps_per_print)
    return ThroughputTimer(
        timer_config, batch_size=train_batch_size, steps_per_output=every, monitor_memory=False
    )
