"""Drop-in correctness, config / arguments / precision: never silently different from DeepSpeed.

One process is a world; WORLD_SIZE > 1 is refused; defaults come from the installed DeepSpeed;
values are validated at initialize as DeepSpeed's own config models validate them; accepted settings
megatrain_ds does not act on are named in one warning; a step with non-finite gradients is skipped
in every precision, as DeepSpeed skips it.
"""

import copy
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import megatrain_ds
from megatrain_ds.planning.config import ConfigError, parse_config
from megatrain_ds.optim.loss_scale import LossScaleAtMinimumError, LossScaler, cast_inputs_half
from tests.models import PlainBlock, tiny_hf

REPO = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}}


def _ids(seed):
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(seed))


def _assert_matches_torch(engine, ref, rtol=1e-5):
    """Relative error of all masters vs the torch reference's parameters (the norm of the difference
    over the norm, as tests/engine/test_equivalence.py: elementwise, Adam amplifies rounding where a
    gradient is ~0)."""
    state, want = engine.master_state_dict(), dict(ref.named_parameters())
    got = torch.cat([state[n].flatten() for n in want]).double()
    ref_flat = torch.cat([p.detach().flatten() for p in want.values()]).double()
    assert ((got - ref_flat).norm() / ref_flat.norm()).item() < rtol


def _run_python(code: str) -> dict:
    """``code`` in a fresh interpreter without launcher variables; its last stdout line is JSON."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "LOCAL_WORLD_SIZE",
        )
    }
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- 1. one process is a world
def test_init_distributed_makes_a_world_of_one_in_a_fresh_process():
    got = _run_python("""
        import json, os
        import megatrain_ds as deepspeed
        deepspeed.init_distributed()
        import torch.distributed as dist
        import deepspeed.comm as ds_comm
        print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                          "ds": ds_comm.is_initialized(), "ds_rank": ds_comm.get_rank(),
                          "local_rank": os.environ.get("LOCAL_RANK")}))
    """)
    assert got == {"rank": 0, "world": 1, "ds": True, "ds_rank": 0, "local_rank": "0"}


def test_initialize_leaves_torch_distributed_initialized_in_a_fresh_process():
    got = _run_python("""
        import json
        import torch.distributed as dist
        import megatrain_ds as deepspeed
        from tests.models import PlainLM
        before = dist.is_initialized()
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}
        engine, *_ = deepspeed.initialize(model=PlainLM(), config=config)
        import deepspeed.comm as ds_comm
        deepspeed.init_distributed()  # idempotent afterwards
        print(json.dumps({"before": before, "rank": dist.get_rank(), "world": dist.get_world_size(),
                          "ds": ds_comm.is_initialized()}))
        engine.destroy()
    """)
    assert got == {"before": False, "rank": 0, "world": 1, "ds": True}


def test_world_of_one_is_idempotent_and_a_second_engine_works():
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    megatrain_ds.init_distributed()
    megatrain_ds.init_distributed()
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    assert ds_comm.is_initialized() and ds_comm.get_world_size() == 1
    policy, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2), config={**BASE, "optimizer": ADAMW}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference engine's "no optimizer" warning
        reference, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=BASE)
    ids = _ids(0)
    policy.backward(policy(input_ids=ids, labels=ids).loss)
    policy.step()
    with torch.no_grad():
        assert torch.isfinite(reference(input_ids=ids, labels=ids).loss)
    assert dist.get_world_size() == 1
    policy.destroy(), reference.destroy()


# ---------------------------------------------------------------- 2. several processes: refused
def test_world_size_above_one_without_a_launcher_is_a_clear_error(monkeypatch):
    """WORLD_SIZE 2 set by hand, no launcher's rendezvous: the error names what is missing (no
    hang): MASTER_ADDR, or, when an earlier test left a process group of one, the mismatch with
    WORLD_SIZE."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises((ValueError, RuntimeError), match="MASTER_ADDR|WORLD_SIZE is 2"):
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config={**BASE, "optimizer": ADAMW}
        )


