"""Compact optimizer state ([Note: compact moments], megatrain_ds/optim/host_update.py): DeepSpeed's
``bf16.bf16_optimizer_states`` beside ``bf16_master_weights_and_grads`` keeps the streamed layers'
Adam moments in bf16.

- The kernel equals torch's fused AdamW on fp32 copies of the moments followed by a copy back, bit
  for bit, in every layout the engine meets (bf16 gradient, fp32 accumulator), AdamW and Adam-L2,
  with and without a clip coefficient; its two deferred passes equal its whole update; the torch
  kernel's blocked path equals it.
- In the engine: 8 host bytes per trained streamed parameter with GA 1 (the plan agrees:
  tests/unit/test_plan.py), the native and torch kernels train bit-identically over 20 steps at GA 1
  and GA 2, the moments are bf16 numbers and differ from fp32 moments' run (the option acts), it
  learns, and a checkpoint resumes bit for bit.
- DeepSpeed's rules: the key requires bf16 masters; ``fp32_optimizer_states: false`` beside bf16
  masters means the same; not with the NVMe tier.
"""

import pytest
import torch

import megatrain_ds
from megatrain_ds.optim import host_update
from megatrain_ds.planning.config import ConfigError, parse_config
from megatrain_ds.optim.host_update import PHASE_MOMENTS, PHASE_WEIGHTS, adamw_scalars, fused_adam
from tests.models import tiny_hf, token_batches, train_lm

native = pytest.mark.skipif(
    host_update.native_library() is None,
    reason="no C compiler here: the native kernel cannot be built",
)


def _state(n: int, seed: int, grad_dtype, master_dtype):
    g = torch.Generator().manual_seed(seed)
    master = (torch.randn(n, generator=g) * 0.02).to(master_dtype)
    grad = (torch.randn(n, generator=g) * 0.01).to(grad_dtype)
    m = (torch.randn(n, generator=g) * 1e-3).bfloat16()
    v = (torch.rand(n, generator=g) * 1e-5).bfloat16()
    return master, grad, m, v


def _reference(master, grad, m, v, hp, coef, adam_w_mode):
    """torch's fused kernel on fp32 copies, the master and moments rounded back to their dtypes."""
    p, g, m32, v32 = (t.to(torch.float32, copy=True) for t in (master, grad, m, v))
    step, scale = adamw_scalars(hp, coef, torch.device("cpu"))
    fused_adam([p], [g], [m32], [v32], hp, step, scale, adam_w_mode)
    return p.to(master.dtype), m32.bfloat16(), v32.bfloat16()


# GA 1: the bf16 gradient home, the bf16 master (= the wire)
LAYOUTS = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),  # GA > 1: the fp32 accumulator
    # an fp32 master (the kernel allows it; the engine pairs bf16 with bf16)
    (torch.bfloat16, torch.float32),
]


@native
@pytest.mark.parametrize("grad_dtype,master_dtype", LAYOUTS)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("coef,step,wd", [(1.0, 1, 0.01), (0.37, 7, 0.0), (1 / 1024, 300, 0.1)])
def test_kernel_equals_torch_on_fp32_copies(grad_dtype, master_dtype, adam_w_mode, coef, step, wd):
    n = 40_013  # odd: torch's scalar tail too
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, step=step)
    master, grad, m, v = _state(n, 1, grad_dtype, master_dtype)
    want = _reference(master, grad, m, v, hp, coef, adam_w_mode)
    whole = [t.clone() for t in (master, m, v)]
    host_update.native_adam(whole[0], grad, whole[1], whole[2], hp, coef, adam_w_mode, threads=3)
    for got, exp, name in zip(whole, want, ("master", "exp_avg", "exp_avg_sq")):
        assert got.dtype == exp.dtype and torch.equal(got, exp), name
    assert not torch.equal(whole[1], m) and not torch.equal(whole[0], master)
    # the two passes: the weights first, the same moments after
    if host_update.can_defer(adam_w_mode, hp):
        parts = [t.clone() for t in (master, m, v)]
        host_update.native_adam(
            parts[0],
            grad,
            parts[1],
            parts[2],
            hp,
            coef,
            adam_w_mode,
            threads=3,
            phase=PHASE_WEIGHTS,
        )
        assert (
            torch.equal(parts[0], whole[0])
            and torch.equal(parts[1], m)
            and torch.equal(parts[2], v)
        )
        host_update.native_adam(
            parts[0],
            grad,
            parts[1],
            parts[2],
            hp,
            coef,
            adam_w_mode,
            threads=3,
            phase=PHASE_MOMENTS,
        )
        assert all(torch.equal(a, b) for a, b in zip(parts, whole))


@native
def test_torch_blocked_path_equals_native():
    """The fallback without a compiler (``host_kernel: torch``): blocks of fp32 copies,
    bit-identical."""
    n, hp = 70_001, dict(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=4)
    master, grad, m, v = _state(n, 2, torch.bfloat16, torch.bfloat16)
    runs = {}
    for kernel in ("native", "torch"):
        p, mm, vv = master.clone(), m.clone(), v.clone()
        host_update.update_segment(
            p,
            grad,
            mm,
            vv,
            0,
            n,
            hp,
            0.5,
            True,
            None,
            torch.empty(n),
            torch.empty(n),
            block=16_384,
            kernel=kernel,
        )
        runs[kernel] = (p, mm, vv)
    assert all(torch.equal(a, b) for a, b in zip(runs["native"], runs["torch"]))


