"""fp16 with DeepSpeed's loss scaling: scaled backward, unscaled exact clipping, skipped steps on
overflow."""

import copy

import pytest
import torch

import megatrain_ds
from megatrain_ds.optim.loss_scale import LossScaler
from tests.models import tiny_hf


def _cfg(**fp16):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
        },
        "fp16": {"enabled": True, **fp16},
    }


def _ids(seed):
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_fp16_tracks_fp32():
    ref = tiny_hf("qwen2")
    engine, *_ = megatrain_ds.initialize(
        model=copy.deepcopy(ref), config=_cfg(initial_scale_power=8)
    )
    engine32, *_ = megatrain_ds.initialize(
        model=copy.deepcopy(ref), config={**_cfg(), "fp16": {"enabled": False}}
    )
    assert engine.fp16_enabled() and engine.executor.slots[0].buf.dtype == torch.float16
    for seed in range(6):
        losses = []
        for e in (engine, engine32):
            ids = _ids(seed)
            loss = e(input_ids=ids, labels=ids).loss
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=2e-2)
        assert engine.get_global_grad_norm() == pytest.approx(
            engine32.get_global_grad_norm(), rel=5e-2
        )
    assert engine.skipped_steps == 0
    engine.destroy(), engine32.destroy()


def test_overflow_skips_the_step_and_halves_the_scale():
    engine, optimizer, _, scheduler = megatrain_ds.initialize(
        model=tiny_hf("qwen2"), config=_cfg(initial_scale_power=60, hysteresis=1)
    )
    scaler = engine.loss_scaler
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    sched_iter = scheduler.last_batch_iteration
    ids = _ids(0)
    engine.backward(engine(input_ids=ids, labels=ids).loss)  # loss * 2^60 overflows fp16
    engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 1
    assert engine.optimizer.step_count == 0  # Adam's bias correction does not count a skipped step
    assert scaler.scale == 2.0**59
    assert scheduler.last_batch_iteration == sched_iter  # not advanced on overflow, as DeepSpeed
    after = engine.master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.get_lr() == [0.0]
    engine.destroy()


def test_loss_scaler_rule():
    s = LossScaler(scale=2.0**16, window=2, hysteresis=2, min_scale=1)
    s.update(True)
    assert s.scale == 2.0**16  # first overflow spends the hysteresis
    s.update(True)
    assert s.scale == 2.0**15
    s.update(False), s.update(False)
    # DeepSpeed's rule: the clean interval after an overflow starts one later
    assert s.scale == 2.0**15
    s.update(False)
    assert s.scale == 2.0**16  # doubled once a full window of clean steps has passed
    static = LossScaler(scale=128.0, dynamic=False)
    static.update(True)
    assert static.scale == 128.0
