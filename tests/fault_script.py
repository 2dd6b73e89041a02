"""The fault driver's training script and its reference run (tests/fault_driver.py drives faults
into it): the user's loop (``script``) on a tiny Llama with clipping, a warm-up schedule and a
periodic checkpoint, the engine call it is in (``Windows``), and the uninterrupted run every outcome
is compared with (``Reference``, ``check_at``)."""

from __future__ import annotations

import tempfile

STEPS = 4  # optimizer steps of the script
SAVE_AT = 2  # the script's periodic checkpoint, after this many steps
# weights "equal": speculative steps rolled back are exact only to a few ulps (speculation.py)
ATOL = 1e-6


def _config(ga: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3, "warmup_num_steps": 3}},
        "megatrain": {"check_recompute": False},
    }


def _engine(ga: int, seed: int = 0):
    import megatrain_ds
    from tests.models import tiny_hf

    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", tied=False, seed=seed), config=_config(ga)
    )
    return engine


def _batches(ga: int):
    from tests.models import token_batches

    return token_batches(STEPS * ga, seed=11)


class Windows:
    """Which engine call the script is in (``(phase, micro-step)``), for the hooks, timers and
    calibration."""

    def __init__(self) -> None:
        self.current = self.interrupted_in = None
        self.enter = self.leave = None  # callbacks (window) -> None

    def run(self, window, fn, *args, **kwargs):
        self.current = window
        if self.enter is not None:
            self.enter(window)
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            self.interrupted_in = window
            raise
        finally:
            if self.leave is not None:
                self.leave(window)
            self.current = None


def script(engine, ga: int, ckdir: str, windows: Windows | None = None, after_step=None) -> None:
    """The user's loop, from the engine's own counters (micro-batch ``engine.micro_steps`` next: a
    resumed engine starts at the first micro-step of its window): forward, backward, step per
    micro-batch; a checkpoint after ``SAVE_AT`` steps."""
    windows = windows or Windows()
    batches = _batches(ga)
    for m in range(engine.micro_steps, STEPS * ga):
        ids = batches[m]
        loss = windows.run(("forward", m), lambda: engine(input_ids=ids, labels=ids).loss)
        windows.run(("backward", m), engine.backward, loss)
        windows.run(("step", m), engine.step)
        if (m + 1) % ga:
            continue
        if after_step is not None:
            after_step(engine)
        if engine.global_steps == SAVE_AT:
            windows.run(("save", 0), engine.save_checkpoint, ckdir)


def weights(engine) -> dict:
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


class Reference:
    """The uninterrupted run: weights and learning rate after every global step (index 0: the
    initial ones)."""

    def __init__(self, ga: int, workdir: str) -> None:
        engine = _engine(ga)
        self.weights, self.lr = [weights(engine)], [engine.get_lr()]

        def record(e):
            self.weights.append(weights(e))
            self.lr.append(e.get_lr())

        script(engine, ga, tempfile.mkdtemp(dir=workdir), after_step=record)
        engine.destroy()

    def step_of(self, w: dict) -> tuple[int, float]:
        """The reference step whose weights are closest to ``w`` (and how close)."""
        diffs = [max_diff(w, r) for r in self.weights]
        best = min(range(len(diffs)), key=diffs.__getitem__)
        return best, diffs[best]


def check_at(ref: Reference, engine, what: str) -> str | None:
    """None when ``engine``'s weights, counters and learning rate are the reference's at its global
    step; else what differs."""
    g = engine.global_steps
    if not 0 <= g <= STEPS:
        return f"{what}: global_steps {g} outside the run"
    w = weights(engine)
    diff = max_diff(w, ref.weights[g])
    if diff > ATOL:
        near, near_diff = ref.step_of(w)
        return (
            f"{what}: global_steps {g} but the weights differ from the reference's at step {g} by "
            f"{diff:.3g} "
            f"(closest: step {near}, {near_diff:.3g})"
        )
    if engine.optimizer.step_count != g:
        return f"{what}: global_steps {g} but Adam's step count is {engine.optimizer.step_count}"
    if engine.get_lr() != ref.lr[g]:
        return f"{what}: lr {engine.get_lr()} at step {g}, the reference's {ref.lr[g]}"
    if engine.micro_steps != g * engine.gradient_accumulation_steps():
        return (
            f"{what}: micro_steps {engine.micro_steps} at step {g} (GA "
            f"{engine.gradient_accumulation_steps()})"
        )
    return None


def finish_and_check(ref: Reference, engine, ga: int, ckdir: str, what: str) -> str | None:
    """Train ``engine`` on from its counters to the end of the script: the reference's final
    state?"""
    script(engine, ga, ckdir)
    return check_at(ref, engine, what)
