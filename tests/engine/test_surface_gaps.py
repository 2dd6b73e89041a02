"""Gaps the survey found (docs/deepspeed_surface.md), closed: each test names the script behaviour
it stands for.

1. ``optimizer.overflow`` / ``cur_scale`` / ``loss_scale``: accelerate's
   ``DeepSpeedOptimizerWrapper`` reads ``step_was_skipped`` from ``optimizer.overflow``, but only
   when the attribute exists.
2. ``engine.training_dataloader``: the loader ``initialize(training_data=...)`` built.
3. ``deepspeed.comm`` through the alias: every name DeepSpeed's comm has (``all_gather``,
   ``broadcast``, ``ReduceOp``, ...), in a world of one.
4. An LR scheduler built on the client optimizer: no torch warning "lr_scheduler.step() before
   optimizer.step()".
5. ``deepspeed.utils.safe_get/set_full_fp32_param``, ``safe_get_full_grad``,
   ``safe_get/set_full_optimizer_state`` on megatrain_ds's parameters, through the alias and through
   real DeepSpeed's own functions: equal to a plain torch AdamW run.
6. ``deepspeed.__version__`` through the alias is the installed DeepSpeed's (version gates pass as
   they would); megatrain_ds's own version is ``MEGATRAIN_VERSION``.
"""

import copy
import importlib.metadata
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import megatrain_ds
import megatrain_ds as deepspeed
from tests.models import tiny_hf

REPO = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}}


def _ids(seed):
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(seed))


def _step(engine, seed, poison=1.0):
    ids = _ids(seed)
    engine.backward(engine(input_ids=ids, labels=ids).loss * poison)
    engine.step()


def _rel(got, want):
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return float((got - want).norm() / max(float(want.norm()), 1e-12))


# ----------------------------------------------------- 1. optimizer.overflow, cur_scale, loss_scale
@pytest.mark.parametrize("precision, scale", [("fp16", 2.0**8), ("bf16", 1.0), ("fp32", 1.0)])
def test_overflow_and_loss_scale_as_accelerate_reads_them(precision, scale, monkeypatch):
    import accelerate.optimizer
    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    # the wrapper's base class asks accelerate's process-wide state singletons for nothing it needs
    # here
    monkeypatch.setattr(accelerate.optimizer, "AcceleratorState", lambda: None)
    monkeypatch.setattr(accelerate.optimizer, "GradientState", lambda: None)
    blocks = {
        "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}},
        "bf16": {"bf16": {"enabled": True}},
        "fp32": {},
    }
    engine, optimizer, _, _ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2), config={**BASE, "optimizer": ADAMW, **blocks[precision]}
    )
    # what accelerate.prepare makes of the engine's optimizer
    wrapper = DeepSpeedOptimizerWrapper(optimizer)
    assert optimizer.overflow is False and wrapper.step_was_skipped is False
    assert optimizer.cur_scale == optimizer.loss_scale == scale
    _step(engine, 0)
    assert optimizer.overflow is False and wrapper.step_was_skipped is False
    _step(engine, 1, poison=float("nan"))  # skipped, as DeepSpeed skips it
    assert engine.skipped_steps == 1 and not engine.was_step_applied()
    assert optimizer.overflow is True and wrapper.step_was_skipped is True
    assert (
        optimizer.cur_scale == optimizer.loss_scale == (scale / 2 if precision == "fp16" else 1.0)
    )
    _step(engine, 2)
    assert optimizer.overflow is False and wrapper.step_was_skipped is False
    engine.destroy()


# ---------------------------------------------------------------- 2. engine.training_dataloader
def test_training_dataloader_is_the_loader_initialize_built():
    data = [torch.randint(0, 256, (10,)) for _ in range(8)]
    engine, _, loader, _ = megatrain_ds.initialize(
        model=tiny_hf("llama"), config={**BASE, "optimizer": ADAMW}, training_data=data
    )
    assert loader is not None and engine.training_dataloader is loader
    engine.destroy()
    engine, _, loader, _ = megatrain_ds.initialize(
        model=tiny_hf("llama"), config={**BASE, "optimizer": ADAMW}
    )
    assert loader is None and engine.training_dataloader is None
    engine.destroy()


