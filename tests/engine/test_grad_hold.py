"""``megatrain.gradient_hold: "gpu"`` ([Note: gradients held on the device] in grad_hold.py): the
streamed layers' gradients wait for the norm on the device, so fp32-master training keeps 12 host
bytes per parameter. It must train bit for bit as the host landing does (the update reads the same
bytes), take no host gradient buffer, and refuse what it does not combine with."""

import pytest
import torch

import megatrain_ds
from megatrain_ds.planning.config import ConfigError
from models import tiny_hf


def _config(hold: str, kernel: str = "native", **over) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "megatrain": {"gradient_hold": hold, "host_kernel": kernel, "gpu_optimizer_layers": 0},
    }
    cfg.update(over)
    return cfg


def _train(
    hold: str, kernel: str = "native", layers: int = 6, steps: int = 6, nan_step: int = 3, **over
):
    """``steps`` steps (clipping at 0.5 fires on some), the loss of step ``nan_step`` made NaN (a
    skipped step)."""
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=layers, seed=3), config=_config(hold, kernel, **over)
    )
    g = torch.Generator().manual_seed(0)
    losses, skipped = [], []
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 8), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        engine.backward(loss * float("nan") if step == nan_step else loss)
        engine.step()
        skipped.append(engine.skipped_steps)
    engine.synchronize()
    store = engine.store
    out = {
        "losses": losses,
        "skipped": skipped,
        "master": store.master.clone(),
        "m": store.exp_avg.clone(),
        "v": store.exp_avg_sq.clone(),
        "nbytes": store.nbytes(),
        "host": engine.host_memory()["total_bytes"],
        "grad_numel": store.grad.numel(),
        "max_train": store.max_train,
        "train": store.n_train,
        "grad_size": store.grad.element_size(),
        "held_on": None if store.hold is None else store.hold.buf.device,
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_held_gradients_train_bit_for_bit_as_the_host_landing(kernel):
    held, host = _train("gpu", kernel), _train("host", kernel)
    # the NaN step skipped in both
    assert held["skipped"] == host["skipped"] and host["skipped"][-1] == 1
    assert held["losses"] == host["losses"] and len(set(host["losses"])) == len(host["losses"])
    for name in ("master", "m", "v"):
        assert torch.equal(held[name], host[name]), name
    # no host gradient buffer: the slabs instead (3 of the largest layer), and host_memory() says so
    assert held["grad_numel"] == 0 and held["held_on"] is not None
    saved = host["grad_size"] * host["train"] - 3 * held["max_train"] * host["grad_size"]
    assert (
        saved > 0
        and host["nbytes"] - held["nbytes"] == saved
        and host["host"] - held["host"] == saved
    )


def test_held_gradients_refuse_what_they_do_not_combine_with(tmp_path):
    from megatrain_ds.planning.config import parse_config

    with pytest.raises(ConfigError, match="gradient_hold"):
        parse_config(_config("device"))
    with pytest.raises(ConfigError, match="gradient_hold.*gradient_accumulation_steps 1, got 2"):
        megatrain_ds.initialize(
            model=tiny_hf("llama"), config=_config("gpu", gradient_accumulation_steps=2)
        )
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    with pytest.raises(ConfigError, match="gradient_hold.*NVMe"):
        megatrain_ds.initialize(
            model=tiny_hf("llama"), config=_config("gpu", zero_optimization=nvme)
        )


@pytest.mark.gpu
def test_gpu_held_gradients_match_the_host_landing():
    """On a GPU (the copies on the hold's own stream, after the backward's end event), bf16: the
    same losses as the host landing to the GPU's run-to-run rounding (the embedding's backward adds
    atomically), no host gradient."""
    bf16 = {"bf16": {"enabled": True}}
    held, host = _train("gpu", **bf16), _train("host", **bf16)
    assert held["held_on"].type == "cuda" and held["grad_numel"] == 0
    assert held["skipped"] == host["skipped"]
    assert held["losses"] == pytest.approx(host["losses"], rel=1e-3)
    assert host["host"] - held["host"] == 2 * host["train"] - 3 * held["max_train"] * 2


def test_auto_holds_the_gradients_only_where_the_host_state_needs_it():
    """``gradient_hold: "auto"`` (the default) on a CUDA device: the host landing while the state
    fits the host budget with it; the hold when only the hold's 12 bytes/param fit (the planner and
    the engine share decisions.resolve)."""
    from megatrain_ds.planning import plan

    def planned(hold: str, budget_gib: float = 100.0):
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW"},
            "bf16": {"enabled": True},
            "megatrain": {"gradient_hold": hold, "host_memory_budget": budget_gib},
        }
        return plan.plan_model(
            tiny_hf("llama", layers=6), plan.load_train_config(cfg), device="cuda"
        )

    host, held = planned("host"), planned("gpu")
    assert not host.decisions.grad_hold and held.decisions.grad_hold
    assert held.host_need_bytes < host.host_need_bytes
    # it fits either way: the default landing, speculation on
    assert not planned("auto").decisions.grad_hold
    between = (held.host_need_bytes + host.host_need_bytes) / 2 / 2**30
    auto = planned("auto", between)
    assert auto.decisions.grad_hold and not auto.decisions.deferred_moments and auto.fits
    assert auto.host_need_bytes == held.host_need_bytes and any(
        "gradient_hold" in n for n in auto.notes
    )
    # fits neither way: no hold (the capacity check says what is short)
    below = held.host_need_bytes / 2 / 2**30
    assert not planned("auto", below).decisions.grad_hold
