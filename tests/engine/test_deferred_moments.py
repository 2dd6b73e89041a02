"""The host update in two passes ([Note: deferred moments] in optim/host_update.py): the weights
pass after the norm, the moments pass later. The kernel's two passes equal its one pass bit for bit
in every layout; training with the passes deferred equals training with whole updates bit for bit
(masters and Adam moments), with GA 1 (the D2H into the gradient home waits for the moments pass)
and GA 2 (the landing thread's fold waits), with a moments pass slowed down so that the next
backward must wait for it, with a landing thread so slow that a fold queued before step() runs after
it (no deadlock), across a checkpoint save and load, and with Adam-L2 (which cannot defer: whole
updates)."""

import time

import pytest
import torch

import megatrain_ds
from megatrain_ds.optim import host_update
from megatrain_ds.optim.host_update import PHASE_MOMENTS, PHASE_WEIGHTS, native_adam
from megatrain_ds.optim.optimizer import HostAdamW
from tests.models import tiny_hf

pytestmark = pytest.mark.skipif(
    host_update.native_library() is None,
    reason="no C compiler here: the native kernel cannot be built",
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
LAYOUTS = [
    (F32, F32, None),
    (BF16, F32, None),
    (BF16, F32, BF16),
    (F32, F32, BF16),
    (BF16, BF16, None),
    (F16, F32, F16),
    (F16, F32, None),
]  # (gradient, master, wire)


def _bits(t):
    return t.view(torch.int32) if t.dtype == F32 else t.view(torch.int16)


@pytest.mark.parametrize("grad_dt,master_dt,wire_dt", LAYOUTS)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_two_passes_equal_one(grad_dt, master_dt, wire_dt, adam_w_mode):
    g = torch.Generator().manual_seed(7)
    n = (1 << 18) + 13  # a tail that torch's scalar loop would do
    hp = dict(
        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01 if adam_w_mode else 0.0, step=4
    )
    master = torch.randn(n, generator=g).to(master_dt)
    grad = (torch.randn(n, generator=g) * 3).to(grad_dt)
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    grad[5] = float("nan")  # a non-finite element goes through both passes alike
    wire = None if wire_dt is None else torch.full((n,), 7.0, dtype=wire_dt)
    one = [master.clone(), m.clone(), v.clone(), None if wire is None else wire.clone()]
    two = [master.clone(), m.clone(), v.clone(), None if wire is None else wire.clone()]
    native_adam(one[0], grad, one[1], one[2], hp, 0.37, adam_w_mode, one[3])
    native_adam(two[0], grad, two[1], two[2], hp, 0.37, adam_w_mode, two[3], phase=PHASE_WEIGHTS)
    # moments untouched
    assert torch.equal(_bits(two[1]), _bits(m)) and torch.equal(_bits(two[2]), _bits(v))
    assert torch.equal(_bits(two[0]), _bits(one[0]))  # the weights are final after the first pass
    native_adam(two[0], grad, two[1], two[2], hp, 0.37, adam_w_mode, two[3], phase=PHASE_MOMENTS)
    for a, b in zip(one, two):
        if a is not None:
            assert torch.equal(_bits(a), _bits(b))
    assert not torch.equal(one[1], m)  # it did update


def test_moments_pass_refuses_adam_l2():
    n = 1024
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    with pytest.raises(ValueError, match="L2"):
        native_adam(
            torch.zeros(n),
            torch.ones(n),
            torch.zeros(n),
            torch.zeros(n),
            hp,
            1.0,
            False,
            phase=PHASE_MOMENTS,
        )


def _batches(n, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 12), generator=g) for _ in range(n)]


def _config(defer, *, ga=1, clip=1.0, optimizer="AdamW", weight_decay=0.01):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": optimizer,
            "params": {
                "lr": 2e-3,
                "weight_decay": weight_decay,
                "eps": 1e-8,
                **({"adam_w_mode": False} if optimizer == "Adam" else {}),
            },
        },
        "megatrain": {
            "host_kernel": "native",
            "deferred_moments": defer,
            "gpu_optimizer_layers": 0,
            "keep_activations": 0,
            "speculative_step": False,
        },
    }


