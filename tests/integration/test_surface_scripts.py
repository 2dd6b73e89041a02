"""The DeepSpeed surface published scripts touch (docs/deepspeed_surface.md has the survey and the
table).

The script test runs tests/scripts/dschat_sft_train.py -- DeepSpeed-Chat's step-1 SFT script, its
DeepSpeed calls unchanged (see its docstring for what it mirrors) -- with only ``import deepspeed``
changed to ``import megatrain_ds as deepspeed``, on a tiny Llama checkpoint, ZeRO-3 + CPU offload +
bf16 as DeepSpeed-Chat's single-GPU recipes run it. Along the way the script calls
``deepspeed.init_distributed()``, ``torch.distributed.get_rank()``, builds the model under
transformers' ``HfDeepSpeedConfig`` (real DeepSpeed's ``zero.Init``), passes real
``DeepSpeedCPUAdam`` and a transformers scheduler to ``initialize``, reads
``ds_numel``/``ds_tensor``, gathers with ``p.ds_status == ZeroParamStatus.NOT_AVAILABLE``
(DeepSpeed's enum), calls ``engine.tput_timer.update_epoch_count()``, ``save_checkpoint`` and
``deepspeed.comm.get_rank()``. Then the checkpoint folder's ``zero_to_fp32.py`` (DeepSpeed's, copied
by save_checkpoint) must rebuild fp32 weights equal to the engine's masters. The same script also
runs under real DeepSpeed (CPU, gloo): losses agree.

The DeepSpeed runs build DeepSpeed's CPU Adam op on first use (~1 min on 2 cores, then cached,
shared with test_deepspeed_parity.py).
"""

import importlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatrain_ds
import megatrain_ds as deepspeed
from tests.models import tiny_hf

HERE = Path(__file__).resolve().parents[1]  # tests/
REPO = HERE.parent
SCRIPT = HERE / "scripts" / "dschat_sft_train.py"
EPOCHS, SAMPLES, MICRO = 2, 32, 4
ARGS = [
    "--local_rank",
    "0",
    "--zero_stage",
    "3",
    "--offload",
    "--dtype",
    "bf16",
    "--num_train_epochs",
    str(EPOCHS),
    "--num_train_samples",
    str(SAMPLES),
    "--per_device_train_batch_size",
    str(MICRO),
    "--per_device_eval_batch_size",
    str(MICRO),
    "--max_seq_len",
    "16",
    "--learning_rate",
    "3e-3",
    "--print_loss",
]

