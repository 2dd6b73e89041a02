"""Each DeepSpeed config key the engine reads, and each rejected input (the message names the
key)."""

import argparse
import base64
import json
import math
import warnings

import pytest
import torch

import megatrain_ds
from megatrain_ds.planning.config import ConfigError, parse_config
from megatrain_ds.streaming.timing import StepTimer
from tests.models import tiny_hf


@pytest.mark.parametrize(
    "cfg,triple",
    [
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, (8, 2, 4)),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 4}, (8, 2, 4)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, (6, 2, 3)),
        ({"train_micro_batch_size_per_gpu": 2}, (2, 2, 1)),
        ({"train_batch_size": 4}, (4, 4, 1)),
    ],
)
def test_batch_triple(cfg, triple):
    c = parse_config(cfg)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == triple


@pytest.mark.parametrize(
    "cfg,key",
    [
        (
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 3,
            },
            "train_batch_size",
        ),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto"}, "gradient_clipping"),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            },
            "optimizer.params.lr",
        ),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}},
            },
            "optimizer.params.lrr",
        ),
        (
            {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "parms": {}}},
            "optimizer.parms",
        ),
        ({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb"}}, "optimizer.type"),
        (
            {"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupLR", "param": {}}},
            "scheduler.param",
        ),
        ({"train_micro_batch_size_per_gpu": 2, "megatrain": {"num_slot": 3}}, "megatrain.num_slot"),
        (
            {"train_micro_batch_size_per_gpu": 2, "megatrain": {"num_slots": 1}},
            "megatrain.num_slots",
        ),
        (
            {"train_micro_batch_size_per_gpu": 2, "megatrain": {"gpu_optimizer_layers": "all"}},
            "megatrain.gpu_optimizer_layers",
        ),
        (
            {"train_micro_batch_size_per_gpu": 2, "megatrain": {"gpu_optimizer_layers": -2}},
            "megatrain.gpu_optimizer_layers",
        ),
        (
            {"train_micro_batch_size_per_gpu": 2, "megatrain": {"host_threads": 0}},
            "megatrain.host_threads",
        ),
        (
            {"train_micro_batch_size_per_gpu": 2, "megatrain": {"liger_kernels": "yes"}},
            "megatrain.liger_kernels",
        ),
        (
            {"train_micro_batch_size_per_gpu": 2, "megatrain": {"gpu_memory_reserve": 1.0}},
            "megatrain.gpu_memory_reserve",
        ),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "fp16": {"enabled": True, "loss_scale_windw": 10},
            },
            "fp16.loss_scale_windw",
        ),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "fp16": {"enabled": True},
                "bf16": {"enabled": True},
            },
            "fp16.enabled",
        ),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "fp16": {"enabled": True, "initial_scale_power": "auto"},
            },
            "fp16.initial_scale_power",
        ),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu", "ratio": 1.5},
                },
            },
            "zero_optimization.offload_optimizer.ratio",
        ),
        ({}, "train_batch_size"),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 3, "overlap_coms": True},
            },
            "zero_optimization.overlap_coms",
        ),
        (
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 3, "offload_param": {"devize": "cpu"}},
            },
            "zero_optimization.offload_param.devize",
        ),
    ],
)
def test_rejected_inputs_name_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(cfg)


def test_unknown_top_level_keys_are_ignored_like_deepspeed():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = parse_config(
            {"train_micro_batch_size_per_gpu": 2, "comms_logger": {"enabled": False}, "foo": 1}
        )
    # a disabled feature block and an unknown key: silent
    assert c.micro_batch_size == 2 and not caught


def test_optimizer_block():
    c = parse_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.1},
            },
        }
    )
    o = c.optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (3e-4, (0.8, 0.9), 1e-7, 0.1)
    assert o.adam_w_mode  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    c = parse_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}},
        }
    )
    assert not c.optimizer.adam_w_mode


def test_adam_l2_mode_matches_torch_adam():
    ref = tiny_hf("llama")
    model = __import__("copy").deepcopy(ref)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-6, "adam_w_mode": False},
        },
    }
    engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 256, (2, 10), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    engine.destroy()


@pytest.mark.parametrize(
    "name,params",
    [
        ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}),
        ("WarmupDecayLR", {"warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 8}),
        ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 2}),
        ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 3}),
        ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2}),
    ],
)
def test_scheduler_types_follow_deepspeeds_own_schedules(name, params):
    from deepspeed.runtime import lr_schedules

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": name, "params": params},
    }
    engine, optimizer, _, scheduler = megatrain_ds.initialize(model=tiny_hf("llama"), config=cfg)
    assert isinstance(scheduler, getattr(lr_schedules, name))
    twin = getattr(lr_schedules, name)(
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3), **params
    )
    for _ in range(5):
        ids = torch.randint(0, 256, (2, 8))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        twin.step()
        assert engine.get_lr() == pytest.approx(twin.get_lr())
    engine.destroy()


def test_unknown_scheduler_type():
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW"},
        "scheduler": {"type": "Cosine"},
    }
    with pytest.raises(ConfigError, match="scheduler.type"):
        megatrain_ds.initialize(model=tiny_hf("llama"), config=cfg)


