"""Speculative optimizer stepping (megatrain_ds/optim/speculation.py) against plain PyTorch, fp32 on
CPU.

Each layer is stepped as its gradient lands, as if clipping did not fire; the norm then commits the
updates (bit-identical to the plain path) or rolls them back and redoes them with the true
coefficient. Checked: 20 steps with clipping firing on some steps and not on others and one
non-finite step, against torch AdamW + clip_grad_norm_; the counts of speculated and rolled-back
steps; bit-equality with speculation off when clipping never fires; a forward between backward() and
step() seeing the pre-step weights.
"""

import copy

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf

STEPS, LR, EPS = 20, 1e-3, 1e-6
NAN_STEP = 7


def _config(clip: float, ga: int = 1, **megatrain) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        # host AdamW
        "wall_clock_breakdown": True,
        "megatrain": {"gpu_optimizer_layers": 0, **megatrain},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "eps": EPS}},
    }


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (2, 10), generator=g) for _ in range(n)]


def _reference(model, batches, ga: int, clip: float, nan_step: int | None):
    """torch AdamW + clip_grad_norm_; the non-finite step is skipped (DeepSpeed's rule). Returns
    losses, pre-clip norms and the trained parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ga):
            ids = batches[step * ga + micro]
            loss = model(input_ids=ids, labels=ids).loss
            losses.append(loss.item())
            (loss * (float("nan") if step == nan_step else 1.0) / ga).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        norms.append(norm)
        if norm == norm:  # finite: step
            opt.step()
        opt.zero_grad()
    return losses, norms, dict(model.named_parameters())


def _train(engine, batches, ga: int, nan_step: int | None):
    losses = []
    for step in range(STEPS):
        for micro in range(ga):
            ids = batches[step * ga + micro]
            loss = engine(input_ids=ids, labels=ids).loss
            losses.append(loss.item())
            engine.backward(loss * (float("nan") if step == nan_step else 1.0))
            engine.step()
    return losses


# native rollback; torch's
@pytest.mark.parametrize("ga,kernel", [(1, "auto"), (2, "auto"), (2, "torch")])
def test_speculation_with_clipping_on_some_steps_and_a_skipped_step(ga, kernel):
    model = tiny_hf("llama")
    batches = _batches(STEPS * ga)
    _, free_norms, _ = _reference(copy.deepcopy(model), batches, ga, float("inf"), None)
    clip = sorted(free_norms)[STEPS // 2]  # about half the steps clip
    want_losses, norms, want = _reference(copy.deepcopy(model), batches, ga, clip, NAN_STEP)
    fired = [n != n or n + 1e-6 > clip for n in norms]  # clipped or skipped
    assert 3 <= sum(fired[1:]) <= STEPS - 4, "the data must clip on some steps and not on others"

    engine, *_ = megatrain_ds.initialize(
        model=model, config=_config(clip, ga, speculation_backoff=0, host_kernel=kernel)
    )
    got_losses = _train(engine, batches, ga, NAN_STEP)
    for k, (a, b) in enumerate(zip(got_losses, want_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"loss {k}: {a} vs {b}"
    masters = engine.master_state_dict()
    for name, p in want.items():
        err = (masters[name] - p.detach()).norm() / p.detach().norm()
        assert err <= 1e-5, f"{name}: {err:.2e}"
    # backoff 0: every step after the first may speculate; the non-finite step stops at its first
    # landing, so it steps no layer; a speculated step whose clipping fired is rolled back and
    # redone. A step counts as speculated when the AdamW thread started a layer before the norm task
    # closed the window: a race that load decides (on a loaded machine 17 of these 18 steps,
    # measured), so the counts are bounds here and the numbers above the proof
    policy = engine.optimizer.policy
    speculated = [s for s in range(1, STEPS) if s != NAN_STEP]
    assert len(speculated) // 2 <= policy.speculated <= len(speculated)
    assert 1 <= policy.rolled_back <= sum(fired[s] for s in speculated)
    assert engine.skipped_steps == 1
    breakdown = engine.last_step_breakdown()
    assert (
        breakdown["speculated_steps"] <= policy.speculated
        and "cpu_speculative_optimizer_s" in breakdown
    )


def test_committed_speculation_is_bit_identical_to_the_plain_step():
    """Clipping never fires: every speculated update is kept, and the weights and moments are
    bit-equal to a run without speculation (the same fused kernel on the same inputs, only
    earlier)."""
    batches = _batches(10)
    runs = []
    for speculate in (True, False):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama"), config=_config(1e9, speculative_step=speculate)
        )
        for ids in batches:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        runs.append(
            (
                engine.master_state_dict(),
                engine.store.exp_avg.clone(),
                engine.optimizer.policy.speculated,
            )
        )
    (a, ma, n_spec), (b, mb, n_plain) = runs
    # speculation is open on every step after the first, but a step counts as speculated only when a
    # layer was stepped before its norm: on a loaded machine the norm task sometimes wins every race
    # of a step (9 steps gave 8 on the 2-core machine, 4 runs in 12, at this tree and the one
    # before)
    assert 1 <= n_spec <= 9 and n_plain == 0
    assert all(torch.equal(a[k], b[k]) for k in a) and torch.equal(ma, mb)


def test_forward_between_backward_and_step_sees_the_pre_step_weights():
    """An eval forward after a speculating backward rolls the layers back first: its output equals
    the output of a run without speculation at that point, and training then goes on to the same
    weights."""
    batches = _batches(4)
    outs, finals = [], []
    for speculate in (True, False):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama"), config=_config(1e9, speculative_step=speculate)
        )
        for k, ids in enumerate(batches):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if k == 2:
                with torch.no_grad():
                    outs.append(engine(input_ids=batches[0]).logits)
            engine.step()
        finals.append(engine.master_state_dict())
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for k in finals[0]:
        assert (finals[0][k] - finals[1][k]).norm() <= 1e-5 * finals[1][k].norm(), k


def test_a_backlog_of_landings_is_taken_newest_first(monkeypatch):
    """[Note: newest landing first]: with the AdamW thread behind the landings (held from before a
    step's backward until every layer has landed), the waiting layers are taken most recent landing
    first (layer 0 first), not in landing order; the run stays bit-identical to one without
    speculation."""
    import threading

    from megatrain_ds.optim.optimizer import HostAdamW

    real, real_final = HostAdamW._speculative_update, HostAdamW.final_landing

    def run(speculate: bool):
        order, landed_all, this = [], threading.Event(), {}

        def spy(self, i, spec):
            # (the previous step's tasks may still run, skipping: not these)
            if spec is this.get("spec"):
                order.append(i)
            return real(self, i, spec)

        def final(self, i, sq):
            this.setdefault("spec", self._landing_spec)
            real_final(self, i, sq)
            if i == 0:
                landed_all.set()

        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=4), config=_config(1e9, speculative_step=speculate)
        )
        for step, ids in enumerate(_batches(4)):
            loss = engine(input_ids=ids, labels=ids).loss
            # a step that speculates (not the first): the AdamW thread waits, ahead of every task
            # of this backward and step, until layer 0 has landed
            if speculate and step == 3:
                monkeypatch.setattr(HostAdamW, "_speculative_update", spy)
                monkeypatch.setattr(HostAdamW, "final_landing", final)
                engine.optimizer.parts.opt_worker.submit(landed_all.wait, 10)
            engine.backward(loss)
            engine.step()
        monkeypatch.undo()
        out = engine.master_state_dict(), engine.store.exp_avg.clone()
        engine.destroy()
        return order, out

    # (rarely the tasks of this step take fewer than two: the scenario is run again)
    for _ in range(3):
        order, (a, ma) = run(True)
        if len(order) >= 2:
            break
    # newest first (landing order: 3, 2, 1, 0)
    assert order[:2] == [0, 1] and order == sorted(order)
    _, (b, mb) = run(False)
    assert all(torch.equal(a[k], b[k]) for k in a) and torch.equal(ma, mb)


def test_landings_after_step_are_still_stepped_before_the_norm(monkeypatch):
    """[Note: newest landing first]: on a GPU step() queues the step's tasks before the backward's
    last landings; their speculative tasks queue behind the step's first task, which waits for the
    norm. Here the last two landings are held 50 ms past step(): layer 1 is still stepped during
    that wait (await_decision), and the run stays bit-identical to one without speculation."""
    import time

    from megatrain_ds.streaming.landing import GradientLanding

    real_land = GradientLanding._land
    held = {"on": False}

    def late(self, i, *args, **kwargs):
        if held["on"] and i <= 1:
            # layer 1 after 50 ms, layer 0 after 100 ms: both after step() was queued
            time.sleep(0.05 * (2 - i))
        return real_land(self, i, *args, **kwargs)

    monkeypatch.setattr(GradientLanding, "_land", late)
    from megatrain_ds.optim.optimizer import HostAdamW

    real_close, done = HostAdamW._close_task, []

    def close(self, decided, spec):  # the step's last task: which layers the speculation stepped
        if held["on"] and spec is not None:
            done.extend(spec.done)
        return real_close(self, decided, spec)

    monkeypatch.setattr(HostAdamW, "_close_task", close)
    batches, runs = _batches(4), []
    for speculate in (True, False):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=4), config=_config(1e9, speculative_step=speculate)
        )
        for step, ids in enumerate(batches):
            held["on"] = speculate and step == 3
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            engine.synchronize()
        held["on"] = False
        runs.append((engine.master_state_dict(), engine.store.exp_avg.clone()))
        engine.destroy()
    assert 1 in done, done  # landed after step() was queued, stepped before the norm
    (a, ma), (b, mb) = runs
    assert all(torch.equal(a[k], b[k]) for k in a) and torch.equal(ma, mb)