def test_batch_triple_uses_the_world_size():
    """train_batch_size = micro x GA x world, as DeepSpeed: a triple that holds for one process only
    names the world size."""
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
    }
    assert parse_config(cfg, world_size=1).train_batch_size == 4
    with pytest.raises(ConfigError, match="world size 2"):
        parse_config(cfg, world_size=2)
    c = parse_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, world_size=2)
    assert (c.micro_batch_size, c.gradient_accumulation_steps) == (2, 2)


# --------------------------------------------------------- 3. defaults from the installed DeepSpeed
def test_defaults_follow_the_installed_deepspeed(monkeypatch):
    from deepspeed.runtime import constants
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    c = parse_config(BASE)
    assert c.gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT
    assert c.steps_per_print == (
        math.inf if constants.STEPS_PER_PRINT_DEFAULT is None else constants.STEPS_PER_PRINT_DEFAULT
    )
    assert c.wall_clock_breakdown == constants.WALL_CLOCK_BREAKDOWN_DEFAULT
    ds16 = DeepSpeedFP16Config(enabled=True)
    s = parse_config({**BASE, "fp16": {"enabled": True}}).loss_scaling
    assert (s.scale, s.window, s.hysteresis, s.min_scale, s.consecutive_hysteresis, s.dynamic) == (
        2.0**ds16.initial_scale_power,
        ds16.loss_scale_window,
        ds16.hysteresis,
        ds16.min_loss_scale,
        ds16.consecutive_hysteresis,
        ds16.loss_scale == 0,
    )
    monkeypatch.setattr(constants, "GRADIENT_CLIPPING_DEFAULT", 0.25)  # another DeepSpeed version
    assert parse_config(BASE).gradient_clipping == 0.25


def test_optimizer_defaults_are_deepspeeds_adam():
    import inspect

    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    ours = megatrain_ds.OptimizerSettings()
    for cls in (DeepSpeedCPUAdam, FusedAdam):
        p = inspect.signature(cls.__init__).parameters
        assert (ours.lr, ours.betas, ours.eps, ours.weight_decay) == (
            p["lr"].default,
            p["betas"].default,
            p["eps"].default,
            p["weight_decay"].default,
        ), cls
    # torch_adam: DeepSpeed builds torch.optim.AdamW, whose own default weight decay applies
    c = parse_config({**BASE, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    assert c.optimizer.weight_decay == torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]


def test_run_without_gradient_clipping_key_clips_at_deepspeeds_default():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    ref = tiny_hf("llama", layers=2)
    engine, *_ = megatrain_ds.initialize(
        model=copy.deepcopy(ref), config={**BASE, "optimizer": ADAMW}
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    norms = []
    for seed in range(3):
        ids = _ids(seed)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        ref(input_ids=ids, labels=ids).loss.backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(ref.parameters(), GRADIENT_CLIPPING_DEFAULT))
        )
        opt.step()
        opt.zero_grad()
    assert max(norms) > GRADIENT_CLIPPING_DEFAULT  # the clip fired
    _assert_matches_torch(engine, ref)
    engine.destroy()


# ---------------------------------------------------------------- 4. values validated at initialize
@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
        ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
        ({"fp16": {"enabled": 2}}, "fp16.enabled"),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"gradient_accumulation_steps": -2}, "gradient_accumulation_steps"),
        ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu"),
        ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu"),
        ({"steps_per_print": 0}, "steps_per_print"),
        ({"wall_clock_breakdown": "false"}, "wall_clock_breakdown"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}},
            "optimizer.params.betas",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}}, "optimizer.params.eps"),
        (
            {"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}},
            "optimizer.params.weight_decay",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"adam_w_mode": "false"}}},
            "optimizer.params.adam_w_mode",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
        ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size"),
    ],
)
def test_bad_values_are_errors_naming_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config({**BASE, **cfg})