def test_config_sources(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "AdamW"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    hj = tmp_path / "ds.hjson"
    hj.write_text("{\n  # a comment\n  train_micro_batch_size_per_gpu: 3\n}\n")
    b64 = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    args = argparse.Namespace(deepspeed_config=str(path))
    for kwargs in (
        {"config": cfg},
        {"config": str(path)},
        {"config": str(hj)},
        {"config": b64},
        {"config_params": cfg},
        {"args": args},
    ):
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), **kwargs)
        assert engine.train_micro_batch_size_per_gpu() == 3, kwargs
        engine.destroy()
    with pytest.raises(ConfigError, match="neither an existing file"):
        parse_config(str(tmp_path / "missing.json"))


def test_precision_and_clipping_keys():
    assert (
        parse_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}).compute_dtype
        == "bf16"
    )
    assert parse_config({"train_micro_batch_size_per_gpu": 1}).compute_dtype == "fp32"
    assert (
        parse_config(
            {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.5}
        ).gradient_clipping
        == 0.5
    )


def test_steps_per_print_and_wall_clock_breakdown(capsys):
    assert (
        parse_config(
            {"train_micro_batch_size_per_gpu": 1, "steps_per_print": "inf"}
        ).steps_per_print
        == math.inf
    )
    # no speculation: a layer stepped speculatively and then redone (when the norm task wins the
    # race, which load on the machine decides) is updated twice, and the rate counts both updates
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW"},
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "megatrain": {"speculative_step": False},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=cfg)
    windows = []
    for _ in range(4):
        ids = torch.randint(0, 256, (2, 8))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        # after step k: the window that forward k closed
        windows.append(dict(engine.last_step_breakdown()))
    out = capsys.readouterr().out
    assert "step 4:" in out and "CPU optim" in out and "step 1:" not in out
    # the host update's rate (issue 26): the trainable parameters (streamed layers' and resident
    # ones: embeddings, final norm, head) per second of updating them. A step's window runs from one
    # forward to the next, and a forward waits only for its own layer's update, so a window holds
    # whole layers' updates, each with its own time, from this step or the one before (on a loaded
    # machine, none), and the resident update (one span) once or not at all: step 1's updates are
    # done before forward 3 has run its layers, so windows 1-2 hold them all.
    sizes = {layout.n_train for layout in engine.store.layouts}
    assert len(sizes) == 1
    size = sizes.pop()
    resident = sum(
        p.numel() for p, g in zip(engine.resident.params, engine.resident.grad) if g is not None
    )
    assert resident > 0 and resident % size != 0  # else the check below could not tell them apart
    for b in windows[1:]:
        busy = b["cpu_optimizer_s"] + b["cpu_speculative_optimizer_s"]
        assert any(
            (b["cpu_updated_params"] - j * resident) % size
            == 0
            <= b["cpu_updated_params"] - j * resident
            for j in (0, 1)
        )
        want = b["cpu_updated_params"] / 1e9 / busy if b["cpu_updated_params"] else 0.0
        assert abs(b["cpu_optimizer_gparam_s"] - want) < 1e-9
    assert (
        sum(b["cpu_updated_params"] for b in windows[1:3])
        >= size * len(engine.store.layouts) + resident
    )
    assert any(b["cpu_updated_params"] % size for b in windows[1:])  # a resident update counted
    with_updates = next(b for b in windows[1:3] if b["cpu_updated_params"])
    assert f"{with_updates['cpu_optimizer_gparam_s']:.2f} Gparam/s" in StepTimer.format(
        with_updates
    )
    # DeepSpeed's progress line, every steps_per_print optimizer steps
    progress = [line for line in out.splitlines() if "step=" in line]
    assert len(progress) == 2 and "step=2, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]" in progress[0]
    assert engine.get_mom() == [(0.9, 0.999)]
    engine.destroy()


def test_zero_block_is_accepted_and_mapped():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = parse_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "nvme", "nvme_path": "/x"},
                    "offload_optimizer": {"device": "cpu", "ratio": 0.25},
                },
            }
        )
    assert c.zero_stage == 3 and c.offload_optimizer_ratio == 0.25
    assert any("zero_optimization.offload_param.device=nvme" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 1000},
            }
        )
    unused = [str(w.message) for w in caught if "no effect" in str(w.message)]
    assert len(unused) == 1 and "overlap_comm, reduce_bucket_size" in unused[0]


def test_liger_kernels_on_cpu_warn_and_keep_the_models_kernels():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("qwen2", layers=2),
            config={
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "megatrain": {"liger_kernels": True},
            },
        )
    assert any("megatrain.liger_kernels" in str(w.message) for w in caught)
    ids = torch.randint(0, 256, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.destroy()


def test_deepspeed_features_not_implemented_warn_and_removed_ones_are_errors():
    base = {"train_micro_batch_size_per_gpu": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config(
            {
                **base,
                "flops_profiler": {"enabled": True, "profile_step": 1},
                "comms_logger": {"enabled": False},
                "activation_checkpointing": {"partition_activations": True},
            }
        )
    msgs = [str(w.message) for w in caught if "does not implement" in str(w.message)]
    assert len(msgs) == 1 and "flops_profiler" in msgs[0] and "activation_checkpointing" in msgs[0]
    assert "comms_logger" not in msgs[0]  # disabled: nothing to say
    with pytest.raises(ConfigError, match="'amp'|Apex AMP"):
        parse_config({**base, "amp": {"enabled": True}})
    with pytest.raises(ConfigError, match="curriculum_learning"):
        parse_config({**base, "curriculum_learning": {"enabled": True}})
