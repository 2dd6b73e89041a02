"""DeepSpeed engine calls with DeepSpeed's semantics."""

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf


def _engine(ga=2, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }
    model = tiny_hf("llama")
    engine, optimizer, loader, scheduler = megatrain_ds.initialize(model=model, config=cfg)
    return engine


def _ids(seed):
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(seed))


def _assert_same_training(a, b):
    assert a.get_global_grad_norm() == pytest.approx(b.get_global_grad_norm(), rel=1e-6)
    sa, sb = a.master_state_dict(), b.master_state_dict()
    assert all(torch.allclose(sa[k], sb[k], rtol=1e-6, atol=1e-7) for k in sa)
    a.destroy(), b.destroy()


def _micro(engine, seed, **backward_kwargs):
    ids = _ids(seed)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss, **backward_kwargs)
    engine.step()
    return loss


def test_step_updates_only_at_accumulation_boundaries():
    engine = _engine(ga=2)
    before = engine.master_state_dict()["model.layers.0.mlp.up_proj.weight"].clone()
    assert not engine.is_gradient_accumulation_boundary()
    _micro(engine, 0)
    assert engine.global_steps == 0 and engine.global_samples == 0
    assert torch.equal(engine.master_state_dict()["model.layers.0.mlp.up_proj.weight"], before)
    assert engine.is_gradient_accumulation_boundary()
    _micro(engine, 1)
    assert engine.global_steps == 1 and engine.global_samples == engine.train_batch_size() == 4
    assert not torch.equal(engine.master_state_dict()["model.layers.0.mlp.up_proj.weight"], before)
    engine.destroy()


def test_backward_without_gas_scaling_equals_manual_division():
    a, b = _engine(ga=2), _engine(ga=2)
    for seed in range(4):
        _micro(a, seed)
        ids = _ids(seed)
        loss = b(input_ids=ids, labels=ids).loss
        b.backward(loss / 2, scale_wrt_gas=False)  # what the HF Trainer does
        b.step()
    _assert_same_training(a, b)


def test_boundary_override_persists_until_changed():
    engine = _engine(ga=4)
    engine.set_gradient_accumulation_boundary(True)
    for seed in range(3):
        _micro(engine, seed)
    assert engine.global_steps == 3  # every micro-batch closed a window
    engine.set_gradient_accumulation_boundary(False)
    _micro(engine, 3)
    assert engine.global_steps == 3
    engine.destroy()


def test_zero_grad_keeps_the_accumulated_gradient_as_deepspeed():
    """Window of 2: [batch 0, zero_grad, batch 1] steps like [batch 0, batch 1]: DeepSpeed's
    engine.zero_grad() keeps the window (its ZeRO partitions hold the accumulated gradient until the
    step), so must we (issue 27)."""
    a, b = _engine(ga=2), _engine(ga=2)
    ids0, ids1 = _ids(0), _ids(1)
    for engine in (a, b):
        engine.backward(engine(input_ids=ids0, labels=ids0).loss)
        engine.step()
        if engine is a:
            a.zero_grad()
        engine.backward(engine(input_ids=ids1, labels=ids1).loss)
        engine.step()
    assert a.global_steps == b.global_steps == 1
    _assert_same_training(a, b)


def test_eval_under_no_grad_lands_no_gradient():
    engine = _engine(ga=1)
    ref = tiny_hf("llama").eval()
    engine.eval()
    ids = _ids(0)
    with torch.no_grad():
        loss = engine(input_ids=ids, labels=ids).loss
        want = ref(input_ids=ids, labels=ids).loss
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert not any(engine.executor.has_grad)
    engine.train()
    assert engine.module.training
    engine.destroy()


def test_get_lr_reads_what_an_external_scheduler_wrote():
    engine = _engine(ga=1)
    engine.optimizer.param_groups[0]["lr"] = 0.0
    before = engine.master_state_dict()["model.layers.1.self_attn.q_proj.weight"].clone()
    assert engine.get_lr() == [0.0]
    _micro(engine, 0)
    after = engine.master_state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(before, after)  # lr 0: the update used the mutated value
    engine.destroy()


def test_lr_scheduler_callable_and_training_data():
    data = [torch.randint(0, 256, (10,)) for _ in range(8)]
    model = tiny_hf("llama")
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, optimizer, loader, scheduler = megatrain_ds.initialize(
        model=model,
        config=cfg,
        training_data=data,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )
    batch = next(iter(loader))
    assert batch.shape == (4, 10)
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    engine.step()
    assert engine.get_lr() == [pytest.approx(5e-4)] and scheduler.optimizer is optimizer
    engine.destroy()


def test_engine_without_optimizer_runs_forward_and_backward():
    """A frozen reference engine (no optimizer in the config): forward works, step() changes
    nothing."""
    engine, optimizer, _, _ = megatrain_ds.initialize(
        model=tiny_hf("llama"), config={"train_micro_batch_size_per_gpu": 2}
    )
    assert optimizer is None
    ids = _ids(0)
    with torch.no_grad():
        assert torch.isfinite(engine(input_ids=ids, labels=ids).loss)
    engine.destroy()