# Runs the script as its own __main__ and, once it has finished, saves the fp32 masters of the
# engine it built.
RUNNER = """
import runpy, sys, torch
import megatrain_ds
engines, initialize = [], megatrain_ds.initialize
def recording_initialize(*args, **kwargs):
    result = initialize(*args, **kwargs)
    engines.append(result[0])
    return result
megatrain_ds.initialize = recording_initialize
script, dump = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
torch.save({k: v.clone() for k, v in engines[0].master_state_dict().items()}, dump)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(launcher: bool) -> dict:
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if launcher:  # real DeepSpeed's init_distributed needs what its launcher exports
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
        )
    return env


def _losses(stdout: str) -> tuple[list[float], list[float]]:
    steps = [float(x) for x in re.findall(r"Rank: 0, loss = (?:tensor\()?([-0-9.e]+)", stdout)]
    evals = [float(x) for x in re.findall(r"^ppl: \S+, loss: ([-0-9.e]+)$", stdout, flags=re.M)]
    return steps, evals


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_hf("llama")  # tied embeddings, as DeepSpeed-Chat's OPT models
    model.config.eos_token_id = 2
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def megatrain_run(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dschat_megatrain")
    text = SCRIPT.read_text()
    assert text.count("\nimport deepspeed\n") == 1
    script = tmp / SCRIPT.name
    script.write_text(text.replace("\nimport deepspeed\n", "\nimport megatrain_ds as deepspeed\n"))
    out, masters = tmp / "out", tmp / "masters.pt"
    # No launcher environment: a plain `python main.py --local_rank 0` (init_distributed makes the
    # world of one)
    cmd = [
        sys.executable,
        "-c",
        RUNNER,
        str(script),
        str(masters),
        "--model_name_or_path",
        str(model_dir),
        "--output_dir",
        str(out),
        *ARGS,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp, env=_env(launcher=False), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {"stdout": proc.stdout, "out": out, "masters": torch.load(masters), "tmp": tmp}


def test_script_runs_to_the_end_and_trains(megatrain_run):
    stdout = megatrain_run["stdout"]
    steps_per_epoch = SAMPLES // MICRO
    # tput_timer.update_epoch_count() ran once per epoch; save_checkpoint and
    # deepspeed.comm.get_rank() at the end
    assert (
        f"saved DeepSpeed checkpoint to {megatrain_run['out']} after {EPOCHS * steps_per_epoch} "
        "steps "
        f"({EPOCHS} epochs)" in stdout
    )
    # print_throughput read ds_numel
    assert stdout.count("Model Parameters: ") == EPOCHS * steps_per_epoch
    steps, evals = _losses(stdout)
    assert len(steps) == EPOCHS * steps_per_epoch and len(evals) == EPOCHS + 1
    assert evals[-1] < evals[0] - 0.1  # the eval loss fell


def test_zero_to_fp32_in_the_checkpoint_folder_rebuilds_the_masters(megatrain_run):
    """DeepSpeed's own zero_to_fp32.py, as save_checkpoint left it in the folder, run as a user runs
    it."""
    out, masters = megatrain_run["out"], megatrain_run["masters"]
    recovery = out / "zero_to_fp32.py"
    assert recovery.is_file(), (
        "save_checkpoint did not copy DeepSpeed's zero_to_fp32.py into the save dir"
    )
    fp32_dir = megatrain_run["tmp"] / "fp32"
    proc = subprocess.run(
        [sys.executable, str(recovery), str(out), str(fp32_dir)],
        env=_env(launcher=False),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rebuilt = torch.load(fp32_dir / "pytorch_model.bin")
    assert set(masters) <= set(rebuilt) and len(masters) > 20
    for name, want in masters.items():
        assert rebuilt[name].dtype == torch.float32 and torch.equal(rebuilt[name], want), name
    # tied, as shared_params
    assert torch.equal(rebuilt["lm_head.weight"], rebuilt["model.embed_tokens.weight"])

    # The script's own export (save_zero_three_model: GatheredParameters on NOT_AVAILABLE
    # parameters, read in place for the others) holds the same values: fp32 masters for the streamed
    # layers, the compute (bf16) copy for the resident ones, as DeepSpeed's persistent parameters.
    exported = torch.load(out / "pytorch_model.bin")
    assert set(exported) == set(masters)
    for name, got in exported.items():
        assert got.numel() > 0, (
            f"{name}: nothing gathered (ds_status did not compare equal to ZeroParamStatus)"
        )
        if ".layers." in name:
            assert got.dtype == torch.float32 and torch.equal(got, masters[name]), name
        else:
            assert torch.equal(got, masters[name].to(got.dtype)), name


def test_the_same_script_under_real_deepspeed_agrees(megatrain_run, model_dir, tmp_path):
    """Unchanged, the script runs under DeepSpeed itself (ZeRO-3, CPU offload, gloo): same data
    order and the same losses up to bf16 rounding (bf16 compute; exact fp32 parity is
    test_deepspeed_parity.py's)."""
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--model_name_or_path",
        str(model_dir),
        "--output_dir",
        str(tmp_path / "out"),
        *ARGS,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(launcher=True), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    ours_steps, ours_evals = _losses(megatrain_run["stdout"])
    real_steps, real_evals = _losses(proc.stdout)
    assert len(real_steps) == len(ours_steps) and len(real_evals) == len(ours_evals)
    # the same weights before training (built under zero.Init, adopted)
    assert ours_evals[0] == real_evals[0]
    for k, (got, want) in enumerate(zip(ours_steps + ours_evals, real_steps + real_evals)):
        assert abs(got - want) <= 0.02 * abs(want), (
            f"loss {k}: megatrain_ds {got} vs DeepSpeed {want}"
        )


# ---------------------------------------------------------------------- the pieces, in one process
CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 3,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


def _micro_steps(engine, n):
    g = torch.Generator().manual_seed(3)
    applied = []
    for _ in range(n):
        ids = torch.randint(0, 256, (2, 8), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        applied.append(engine.was_step_applied())
    return applied


def test_tput_timer_and_was_step_applied():
    from deepspeed.utils.timer import ThroughputTimer

    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=CFG)
    timer = engine.tput_timer
    assert isinstance(timer, ThroughputTimer) and timer is engine.tput_timer
    # no device sync per step unless the config asks (throughput.py)
    assert not timer.config.synchronized
    assert timer.batch_size == engine.train_batch_size() == 4 and timer.steps_per_output == 3
    # GA 2: only boundary steps update the weights
    assert _micro_steps(engine, 6) == [False, True] * 3
    assert (timer.micro_step_count, timer.global_step_count) == (6, 3)
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0) and timer.avg_samples_per_sec() > 0
    engine.destroy()

    frozen_reference, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama"),
        config={
            **{k: v for k, v in CFG.items() if k != "optimizer"},
            "timers": {"throughput": {"synchronized": True}},
        },
    )
    assert frozen_reference.tput_timer.config.synchronized
    assert _micro_steps(frozen_reference, 2) == [False, False]  # no optimizer: nothing is applied
    frozen_reference.destroy()

    typo, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama"), config={**CFG, "timers": {"throughput": {"enabeld": 1}}}
    )
    with pytest.raises(megatrain_ds.ConfigError, match="timers.throughput.enabeld"):
        typo.tput_timer
    typo.destroy()