def test_bad_values_fail_at_initialize_not_at_the_first_step():
    with pytest.raises(ConfigError, match=r"optimizer\.params\.betas"):
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2),
            config={**BASE, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
        )


@pytest.mark.parametrize("value", ["true", "True", "1", 1, "yes", "false", 0, "off"])
def test_precision_flags_are_read_as_deepspeed_reads_them(value):
    """What DeepSpeed's pydantic model makes of ``fp16.enabled`` / ``bf16.enabled``, we make of
    it."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    assert parse_config({**BASE, "fp16": {"enabled": value}}).compute_dtype == (
        "fp16" if DeepSpeedFP16Config(enabled=value).enabled else "fp32"
    )
    assert parse_config({**BASE, "bf16": {"enabled": value}}).compute_dtype == (
        "bf16" if DeepSpeedBF16Config(enabled=value).enabled else "fp32"
    )


def test_config_both_in_args_and_in_the_call_is_an_error():
    import argparse

    args = argparse.Namespace(deepspeed_config={**BASE}, local_rank=-1)
    with pytest.raises(ConfigError, match="both in args.deepspeed_config"):
        megatrain_ds.initialize(args=args, model=tiny_hf("llama", layers=2), config=BASE)


# ------------------------------------------------------------ 5. accepted-then-ignored: act or warn
def test_settings_not_acted_on_are_named_in_one_warning():
    class Mpu:
        def get_model_parallel_world_size(self):
            return 1

        def get_data_parallel_world_size(self):
            return 1

    cfg = {
        **BASE,
        "compile": {"deepcompile": True},
        "checkpoint": {"load_universal": True, "tag_validation": "Fail"},
        "pipeline": {"stages": 2},
        "prescale_gradients": True,
        "flops_profiler": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
        "bf16": {"enabled": True, "check_grad_overflow": False},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, _ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config=cfg, mpu=Mpu()
        )
    ours = [
        str(w.message)
        for w in caught
        if "megatrain_ds does not implement or act on" in str(w.message)
    ]
    assert len(ours) == 1, ours
    for key in (
        "compile (deepcompile)",
        "checkpoint.load_universal",
        "pipeline (stages)",
        "flops_profiler",
        "offload_param.device=nvme",
        "bf16.check_grad_overflow",
        "mpu:",
        "no optimizer",
        "engine.step() will not update",
    ):
        assert key in ours[0], key
    # no effect in one process
    assert "prescale_gradients" not in ours[0] and "tag_validation" not in ours[0]
    assert optimizer is None
    engine.destroy()


def test_model_parallel_mpu_is_an_error():
    class Mpu:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(NotImplementedError, match="model_parallel_world_size=2"):
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config={**BASE, "optimizer": ADAMW}, mpu=Mpu()
        )


def test_fp16_auto_cast_is_deepspeeds_input_cast():
    from deepspeed.runtime.engine import DeepSpeedEngine

    class Caster:  # DeepSpeed's own method, on a stand-in self
        _cast_inputs_half = DeepSpeedEngine._cast_inputs_half

    inputs = (
        torch.ones(2),
        [torch.zeros(1, dtype=torch.float64), torch.arange(3)],
        {"m": torch.ones(1)},
        3,
    )
    want, got = Caster()._cast_inputs_half(inputs), cast_inputs_half(inputs)
    flat = lambda x: [  # noqa: E731
        t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)
    ]
    assert (
        [t.dtype for t in flat(got)]
        == [t.dtype for t in flat(want)]
        == [torch.float16, torch.float16, torch.int64, torch.float16]
    )
    assert parse_config({**BASE, "fp16": {"enabled": True, "auto_cast": True}}).fp16_auto_cast
    assert not parse_config({**BASE, "fp16": {"enabled": True}}).fp16_auto_cast


class FloatLM(nn.Module):
    """Takes a float tensor (B, S, 8), not token ids: what fp16.auto_cast is for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(PlainBlock(32) for _ in range(2))
        self.head = nn.Linear(32, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(x.dtype)
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_engine_forward_casts_float_inputs_under_fp16_auto_cast():
    """Needs the engine's forward to read ``TrainConfig.fp16_auto_cast`` (engine.py, forward)."""
    model = FloatLM()
    engine, *_ = megatrain_ds.initialize(
        model=model,
        config={**BASE, "optimizer": ADAMW, "fp16": {"enabled": True, "auto_cast": True}},
    )
    out = engine(torch.randn(2, 5, 8))
    assert model.seen == [torch.float16] and out.dtype == torch.float16
    engine.destroy()


def test_zero_init_builds_in_deepspeeds_dtype():
    with megatrain_ds.zero.Init(dtype=torch.bfloat16):
        model = tiny_hf("llama", layers=2)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with megatrain_ds.zero.Init(config_dict_or_path={**BASE, "fp16": {"enabled": "true"}}):
        half = nn.Linear(4, 4)
    with megatrain_ds.zero.Init(config_dict_or_path=BASE):
        full = nn.Linear(4, 4)
    assert half.weight.dtype == torch.float16 and full.weight.dtype == torch.float32
    assert (
        torch.get_default_dtype() == torch.float32 and nn.Linear(2, 2).weight.dtype == torch.float32
    )
    ref = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    engine, *_ = megatrain_ds.initialize(model=model, config={**BASE, "optimizer": ADAMW})
    masters = engine.master_state_dict()  # fp32 masters start from the bf16 values
    assert all(torch.equal(masters[n], ref[n]) for n in masters)
    ids = _ids(0)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.destroy()


def test_zero_init_nvme_and_checkpointing_configure_warn():
    with pytest.warns(UserWarning, match="remote_device='nvme'"):
        megatrain_ds.zero.Init(remote_device="nvme")
    with pytest.warns(UserWarning, match="remote_device='nvme'"):
        megatrain_ds.zero.Init(
            config_dict_or_path={
                **BASE,
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme", "nvme_path": "/x"},
                },
            }
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megatrain_ds.checkpointing.configure(
            None, partition_activations=True, checkpoint_in_cpu=True
        )
        megatrain_ds.checkpointing.configure(None, partition_activations=False)
    assert len(caught) == 1
    assert "partition_activations" in str(caught[0].message) and "checkpoint_in_cpu" in str(
        caught[0].message
    )


def test_engine_dataloader_gives_deepspeeds_batches():
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    data = torch.utils.data.TensorDataset(torch.arange(11))
    for drop_last in (False, True):
        engine, _, loader, _ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2),
            training_data=data,
            config={**BASE, "optimizer": ADAMW, "dataloader_drop_last": drop_last},
        )
        ds_loader = DeepSpeedDataLoader(
            data,
            batch_size=2,
            pin_memory=False,
            local_rank=0,
            tput_timer=None,
            num_local_io_workers=0,
            data_parallel_world_size=1,
            data_parallel_rank=0,
            dataloader_drop_last=drop_last,
        )
        for _ in range(2):  # two epochs: DeepSpeed never reshuffles
            ours = [b[0].tolist() for b in loader]
            assert ours == [b[0].tolist() for b in ds_loader]
        assert len(ours) == (5 if drop_last else 6)
        engine.destroy()