def test_engine_properties_and_destroy(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    engine = _engine(ga=1, bf16={"enabled": True}, zero_optimization={"stage": 3})
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.device.type == expected and engine.local_rank == 0
    assert (
        engine.zero_optimization_stage() == 3
        and engine.bfloat16_enabled()
        and not engine.fp16_enabled()
    )
    assert isinstance(engine, megatrain_ds.DeepSpeedEngine)
    _micro(engine, 0)
    # one mapping per flat host buffer; pinned ones only with CUDA
    regions = list(engine.store.regions)
    assert len(regions) >= 4  # master, two moments, gradient home (+ wire)
    # wire and grad home
    assert sum(r.registered for r in regions) == (2 if torch.cuda.is_available() else 0)
    engine.destroy()
    assert engine.worker._shutdown  # the host worker thread is gone
    # pinned memory released
    assert not engine.store.regions and all(not r.registered for r in regions)


@pytest.mark.parametrize("device_layers", [0, 2])
def test_boundary_moved_after_backward_gives_the_same_norm(device_layers):
    """If the boundary is declared only after the last backward, the per-layer norms are taken late
    (from wherever each layer's gradient lives); the step must equal one where it was known up
    front."""
    extra = {"megatrain": {"gpu_optimizer_layers": device_layers}}
    late, early = _engine(ga=4, **extra), _engine(ga=4, **extra)
    for seed in range(2):
        ids = _ids(seed)
        late.backward(late(input_ids=ids, labels=ids).loss)  # boundary not known during backward
        if seed == 1:
            late.set_gradient_accumulation_boundary(True)
        late.step()
        early.set_gradient_accumulation_boundary(seed == 1)  # known before backward
        early.backward(early(input_ids=ids, labels=ids).loss)
        early.step()
    assert late.global_steps == early.global_steps == 1
    _assert_same_training(late, early)


def test_monitor_blocks_write_lr_and_the_step_breakdown(tmp_path):
    """csv_monitor (DeepSpeed's writer): the lr per optimizer step at x = samples seen, and with
    wall_clock_breakdown each step's breakdown, written once the next step has closed it, at its own
    x."""
    out = tmp_path / "mon"
    engine = _engine(
        ga=1,
        wall_clock_breakdown=True,
        steps_per_print=1000,
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4},
        },
        csv_monitor={"enabled": True, "output_path": str(out), "job_name": "job"},
    )
    lrs = []
    for seed in range(3):
        _micro(engine, seed)  # forward, backward, step
        lrs.append(engine.get_lr()[0])
    engine.destroy()

    def rows(name):
        lines = (out / "job" / f"Train_Samples_{name}.csv").read_text().splitlines()
        return lines[0], [(int(x), float(v)) for x, v in (line.split(",") for line in lines[1:])]

    assert rows("lr") == ("step,lr", [(2, lrs[0]), (4, lrs[1]), (6, lrs[2])])
    assert lrs[0] < lrs[1] < lrs[2]  # the warm-up moved it
    for part in ("step", "compute", "cpu_optimizer") + (
        ("gpu_idle",) if torch.cuda.is_available() else ()
    ):
        header, data = rows(f"elapsed_time_ms_{part}")
        assert header == f"step,elapsed_time_ms_{part}" and [x for x, _ in data] == [2, 4]
        assert all(v >= 0 for _, v in data)
    assert all(v > 0 for _, v in rows("elapsed_time_ms_step")[1])
    # no GPU, no GPU idle time: not written rather than written as 0
    if not torch.cuda.is_available():
        assert not (out / "job" / "Train_Samples_elapsed_time_ms_gpu_idle.csv").exists()


@pytest.mark.parametrize("kept", [0, 99])
def test_the_breakdown_names_the_recompute_within_compute(kept):
    """wall_clock_breakdown: ``recompute_s`` is the part of compute that re-ran layers' forwards
    in their backward (none of the tiny model's layers kept, or every one: 99 keeps them all, and
    a kept layer recomputes nothing), and the log line names it."""
    _recompute_in_breakdown(kept)


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [0, 99])
def test_gpu_the_breakdown_names_the_recompute_within_compute(kept):
    """The same with CUDA events on the compute stream (nested in the backward's compute span)."""
    assert torch.cuda.is_available()
    _recompute_in_breakdown(kept)


def _recompute_in_breakdown(kept):
    engine = _engine(ga=1, wall_clock_breakdown=True, megatrain={"keep_activations": kept})
    for seed in range(3):  # a step's breakdown closes when the next forward begins
        _micro(engine, seed)
    b = engine.last_step_breakdown()
    engine.destroy()
    assert 0.0 <= b["recompute_s"] <= b["compute_s"]
    if kept:
        assert b["recompute_s"] == 0.0
        assert "recompute" not in engine.timer.format(b)
    else:
        assert b["recompute_s"] > 0.0
        assert "(of which recompute " in engine.timer.format(b)


def test_a_bad_monitor_key_is_an_error_naming_it():
    with pytest.raises(megatrain_ds.ConfigError, match="csv_monitor.output_pth"):
        _engine(csv_monitor={"enabled": True, "output_pth": "x"})