def test_engine_queries_scripts_make():
    # OpenRLHF passes args as a dict: args={"local_rank": int(os.environ.get("LOCAL_RANK", "-1"))}
    engine, *_ = megatrain_ds.initialize(
        args={"local_rank": -1}, model=tiny_hf("llama"), config=CFG, dist_init_required=True
    )
    assert (engine.global_rank, engine.world_size, engine.dp_world_size, engine.mp_world_size) == (
        0,
        1,
        1,
        1,
    )
    assert engine.get_data_parallel_rank() == 0 and engine.get_model_parallel_rank() == 0
    assert engine.data_parallel_group.rank() == 0 and engine.data_parallel_group.size() == 1
    assert engine.steps_per_print() == 3 and engine.wall_clock_breakdown() is False
    assert (
        engine.gradient_clipping() == 0.5
        and engine.loss_scale() == 0.0
        and engine.dynamic_loss_scale()
    )
    assert (
        engine.zero_optimization() is False
        and engine.is_compiled is False
        and engine.training_dataloader is None
    )
    _micro_steps(engine, 2)
    full = engine._consolidated_16bit_state_dict()  # OpenRLHF's save_model
    assert full.keys() == engine._zero3_consolidated_16bit_state_dict().keys()
    # OpenRLHF / DeepSpeed's offload_states example: the state is in host memory already
    engine.offload_states()
    engine.reload_states()
    engine.empty_partition_cache()
    with pytest.raises(NotImplementedError, match=r"engine\.compile\(\).*dynamo_backend"):
        engine.compile()
    with pytest.raises(NotImplementedError, match=r"train_batch\(\).*pipeline"):
        engine.train_batch(iter([]))
    engine.destroy()