# ------------------------------------------------------------ 6. non-finite gradients skip the step
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}


def _engine(precision):
    cfg = {
        **BASE,
        "gradient_clipping": 1.0,
        "optimizer": ADAMW,
        **PRECISIONS[precision],
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
        },
    }
    engine, _, _, scheduler = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=cfg)
    return engine, scheduler


def _step(engine, seed, poison=1.0):
    ids = _ids(seed)
    engine.backward(engine(input_ids=ids, labels=ids).loss * poison)
    engine.step()


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_non_finite_gradients_skip_the_step(precision, capsys):
    bad, sched = _engine(precision)
    good, _ = _engine(precision)
    _step(bad, 0), _step(good, 0)
    before = {k: v.clone() for k, v in bad.master_state_dict().items()}
    moments = (bad.store.exp_avg.clone(), bad.store.exp_avg_sq.clone())
    lr_iter = sched.last_batch_iteration
    _step(bad, 99, poison=float("nan"))  # every gradient NaN
    assert bad.skipped_steps == 1 and bad.global_steps == 2 and bad.optimizer.step_count == 1
    assert bad.get_global_grad_norm() == math.inf
    assert sched.last_batch_iteration == lr_iter  # the lr scheduler is not stepped
    after = bad.master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # masters bit-identical
    assert torch.equal(moments[0], bad.store.exp_avg) and torch.equal(
        moments[1], bad.store.exp_avg_sq
    )
    out = capsys.readouterr().out
    assert "OVERFLOW!" in out and "Skipping step" in out  # DeepSpeed's words
    for seed in (1, 2):  # later steps train normally and equal a run that never saw the bad batch
        _step(bad, seed), _step(good, seed)
    assert bad.optimizer.step_count == good.optimizer.step_count == 3
    assert bad.get_lr() == good.get_lr()
    sa, sb = bad.master_state_dict(), good.master_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), precision
    assert all(torch.isfinite(v).all() for v in sa.values())
    bad.destroy(), good.destroy()