# -------------------------------------------------------------- 3. deepspeed.comm through the alias
def test_comm_forwards_deepspeeds_other_names_in_a_world_of_one():
    import deepspeed.comm as real_comm

    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama"), config={**BASE, "optimizer": ADAMW}
    )
    dist = deepspeed.comm  # `from deepspeed import comm as dist` in a script with the alias import
    assert dist.is_available() and dist.is_initialized()
    assert dist.ReduceOp is real_comm.ReduceOp and dist.new_group is real_comm.new_group
    t = torch.tensor([1.0, 2.0, 3.0])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # DeepSpeed's enum, into megatrain_ds's all_reduce
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, op=torch.distributed.ReduceOp.SUM)  # torch's, as before
    # one process: the tensor already holds the result
    assert torch.equal(t, torch.tensor([1.0, 2.0, 3.0]))
    gathered = [torch.zeros(3)]
    dist.all_gather(gathered, t)
    assert torch.equal(gathered[0], t)
    out = torch.zeros(3)
    dist.all_gather_into_tensor(out, t)
    assert torch.equal(out, t)
    b = torch.tensor([7.0])
    dist.broadcast(b, src=0)
    assert b.item() == 7.0 and dist.get_global_rank(torch.distributed.group.WORLD, 0) == 0
    with pytest.raises(AttributeError, match="get_backend"):  # DeepSpeed's comm has none either
        dist.get_backend()
    with pytest.raises(AttributeError, match="no_such_collective"):
        dist.no_such_collective
    # dunder probes (inspect, pytest) never import or forward
    assert not hasattr(dist, "__wrapped__")
    engine.destroy()