def test_zero_param_status_is_deepspeeds_enum():
    """DeepSpeed-Chat / FastChat / OpenRLHF / trl import ZeroParamStatus from real DeepSpeed;
    DeepSpeed-Chat's lora.py reaches it as
    deepspeed.runtime.zero.partition_parameters.ZeroParamStatus. Both must match."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    assert megatrain_ds.zero.ZeroParamStatus is ZeroParamStatus
    assert deepspeed.runtime.zero.partition_parameters.ZeroParamStatus is ZeroParamStatus
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=CFG)
    streamed = engine.module.model.layers[0].self_attn.q_proj.weight
    assert streamed.ds_status == ZeroParamStatus.NOT_AVAILABLE
    to_fetch = [
        p
        for p in engine.module.parameters()
        if hasattr(p, "ds_id")
        and p.ds_status == deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE
    ]
    assert streamed in to_fetch
    with deepspeed.zero.GatheredParameters(to_fetch):
        assert (
            streamed.shape == streamed.ds_shape and streamed.ds_status == ZeroParamStatus.AVAILABLE
        )
    engine.destroy()


def test_module_names_scripts_reach():
    for name in ("deepspeed.accelerator", "deepspeed.runtime.lr_schedules", "deepspeed.utils"):
        # (an `import deepspeed.x` line here would rebind the name `deepspeed`)
        importlib.import_module(name)
    assert deepspeed.runtime.engine.DeepSpeedEngine is megatrain_ds.MegaTrainEngine
    assert deepspeed.runtime.lr_schedules is sys.modules["deepspeed.runtime.lr_schedules"]
    assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    assert deepspeed.runtime.zero.Init is megatrain_ds.zero.Init
    assert deepspeed.runtime.zero.GatheredParameters is megatrain_ds.zero.GatheredParameters
    assert (
        deepspeed.runtime.utils.set_random_seed is not None
        and deepspeed.runtime.config.LAMB_OPTIMIZER == "lamb"
    )
    assert deepspeed.get_accelerator() is sys.modules["deepspeed.accelerator"].get_accelerator()
    # megatrain_ds.utils forwards it
    assert deepspeed.utils.logger is sys.modules["deepspeed.utils"].logger
    assert deepspeed.version == megatrain_ds.__version__


@pytest.mark.parametrize(
    "path, says",
    [
        ("init_inference", "DeepSpeed-Inference"),
        ("tp_model_init", "tensor parallelism"),
        ("pipe", "pipeline parallelism"),
        ("DeepSpeedTransformerLayer", "fused transformer kernel"),
        ("ops.sparse_attention", "sparse attention"),
        ("ops.lamb", "FusedLamb"),
        ("runtime.pipe", "pipeline parallelism"),
        ("runtime.data_pipeline", "data efficiency"),
        ("runtime.zero.stage3", "offers Init, GatheredParameters"),
        ("no_such_name", "deepspeed_surface.md"),
    ],
)
def test_what_megatrain_ds_does_not_provide_is_named(path, says):
    obj = deepspeed
    *parents, last = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    with pytest.raises(AttributeError, match=re.escape(says)) as info:
        getattr(obj, last)
    assert last in str(info.value)
    assert not hasattr(obj, last)


def test_model_built_under_deepspeeds_own_zero_init_is_adopted(tmp_path):
    """``import megatrain_ds as deepspeed`` + transformers' HfDeepSpeedConfig (ZeRO-3): transformers
    builds the model under the real ``deepspeed.zero.Init`` (DeepSpeed-Chat's create_hf_model,
    OpenRLHF's Actor). The engine gathers each partition back and trains the same weights."""
    import transformers
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    reference = tiny_hf("llama")
    reference.save_pretrained(tmp_path)
    cfg = {**CFG, "zero_optimization": {"stage": 3}}
    # DeepSpeed's zero.Init needs deepspeed.comm, as under DeepSpeed itself
    deepspeed.init_distributed()
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841 (transformers holds a weak reference)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        unset_hf_deepspeed_config()
    assert model.model.layers[0].mlp.up_proj.weight.numel() == 0  # partitioned by real DeepSpeed
    engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
    want = reference.state_dict()
    for name, got in engine.master_state_dict().items():
        assert torch.equal(got, want[name]), name
    weight = engine.module.model.layers[0].mlp.up_proj.weight
    # DeepSpeed's hooks gone
    assert not hasattr(weight, "all_gather") and weight.megatrain_home is not None
    engine.destroy()
