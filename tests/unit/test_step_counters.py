"""StepCounters (megatrain_ds/checkpoints/step_counters.py): the engine's step counters as one
value, without building an engine; and the engine's names for them (``engine.global_steps`` ...) are
views of it."""

import pytest

from megatrain_ds.checkpoints.step_counters import StepCounters


def test_a_window_of_three_micro_steps_then_a_skipped_step():
    c = StepCounters()
    for boundary in (False, False, True):
        c.after_micro_step(boundary)
        if boundary:
            assert c.optimizer_step(train_batch_size=12, skipped=False) == 0
        c.micro_steps += 1
    assert c.state() == {
        "micro_steps": 3,
        "window_micro_steps": 0,
        "global_steps": 1,
        "global_samples": 12,
        "skipped_steps": 0,
    }
    c.after_micro_step(True)
    assert c.optimizer_step(train_batch_size=12, skipped=True) == 12
    assert (c.global_steps, c.global_samples, c.skipped_steps) == (2, 24, 1)


def test_from_state_round_trip_and_deepspeed_checkpoints_without_our_keys():
    c = StepCounters(
        micro_steps=9, window_micro_steps=0, global_steps=3, global_samples=36, skipped_steps=1
    )
    assert StepCounters.from_state(c.state(), 12, 3) == c
    # DeepSpeed's own checkpoint: no micro_steps, no window: derived from global_steps and GA
    ds = StepCounters.from_state(
        {"global_steps": 4, "global_samples": 48, "skipped_steps": 0}, 12, 3
    )
    assert (ds.micro_steps, ds.global_samples, ds.window_micro_steps) == (12, 48, 0)
    assert StepCounters.from_state({"global_steps": 4}, 12, 3).global_samples == 48


def test_a_save_inside_a_window_restarts_that_window():
    saved = StepCounters(
        micro_steps=11, window_micro_steps=2, global_steps=3, global_samples=36
    ).state()
    back = StepCounters.from_state(saved, 12, 4)
    assert (back.micro_steps, back.window_micro_steps, back.global_steps) == (9, 0, 3)


def test_the_engine_names_are_views_of_its_counters():
    import megatrain_ds
    from tests.models import tiny_hf

    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        },
    )
    import torch

    ids = torch.randint(0, 256, (2, 8))
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    assert engine.counters.state() == {
        "micro_steps": 3,
        "window_micro_steps": 1,
        "global_steps": 1,
        "global_samples": 4,
        "skipped_steps": 0,
    }
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (1, 3, 4)
    engine.global_steps = 7  # scripts (and DeepSpeed's own tools) set it: it is the counter
    assert engine.counters.global_steps == 7
    with pytest.raises(AttributeError):
        engine.counters.nonexistent_counter
    engine.destroy()