def test_skipped_step_then_adam_matches_torch_over_the_good_steps():
    """fp32: a NaN in ONE resident gradient (the embedding) skips the step; Adam's bias correction
    then counts only the applied steps, as torch.optim.AdamW over the good batches."""
    ref = tiny_hf("llama", layers=2)
    engine, *_ = megatrain_ds.initialize(
        model=copy.deepcopy(ref), config={**BASE, "gradient_clipping": 1.0, "optimizer": ADAMW}
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    emb = engine.module.get_input_embeddings().weight
    for seed in range(4):
        hook = emb.register_hook(lambda g: g * float("inf")) if seed == 1 else None
        _step(engine, seed)
        if hook is not None:
            hook.remove()
            continue
        ids = _ids(seed)
        ref(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert engine.skipped_steps == 1 and engine.optimizer.step_count == 3
    _assert_matches_torch(engine, ref)
    engine.destroy()


def test_loss_scaler_follows_deepspeeds_dynamic_loss_scaler():
    """The same overflow sequence through DeepSpeed's DynamicLossScaler (the ZeRO optimizers') and
    ours: the same scales, the same stop at the minimum scale, DeepSpeed's words."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    megatrain_ds.init_distributed()  # DeepSpeed's scaler asks deepspeed.comm for the rank
    g = torch.Generator().manual_seed(0)
    for hysteresis, consecutive in ((1, False), (2, False), (3, True)):
        ds = DynamicLossScaler(
            init_scale=2.0**6,
            scale_window=3,
            min_scale=1,
            delayed_shift=hysteresis,
            consecutive_hysteresis=consecutive,
        )
        ours = LossScaler(
            scale=2.0**6,
            window=3,
            min_scale=1,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive,
        )
        for _ in range(300):  # overflows more often than not: the scale drifts down to the minimum
            overflow = bool(torch.rand(1, generator=g) < 0.6)
            try:
                ds.update_scale(overflow)
            except Exception as exc:
                assert "minimum" in str(exc)
                with pytest.raises(LossScaleAtMinimumError):
                    ours.update(overflow)
                break
            message = ours.update(overflow)
            assert ours.scale == ds.cur_scale
            assert (message is not None) == overflow
            assert message is None or message.startswith(
                "OVERFLOW! Rank 0 Skipping step. Attempted loss scale"
            )
        else:
            pytest.fail("the sequence never reached the minimum scale")


def test_fp16_overflow_at_the_minimum_scale_stops_the_run():
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2),
        config={
            **BASE,
            "optimizer": ADAMW,
            "fp16": {"enabled": True, "initial_scale_power": 0, "hysteresis": 1},
        },
    )
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        _step(engine, 0, poison=float("nan"))
    after = engine.master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.destroy()  # the queued tasks finished (skipped): nothing hangs