@native
def test_kernel_refuses_mixed_moments():
    master, grad, m, v = _state(100, 3, torch.bfloat16, torch.bfloat16)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="both fp32 or both bf16"):
        host_update.native_adam(master, grad, m, v.float(), hp, 1.0, True)
    with pytest.raises(ValueError, match="both fp32 or both bf16"):
        host_update.native_adam(master, grad, m.half(), v.half(), hp, 1.0, True)


def _config(kernel="auto", ga=1, states=True, lr=3e-3, **mt):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": states,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "megatrain": {
            "host_kernel": kernel,
            "gpu_optimizer_layers": 0,
            "keep_activations": 0,
            **mt,
        },
    }


def _run(config, steps=20, seed=3):
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2, seed=seed), config=config)
    # two batches over and over: the loss falls as the model memorises them
    batches = token_batches(2)
    losses = train_lm(
        engine, [batches[k % 2] for k in range(steps * config["gradient_accumulation_steps"])]
    )
    engine.synchronize()
    store = engine.store
    out = (
        losses,
        {k: v.clone() for k, v in engine.master_state_dict().items()},
        store.exp_avg.clone(),
        store.exp_avg_sq.clone(),
    )
    engine.destroy()
    return out


def test_engine_bytes_and_moments():
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=_config())
    store = engine.store
    assert store.exp_avg.dtype == store.exp_avg_sq.dtype == store.master.dtype == torch.bfloat16
    # master = wire (2) + two bf16 moments (4) + bf16 gradient (2)
    assert store.nbytes() == 8 * store.n_train
    assert engine.host_memory()["total_bytes"] >= store.nbytes()
    engine.destroy()


@native
@pytest.mark.parametrize("ga", [1, 2])
def test_native_trains_as_torch_kernel_and_learns(ga):
    nat, tor = _run(_config("native", ga)), _run(_config("torch", ga))
    assert nat[0] == tor[0]
    assert all(torch.equal(nat[1][k], tor[1][k]) for k in nat[1])
    assert torch.equal(nat[2], tor[2]) and torch.equal(nat[3], tor[3])
    assert nat[0][-1] < nat[0][0] - 0.5  # it learns
    exact = _run(_config("native", ga, states=False))  # fp32 moments: the option acts
    assert exact[2].dtype == torch.float32 and not torch.equal(exact[2].bfloat16(), nat[2])
    assert abs(exact[0][-1] - nat[0][-1]) < 0.1 * exact[0][0]  # and trains about as well


def test_checkpoint_resume_is_exact(tmp_path):
    full = _run(_config(), steps=4)
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2, seed=3), config=_config())
    batches = [token_batches(2)[k % 2] for k in range(4)]  # as _run's
    train_lm(engine, batches[:2])
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.destroy()
    optim = torch.load(
        tmp_path / "t" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False
    )
    saved = optim["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    assert saved and all(
        s[k].dtype == torch.float32 for s in saved.values() for k in ("exp_avg", "exp_avg_sq")
    )
    # (DeepSpeed's layout holds fp32 moments: the bf16 ones widen exactly, and round back to
    # themselves on load)
    resumed, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2, seed=3), config=_config()
    )
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert train_lm(resumed, batches[2:]) == full[0][2:]
    resumed.synchronize()
    assert torch.equal(resumed.store.exp_avg, full[2]) and torch.equal(
        resumed.store.exp_avg_sq, full[3]
    )
    got = resumed.master_state_dict()
    assert all(torch.equal(got[k], full[1][k]) for k in full[1])
    resumed.destroy()


def test_deepspeed_rules():
    base = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with pytest.raises(
        ConfigError, match="bf16_optimizer_states requires bf16.bf16_master_weights_and_grads"
    ):
        parse_config({**base, "bf16": {"enabled": True, "bf16_optimizer_states": True}}, warn=False)
    masters = {"enabled": True, "bf16_master_weights_and_grads": True}
    assert not parse_config({**base, "bf16": masters}, warn=False).bf16_moments  # never the default
    assert parse_config(
        {**base, "bf16": {**masters, "bf16_optimizer_states": True}}, warn=False
    ).bf16_moments
    off = {"type": "AdamW", "params": {"lr": 1e-3, "fp32_optimizer_states": False}}
    assert parse_config({**base, "optimizer": off, "bf16": masters}, warn=False).bf16_moments
    fp32_masters = parse_config({**base, "optimizer": off, "bf16": {"enabled": True}}, warn=False)
    assert not fp32_masters.bf16_moments
    assert any(
        "fp32_optimizer_states=false: the Adam moments stay fp32" in n
        for n in fp32_masters.not_acted_on
    )
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ConfigError, match="bf16_optimizer_states.*nvme"):
        parse_config(
            {**base, "bf16": {**masters, "bf16_optimizer_states": True}, "zero_optimization": nvme},
            warn=False,
        )