def _state(engine):
    engine.sync_masters_to_host()
    masters = {k: t.clone() for k, t in engine.master_state_dict().items()}
    opt = engine.optimizer.host_state_dict()
    return masters, opt["exp_avg"].clone(), opt["exp_avg_sq"].clone()


def _run(config, steps, *, save_at=None, ckpt=None, resume_from=None, layers_only=False):
    model = tiny_hf("llama", seed=3)
    if layers_only:  # only the decoder layers train: no resident gradient lands (as under LoRA)
        for name, p in model.named_parameters():
            p.requires_grad_(".layers." in name)
    engine, *_ = megatrain_ds.initialize(model=model, config=config)
    if resume_from is not None:
        engine.load_checkpoint(resume_from)
    batches, ga, losses = _batches(steps), config["gradient_accumulation_steps"], []
    start = engine.global_steps
    for k in range(start * ga, steps * ga):
        ids = batches[(k // ga) % steps]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (
            save_at is not None
            and engine.global_steps == save_at
            and engine.is_gradient_accumulation_boundary()
        ):
            engine.save_checkpoint(ckpt)
    out = losses, _state(engine), engine.optimizer
    engine.destroy()
    return out


def _assert_same(a, b):
    (masters_a, m_a, v_a), (masters_b, m_b, v_b) = a, b
    assert masters_a.keys() == masters_b.keys()
    for name in masters_a:
        assert torch.equal(masters_a[name], masters_b[name]), name
    assert torch.equal(m_a, m_b) and torch.equal(v_a, v_b)


@pytest.mark.parametrize("ga", [1, 2])
def test_deferred_trains_as_whole_updates(ga):
    l_w, s_w, _ = _run(_config(False, ga=ga, clip=0.05), 8)  # clipping fires on every step
    l_d, s_d, opt = _run(_config("auto", ga=ga, clip=0.05), 8)
    assert opt.parts.defer_moments and not opt._moments_due  # on, and every moments pass has run
    assert l_w == l_d
    _assert_same(s_w, s_d)
    assert l_d[-1] < l_d[0]


def test_slow_moments_pass_is_waited_for(monkeypatch):
    """Each moments pass sleeps first: the next backward's landing of that layer must wait for it
    (else the D2H would overwrite the gradient the pass reads, and the moments would differ): the
    bits stay the same."""
    l_w, s_w, _ = _run(_config(False), 6)
    real = HostAdamW._moments_task
    ran = []

    def slow(self, i):
        if i in self._moments_due:
            time.sleep(0.2)
            ran.append(i)
        real(self, i)

    monkeypatch.setattr(HostAdamW, "_moments_task", slow)
    l_d, s_d, opt = _run(_config(True), 6)
    # every step's passes ran (tiny_hf: 2 layers; 5 steps with a next one at least)
    assert len(ran) >= 5 * 2
    assert l_w == l_d
    _assert_same(s_w, s_d)


def test_a_wait_is_timed():
    from concurrent.futures import Future
    import threading
    from megatrain_ds.streaming.schedule import LayerSchedule
    from megatrain_ds.streaming.timing import StepTimer

    sched, timer = (
        LayerSchedule(3),
        StepTimer(streams=type("S", (), {"kind": "cpu"})(), enabled=False),
    )
    done, late = Future(), Future()
    done.set_result(None)
    sched.defer_moments(0, done)
    sched.defer_moments(2, late)
    threading.Timer(0.02, late.set_result, args=(None,)).start()
    for i in range(3):
        sched.wait_moments(i, sched.moments_of(i), timer)
    assert timer.host["wait_for_moments_s"] >= 0.015


def test_deferred_across_checkpoint(tmp_path):
    """Saved at step 3 and resumed: the moments in the checkpoint are the whole update's (the save
    waits for the moments passes), and the resumed run ends where the uninterrupted one does."""
    _, s_full, _ = _run(_config(False), 6)
    _run(_config(True), 3, save_at=3, ckpt=str(tmp_path))
    _, s_resumed, _ = _run(_config(True), 6, resume_from=str(tmp_path))
    _assert_same(s_full, s_resumed)


def test_adam_l2_updates_whole(monkeypatch):
    """Adam with L2 weight decay cannot defer (its term reads the old master): whole updates, still
    exact."""
    l_w, s_w, _ = _run(_config(False, optimizer="Adam"), 4)
    real, asked = HostAdamW._can_defer, []
    monkeypatch.setattr(
        HostAdamW, "_can_defer", lambda self, i, hp: asked.append(real(self, i, hp)) or asked[-1]
    )
    l_d, s_d, opt = _run(_config(True, optimizer="Adam"), 4)
    assert asked and not any(asked)
    assert l_w == l_d
    _assert_same(s_w, s_d)


def test_deferred_true_needs_native_kernel():
    config = _config(True)
    config["megatrain"]["host_kernel"] = "torch"
    with pytest.raises(megatrain_ds.planning.config.ConfigError, match="deferred_moments"):
        megatrain_ds.initialize(model=tiny_hf("llama", seed=3), config=config)


def test_a_late_fold_waits_for_the_pass_it_was_queued_behind(monkeypatch):
    """GA 2, the landing thread slowed down so that the first micro-batch's folds are still queued
    when step() runs (tiny_hf has 2 layers: 4 landings fit the ring; only the layers train, so no
    resident landing makes the backward wait for them): such a fold must wait for the moments pass
    that was due when it was queued, not for the one step() has just queued behind the norm (which
    waits for that very fold: a deadlock). Bit-identical to whole updates."""
    import threading
    from megatrain_ds.streaming.landing import GradientLanding

    real = GradientLanding._land

    def slow(self, *args):
        time.sleep(0.03)  # before the landing task looks at the moments pass
        return real(self, *args)

    monkeypatch.setattr(GradientLanding, "_land", slow)
    out = {}
    runner = threading.Thread(
        target=lambda: out.update(d=_run(_config(True, ga=2), 4, layers_only=True)), daemon=True
    )
    runner.start()
    runner.join(timeout=300)
    assert not runner.is_alive(), "training with deferred moments deadlocked"
    l_w, s_w, _ = _run(_config(False, ga=2), 4, layers_only=True)
    l_d, s_d, _ = out["d"]
    assert l_w == l_d
    _assert_same(s_w, s_d)


@pytest.mark.parametrize("setting", ["auto", True])
def test_a_step_that_speculated_updates_whole_unless_deferral_is_forced(monkeypatch, setting):
    """Clipping quiet (speculation open): the layers not stepped during the backward are updated
    after the norm in one pass under "auto" (the AdamW thread's work bounds such a step, [Note:
    deferred moments]), in two under true; both train exactly as whole updates."""
    cfg_whole, cfg = _config(False, clip=1e9), _config(setting, clip=1e9)
    for c in (cfg_whole, cfg):
        c["megatrain"]["speculative_step"] = True
    l_w, s_w, _ = _run(cfg_whole, 6)
    # no update during the backward: every layer of a speculating step is left to the plain update
    # after the norm
    monkeypatch.setattr(HostAdamW, "final_landing", lambda self, i, sq: None)
    monkeypatch.setattr(HostAdamW, "final_resident_landing", lambda self, k, sq: None)
    real, seen = HostAdamW._layer_task, []
    monkeypatch.setattr(
        HostAdamW,
        "_layer_task",
        lambda self, i, decided, spec=None, defer=True: (
            seen.append((spec is not None, defer)) or real(self, i, decided, spec, defer)
        ),
    )
    l_d, s_d, opt = _run(cfg, 6)
    speculating = {defer for open_, defer in seen if open_}
    # 5 steps had a speculation open
    assert opt.policy.speculated == 0 and speculating == {setting is True}
    # the first step (none open) defers
    assert {defer for open_, defer in seen if not open_} == {True}
    assert l_w == l_d
    _assert_same(s_w, s_d)
