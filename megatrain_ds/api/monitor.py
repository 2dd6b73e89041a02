"""DeepSpeed's monitors on megatrain_ds: the ``tensorboard``, ``wandb``, ``csv_monitor`` and
``comet`` config blocks, validated by DeepSpeed's own config model and written by DeepSpeed's own
writers.

Events, under DeepSpeed's names, at each accumulation boundary, x = samples seen
(``global_samples``): ``Train/Samples/lr`` (the first group's), ``Train/Samples/loss_scale`` (fp16),
and with ``wall_clock_breakdown`` the previous step's breakdown in milliseconds,
``Train/Samples/elapsed_time_ms_step`` (as DeepSpeed) plus ``..._h2d``, ``..._compute`` (and
``..._recompute``, the part of it that re-ran layers' forwards), ``..._d2h``,
``..._cpu_optimizer``, ``..._wait_for_optimizer`` and ``..._gpu_idle`` (a step's breakdown is
complete once the next forward has begun, so it is written one step later, at its own x).
"""

from __future__ import annotations

from ..planning import MONITOR_BLOCKS, monitor_config  # noqa: F401 (parsed with the config)

BREAKDOWN_EVENTS = (
    "step",
    "h2d",
    "compute",
    "recompute",
    "d2h",
    "cpu_optimizer",
    "wait_for_optimizer",
    "gpu_idle",
)


class Monitor:
    """Writes the engine's events through DeepSpeed's ``MonitorMaster`` (one process: rank 0)."""

    def __init__(self, ds_monitor_config) -> None:
        from deepspeed.monitor.monitor import MonitorMaster

        from ..parallel import ensure_deepspeed_comm

        ensure_deepspeed_comm()  # DeepSpeed's writers ask deepspeed.comm for the rank
        self.master = MonitorMaster(ds_monitor_config)
        self._last_breakdown = None

    def write_step(
        self, samples: int, previous_samples: int, lrs: list[float], scaler, breakdown: dict | None
    ) -> None:
        """One boundary's events: at ``samples`` (seen so far) the first group's lr of ``lrs``
        and the fp16 ``scaler``'s scale (None: no loss scaler); at ``previous_samples`` the
        previous step's ``breakdown`` (the timer's last), once."""
        events = [("Train/Samples/lr", lrs[0], samples)] if lrs else []
        if scaler is not None:
            events.append(("Train/Samples/loss_scale", scaler.scale, samples))
        if breakdown and breakdown is not self._last_breakdown:  # the previous step's, written once
            self._last_breakdown = breakdown
            for name in BREAKDOWN_EVENTS:
                if breakdown.get(f"{name}_s") is not None:
                    events.append(
                        (
                            f"Train/Samples/elapsed_time_ms_{name}",
                            1e3 * breakdown[f"{name}_s"],
                            previous_samples,
                        )
                    )
            # cumulative counts (speculation.py)
            for name in ("speculated_steps", "rolled_back_steps"):
                if breakdown.get(name) is not None:
                    events.append((f"Train/Samples/{name}", breakdown[name], previous_samples))
        if events:
            self.master.write_events(events)
