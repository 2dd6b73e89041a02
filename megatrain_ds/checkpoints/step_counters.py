"""Where training stands, as one value: DeepSpeed's step counters (issue 41, "values, not slots").

The engine holds one ``StepCounters`` (``engine.counters``) and advances it at each micro-step and
optimizer step; ``engine.global_steps`` and the other names scripts read are views of it. A
checkpoint saves ``state()`` under DeepSpeed's own keys and a load sets it back in place with
``load_state`` (``from_state``'s values), which also reads checkpoints that lack the keys DeepSpeed
does not write (``micro_steps``, ``window_micro_steps``) and restarts a window saved part-way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class StepCounters:
    # forward/backward/step calls since the start (DeepSpeed's ``micro_steps``)
    micro_steps: int = 0
    # micro-steps of the current accumulation window (its partial gradient)
    window_micro_steps: int = 0
    global_steps: int = 0  # optimizer steps, skipped ones included (DeepSpeed counts them)
    global_samples: int = 0  # samples seen: train_batch_size per optimizer step
    skipped_steps: int = 0  # steps skipped on non-finite gradients (every precision; fp16 overflow)

    def after_micro_step(self, boundary: bool) -> None:
        """``engine.step()`` at a micro-step: the window grows, or closes at a boundary
        (``optimizer_step`` then)."""
        self.window_micro_steps = 0 if boundary else self.window_micro_steps + 1

    def optimizer_step(self, train_batch_size: int, skipped: bool) -> int:
        """An optimizer step at a boundary; returns the samples seen before it (the monitors'
        previous x)."""
        previous = self.global_samples
        self.global_steps += 1
        self.global_samples += train_batch_size
        self.skipped_steps += int(skipped)
        return previous

    def state(self) -> dict[str, int]:
        """What a checkpoint saves, under these names (DeepSpeed's client-state keys)."""
        return asdict(self)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_state(
        cls, states: dict, train_batch_size: int, gradient_accumulation_steps: int
    ) -> StepCounters:
        """The counters a checkpoint's states give. DeepSpeed writes no ``micro_steps``: derived
        from the steps. A save inside an accumulation window holds none of its partial gradient, so
        the resumed run restarts that window (as DeepSpeed's does): ``micro_steps`` goes back to the
        window's start."""
        steps = int(states["global_steps"])
        partial = int(states.get("window_micro_steps", 0) or 0)
        return cls(
            micro_steps=int(states.get("micro_steps", steps * gradient_accumulation_steps))
            - partial,
            window_micro_steps=0,
            global_steps=steps,
            global_samples=int(states.get("global_samples", steps * train_batch_size)),
            skipped_steps=int(states.get("skipped_steps", 0)),
        )

    def load_state(
        self, states: dict, train_batch_size: int, gradient_accumulation_steps: int
    ) -> None:
        """``from_state``'s counters, set in place: the engine keeps one ``StepCounters``, which
        its views and a checkpoint's parts (parts.py) share."""
        loaded = self.from_state(states, train_batch_size, gradient_accumulation_steps)
        for f in fields(self):
            setattr(self, f.name, getattr(loaded, f.name))


def counter_view(name: str) -> property:
    """``engine.<name>``: a view of ``engine.counters.<name>``, read and set (scripts and
    DeepSpeed's tools set ``global_steps``)."""
    return property(
        lambda self: getattr(self.counters, name),
        lambda self, value: setattr(self.counters, name, value),
        doc=f"DeepSpeed's ``{name}``: ``engine.counters.{name}`` (checkpoints/step_counters.py)",
    )