# ------------------------------------------------------------- 4. scheduler on the client optimizer
@pytest.mark.parametrize("who_steps", ["engine", "script"])
def test_scheduler_on_the_client_optimizer_sees_the_engines_step(who_steps):
    """HF ``get_scheduler`` / torch schedulers built on the script's optimizer before
    ``initialize``: stepped by the engine (accelerate passes it as ``lr_scheduler=``) or by the
    script after ``engine.step()``."""
    model = tiny_hf("llama", layers=2)
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0 / (step + 1))
    engine, optimizer, _, scheduler = megatrain_ds.initialize(
        model=model,
        optimizer=client,
        config=BASE,
        lr_scheduler=schedule if who_steps == "engine" else None,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            _step(engine, seed)
            if who_steps == "script":
                schedule.step()
    torch_warnings = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
    assert torch_warnings == []
    assert engine.get_lr() == [pytest.approx(1e-2 / 4)] and client.param_groups[0][
        "lr"
    ] == pytest.approx(1e-2 / 4)
    engine.destroy()


# ------------------------------------------------------ 5. deepspeed.utils.safe_* on our parameters
UTILS_PATHS = {
    "alias": lambda: megatrain_ds.utils,
    "deepspeed": lambda: sys.modules["deepspeed.utils"],
}


# where the optimizer state lives: host buffers, or (gpu_optimizer_layers, DeepSpeed's
# offload_optimizer.ratio < 1) layer 0's and the resident parameters' on the engine's device -- the
# CPU here, the same code paths
STATE = {"host": {}, "device_state": {"megatrain": {"gpu_optimizer_layers": 1}}}


def _pair(seed=0, ga=1, state="host"):
    """A tiny Llama as an engine (fp32, AdamW, clipping) and a plain copy with torch's AdamW."""
    model = tiny_hf("llama", layers=2, seed=seed)
    ref = copy.deepcopy(model)
    engine, *_ = megatrain_ds.initialize(
        model=model,
        config={
            **BASE,
            "gradient_clipping": 1.0,
            "gradient_accumulation_steps": ga,
            "optimizer": ADAMW,
            **STATE[state],
        },
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    return engine, ref, opt


def _from_engine(ref, engine):
    """Start the plain copy from the engine's weights (as tests/engine/test_paths.py does each
    step): gradients then agree to rounding instead of drifting apart with Adam's amplification of
    ~0 gradients."""
    masters = engine.master_state_dict()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(masters[name])


def _ref_backward(ref, seed, ga=1):
    ids = _ids(seed)
    (ref(input_ids=ids, labels=ids).loss / ga).backward()


def _ref_step(ref, opt):
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("state", list(STATE))
@pytest.mark.parametrize("path", list(UTILS_PATHS))
def test_safe_get_full_state_equals_torch_adamw(path, state):
    # real DeepSpeed's functions, reached by `from deepspeed.utils import`
    import deepspeed.utils  # noqa: F401

    utils = UTILS_PATHS[path]()
    engine, ref, opt = _pair(state=state)
    assert (engine.layer_states.device_state is not None) == (state == "device_state")
    names = dict(ref.named_parameters())
    for seed in range(2):
        _from_engine(ref, engine)
        _step(engine, seed)
        _ref_backward(ref, seed)
        _ref_step(ref, opt)
    _from_engine(ref, engine)
    # the third step: gradients between backward and step (DeepSpeed's contract for
    # safe_get_full_grad)
    ids = _ids(2)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    _ref_backward(ref, 2)
    masters = engine.master_state_dict()
    for name, p in engine.module.named_parameters():
        want = names[name]
        assert torch.equal(utils.safe_get_full_fp32_param(p).cpu(), masters[name]), name
        grad = utils.safe_get_full_grad(p)
        assert grad.dtype == torch.float32 and grad.shape == want.shape
        assert _rel(grad, want.grad) < 1e-5, name  # pre-clip, as the gradient autograd made
        for key in ("exp_avg", "exp_avg_sq"):
            assert _rel(utils.safe_get_full_optimizer_state(p, key), opt.state[want][key]) < 1e-5, (
                name,
                key,
            )
    engine.step()
    _ref_step(ref, opt)
    streamed = engine.module.model.layers[1].mlp.up_proj.weight
    # after the step: no gradient until the next backward
    assert utils.safe_get_full_grad(streamed) is None
    assert (
        _rel(utils.safe_get_full_fp32_param(streamed), names["model.layers.1.mlp.up_proj.weight"])
        < 1e-5
    )
    engine.destroy()
    with pytest.raises((ValueError, AttributeError), match="no longer|not trained"):
        utils.safe_get_full_fp32_param(streamed)


@pytest.mark.parametrize("state", list(STATE))
def test_safe_set_full_state_reaches_forward_and_optimizer(state):
    """Writing a master and the moments (a streamed and a resident parameter), then stepping: the
    same weights as torch's AdamW after the same writes."""
    from megatrain_ds import utils

    engine, ref, opt = _pair(state=state)
    names = dict(ref.named_parameters())
    _step(engine, 0)
    _ref_backward(ref, 0)
    _ref_step(ref, opt)
    # the first step's AdamW amplifies rounding in gradients below eps (an element of layer 0's
    # v_proj at 1e-7: 2e-5 of that tensor after one step at lr 1e-2): the second step starts the
    # plain copy from the engine's weights
    _from_engine(ref, engine)
    g = torch.Generator().manual_seed(3)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        p, want = engine.module.get_parameter(name), names[name]
        value = torch.randn(want.shape, generator=g) * 0.02
        m, v = (
            torch.randn(want.shape, generator=g) * 1e-3,
            torch.rand(want.shape, generator=g) * 1e-5,
        )
        utils.safe_set_full_fp32_param(p, value)
        utils.safe_set_full_optimizer_state(p, m, "exp_avg")
        utils.safe_set_full_optimizer_state(p, v, "exp_avg_sq")
        assert torch.equal(utils.safe_get_full_fp32_param(p).cpu(), value)
        assert torch.equal(utils.safe_get_full_optimizer_state(p, "exp_avg").cpu(), m)
        with torch.no_grad():
            want.copy_(value)
        opt.state[want]["exp_avg"].copy_(m)
        opt.state[want]["exp_avg_sq"].copy_(v)
    with pytest.raises(KeyError, match="exp_avg"):
        utils.safe_get_full_optimizer_state(p, "momentum_buffer")
    ids = _ids(1)
    loss = engine(input_ids=ids, labels=ids).loss  # the forward streams the written weights
    engine.backward(loss)
    engine.step()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    _ref_step(ref, opt)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    state = engine.master_state_dict()
    assert max(_rel(state[n], w) for n, w in names.items()) < 1e-5
    engine.destroy()


def test_writing_one_weight_of_a_gpu_held_layer_keeps_the_others():
    """gpu_optimizer_layers: the layer's master lives on the device and its host copy is stale
    between checkpoints. A write to one parameter (GatheredParameters with modifier_rank,
    safe_set_full_fp32_param) used to copy the whole stale host layer back over the device master:
    the layer's other weights lost their recent updates."""
    engine, *_ = _pair(state="device_state")
    _step(engine, 0)
    _step(engine, 1)  # the host copy of layer 0 now lags the device master
    engine.synchronize()  # step() returns before the queued update of layer 0 has run
    device_master = engine.layer_states.device_state.master_of(0)
    before = device_master.clone()
    q_proj = engine.module.model.layers[0].self_attn.q_proj.weight
    n = q_proj.ds_numel  # the layout puts q_proj first
    with megatrain_ds.zero.GatheredParameters([q_proj], modifier_rank=0):
        q_proj.data.mul_(2)
    assert torch.equal(device_master[n:], before[n:])
    assert torch.equal(device_master[:n], before[:n] * 2)
    engine.destroy()


def test_safe_get_full_grad_with_accumulation_and_frozen_parameters():
    """GA 2: the summed (1/GA-scaled) gradient after the second micro-batch; a frozen parameter has
    no gradient and no moments."""
    from megatrain_ds import utils

    model = tiny_hf("llama", layers=2)
    frozen_name = "model.layers.0.mlp.down_proj.weight"
    model.get_parameter(frozen_name).requires_grad_(False)
    ref = copy.deepcopy(model)
    engine, *_ = megatrain_ds.initialize(
        model=model, config={**BASE, "gradient_accumulation_steps": 2, "optimizer": ADAMW}
    )
    for seed in (0, 1):
        ids = _ids(seed)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        _ref_backward(ref, seed, ga=2)
    for name, want in ref.named_parameters():
        p = engine.module.get_parameter(name)
        if name == frozen_name:
            assert (
                utils.safe_get_full_grad(p) is None
                and utils.safe_get_full_optimizer_state(p, "exp_avg") is None
            )
            assert torch.equal(utils.safe_get_full_fp32_param(p).cpu(), want)
        else:
            assert _rel(utils.safe_get_full_grad(p), want.grad) < 1e-5, name
    engine.step()
    engine.destroy()


def test_utils_forwards_deepspeeds_other_names():
    import deepspeed.utils as real_utils

    assert megatrain_ds.utils.logger is real_utils.logger
    assert megatrain_ds.utils.RepeatingLoader is real_utils.RepeatingLoader
    assert megatrain_ds.utils.set_z3_leaf_modules is real_utils.set_z3_leaf_modules
    with pytest.raises(AttributeError, match="no_such_helper"):
        megatrain_ds.utils.no_such_helper
    # not an engine's parameter: DeepSpeed's own answer (None without ZeRO)
    plain = torch.nn.Linear(2, 2)
    assert megatrain_ds.utils.safe_get_full_fp32_param(plain.weight) is None


# ---------------------------------------------------------------- 6. __version__
def test_version_is_the_installed_deepspeeds_and_megatrain_version_is_ours(tmp_path):
    from packaging.version import Version

    installed = importlib.metadata.version("deepspeed")
    assert deepspeed.__version__ == deepspeed.version == installed
    assert Version(deepspeed.__version__) >= Version("0.16")  # OpenRLHF / trl style gates pass
    # (tomllib is Python 3.11+; the package supports 3.10)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert megatrain_ds.MEGATRAIN_VERSION == re.search(
        r'^version = "([^"]+)"', pyproject, re.M
    ).group(1)
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama"), config={**BASE, "optimizer": ADAMW}
    )
    _step(engine, 0)
    engine.save_checkpoint(str(tmp_path), tag="t")
    states = torch.load(
        tmp_path / "t" / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False
    )
    # ds_version: the DeepSpeed whose format the files follow (its zero_to_fp32 prints it)
    assert (
        states["ds_version"] == installed
        and states["megatrain_version"] == megatrain_ds.MEGATRAIN_VERSION
    )
    _, client = engine.load_checkpoint(str(tmp_path), tag="t")
    assert "megatrain_version" not in client
    engine.destroy()
