"""The MEGATRAIN_DS switch (compat/): existing accelerate and HF Trainer DeepSpeed launches run on
megatrain_ds.

Every run is a real subprocess, launched as a user would (the switch acts at interpreter start,
through the ``megatrain_ds_switch.pth`` the package installs): ``accelerate launch --config_file
examples/accelerate_ds.yaml examples/accelerate_train.py`` with and without ``MEGATRAIN_DS=1`` (real
DeepSpeed ZeRO-3, CPU offload, gloo), and ``torchrun examples/trainer_train.py`` (Trainer,
``deepspeed=`` a JSON of "auto" values) trained, saved, resumed. CPU only (CUDA hidden), fp32. The
first real DeepSpeed run on a machine JIT-builds its CPU ops (cached under
~/.cache/torch_extensions; test_deepspeed_parity.py needs them too).
"""

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.launch import run_again_after_exit_abort

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
PROBE = REPO / "tests" / "scripts" / "compat_probe.py"
ENGINE_LINE = "[megatrain_ds] MEGATRAIN_DS=1: the engine is megatrain_ds"
RTOL = 1e-5


def _env(switch: bool) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("MEGATRAIN_DS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
    )
    if switch:
        env["MEGATRAIN_DS"] = "1"
    return env


def _run(cmd: list, switch: bool, cwd: Path) -> str:
    proc = run_again_after_exit_abort(
        lambda: subprocess.run(
            [str(c) for c in cmd],
            cwd=cwd,
            env=_env(switch),
            capture_output=True,
            text=True,
            timeout=900,
        )
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def _probe(*args, switch: bool, cwd: Path) -> dict:
    out = _run([sys.executable, PROBE, *args], switch, cwd)
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _trainer_example():
    """examples/trainer_train.py as a module (its tiny-model writer and its held-out windows)."""
    spec = importlib.util.spec_from_file_location(
        "trainer_train_example", EXAMPLES / "trainer_train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_tiny_model(path: Path) -> None:
    _trainer_example().write_tiny_model(str(path), seed=0)


def _close(got, want, what):
    assert len(got) == len(want) > 0, what
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * max(abs(w), 1e-8), f"{what}[{i}]: {g} vs {w}"


def _pth_installed() -> bool:
    dirs = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    return any((Path(d) / "megatrain_ds_switch.pth").is_file() for d in dirs)


needs_switch = pytest.mark.skipif(
    not _pth_installed(),
    reason="the package is not installed (pip install -e .): "
    "the MEGATRAIN_DS switch lives in the .pth it installs",
)


# ----------------------------------------------------------------------------------------- off / on
@needs_switch
def test_switch_off_leaves_deepspeed_untouched(tmp_path):
    """Without MEGATRAIN_DS nothing is imported at start and deepspeed is real DeepSpeed."""
    off = _probe("startup", switch=False, cwd=tmp_path)
    assert off["at_start"] == []
    assert off["initialize"] == "deepspeed.initialize"
    assert off["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert off["zero_init"] == "deepspeed.runtime.zero.partition_parameters"
    assert off["cpu_adam"] == "deepspeed.ops.adam.cpu_adam"


@needs_switch
def test_switch_on_redirects_only_after_deepspeed_is_imported(tmp_path):
    on = _probe("startup", switch=True, cwd=tmp_path)
    assert on["at_start"] == ["compat", "compat.switch"]  # no torch, no deepspeed at start
    assert on["initialize"] == "compat.deepspeed_redirect.initialize"
    assert on["engine"] == "megatrain_ds.engine.MegaTrainEngine"
    assert on["zero_init"] == "compat.deepspeed_redirect"
    assert on["cpu_adam"] == "megatrain_ds.ops.adam"


@needs_switch
def test_unsupported_setups_fail_with_a_message_naming_them(tmp_path):
    # several processes are supported: test_dp_launchers.py
    errors = _probe("errors", switch=True, cwd=tmp_path)
    assert errors["sgd_config"].startswith("ConfigError") and "'SGD'" in errors["sgd_config"]
    assert errors["sgd_client"].startswith("NotImplementedError") and "SGD" in errors["sgd_client"]
    assert (
        errors["adagrad"].startswith("NotImplementedError")
        and "DeepSpeedCPUAdagrad" in errors["adagrad"]
    )
    assert all("MEGATRAIN_DS" in message for message in errors.values())


@needs_switch
def test_zero3_from_pretrained_builds_whole_on_cpu(tmp_path):
    """HfDeepSpeedConfig (ZeRO-3) + from_pretrained, no launcher: built under megatrain_ds's
    zero.Init, on the CPU, whole, with the saved weights loaded through GatheredParameters."""
    _write_tiny_model(tmp_path / "init")
    got = _probe("zero3-init", tmp_path / "init", switch=True, cwd=tmp_path)
    assert got["zero_init_entered"] == ["compat.deepspeed_redirect"]
    assert got["devices"] == ["cpu"] and got["whole"] and got["equal_to_saved"]
    assert got["dist_initialized"] and got["ds_rank"] == 0


# --------------------------------------------------------------------------------------- accelerate
@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    _write_tiny_model(tmp / "init")
    runs = {}
    for name, switch in (("megatrain", True), ("deepspeed", False)):
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            EXAMPLES / "accelerate_ds.yaml",
            "--main_process_port",
            "0",
            EXAMPLES / "accelerate_train.py",
            "--model_dir",
            tmp / "init",
            "--out_dir",
            tmp / name,
            "--report",
            tmp / f"{name}.json",
            "--steps",
            "6",
            "--batch_size",
            "2",
            "--seq_len",
            "16",
        ]
        log = _run(cmd, switch, tmp)
        runs[name] = {
            "log": log,
            "dir": tmp / name,
            **json.loads((tmp / f"{name}.json").read_text()),
        }
    return runs


@needs_switch
def test_accelerate_launch_trains_on_megatrain_ds(accelerate_runs):
    ours, real = accelerate_runs["megatrain"], accelerate_runs["deepspeed"]
    assert ours["engine"] == "megatrain_ds.engine.MegaTrainEngine"
    assert ours["log"].count(ENGINE_LINE) == 1
    assert real["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert ENGINE_LINE not in real["log"]
    loss = ours["loss"]
    assert sum(loss[-4:]) / 4 < sum(loss[:4]) / 4  # it trained


@needs_switch
def test_accelerate_losses_match_real_deepspeed(accelerate_runs):
    """Same script, yaml and model: per-micro-step losses, learning rates (the script's torch
    scheduler on its torch AdamW) and grad norms agree with DeepSpeed ZeRO-3 to 1e-5 relative
    (fp32)."""
    ours, real = accelerate_runs["megatrain"], accelerate_runs["deepspeed"]
    assert len(ours["loss"]) == 12 and len(ours["lr"]) == 6
    for key in ("loss", "lr", "grad_norm"):
        _close(ours[key], real[key], key)
    assert len(set(ours["lr"])) > 2  # the schedule moved


@needs_switch
def test_accelerate_get_state_dict_saves_loadable_weights(accelerate_runs):
    """``accelerator.get_state_dict`` (via ``_zero3_consolidated_16bit_state_dict``) +
    save_pretrained: both engines' final weights load with from_pretrained and agree."""
    import transformers

    ours = transformers.AutoModelForCausalLM.from_pretrained(
        accelerate_runs["megatrain"]["dir"]
    ).state_dict()
    real = transformers.AutoModelForCausalLM.from_pretrained(
        accelerate_runs["deepspeed"]["dir"]
    ).state_dict()
    assert ours.keys() == real.keys()
    for k in real:
        torch.testing.assert_close(ours[k], real[k], rtol=1e-4, atol=1e-6, msg=k)


# ------------------------------------------------------------------------------------------ Trainer
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Run A: 6 steps, a checkpoint every 3. Run B: a fresh process given A's checkpoint-3 only,
    resumed with resume_from_checkpoint=True (as after an interruption at step 3)."""
    tmp = tmp_path_factory.mktemp("trainer")
    _write_tiny_model(tmp / "init")

    def run(name, resume):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            EXAMPLES / "trainer_train.py",
            "--model_dir",
            tmp / "init",
            "--output_dir",
            tmp / name,
            "--max_steps",
            "6",
            "--save_steps",
            "3",
            "--batch_size",
            "2",
            "--seq_len",
            "16",
            "--report",
            tmp / f"{name}.json",
            *(["--resume"] if resume else []),
        ]
        log = _run(cmd, True, tmp)
        return {"log": log, "dir": tmp / name, **json.loads((tmp / f"{name}.json").read_text())}

    full = run("full", resume=False)
    (tmp / "resumed").mkdir()
    shutil.copytree(tmp / "full" / "checkpoint-3", tmp / "resumed" / "checkpoint-3")
    return {"full": full, "resumed": run("resumed", resume=True)}


@needs_switch
def test_trainer_trains_on_megatrain_ds_and_saves_deepspeed_checkpoints(trainer_runs):
    full = trainer_runs["full"]
    assert full["engine"] == "megatrain_ds.engine.MegaTrainEngine"
    assert full["log"].count(ENGINE_LINE) == 1
    assert full["built_on"] == ["cpu"]  # from_pretrained under zero.Init
    for step in (3, 6):
        ckpt = full["dir"] / f"checkpoint-{step}"
        assert (ckpt / f"global_step{step}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
        assert (ckpt / "latest").read_text() == f"global_step{step}"
        assert (ckpt / "trainer_state.json").is_file() and (ckpt / "model.safetensors").is_file()
    losses = [loss for _, loss in full["steps"]]
    assert [step for step, _ in full["steps"]] == [1, 2, 3, 4, 5, 6]
    assert losses[-1] < losses[0]


@needs_switch
def test_trainer_resume_matches_the_uninterrupted_run(trainer_runs):
    full, resumed = trainer_runs["full"], trainer_runs["resumed"]
    assert resumed["global_step"] == 6
    logged = lambda run: sum(  # noqa: E731
        line.startswith("{'loss'") for line in run["log"].splitlines()
    )
    assert (logged(full), logged(resumed)) == (6, 3)  # the resumed process trained steps 4-6 only
    _close(
        [loss for step, loss in resumed["steps"] if step > 3],
        [loss for step, loss in full["steps"] if step > 3],
        "loss after resume",
    )
    _close([resumed["eval_loss"]], [full["eval_loss"]], "held-out loss")


@needs_switch
def test_trainer_save_model_weights_load_with_from_pretrained(trainer_runs):
    """trainer.save_model() (stage3_gather_16bit_weights_on_model_save) writes weights
    from_pretrained loads: in a plain model they give the held-out loss the trained engine measured;
    the resumed run's weights are the same."""
    import transformers

    trainer_train = _trainer_example()
    model = transformers.AutoModelForCausalLM.from_pretrained(trainer_runs["full"]["dir"] / "final")
    ids = trainer_train.byte_windows(16, trainer_train.EVAL_WINDOWS, seed=1, held_out=True)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    _close([loss], [trainer_runs["full"]["eval_loss"]], "held-out loss of the saved weights")
    resumed = transformers.AutoModelForCausalLM.from_pretrained(
        trainer_runs["resumed"]["dir"] / "final"
    )
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0, msg=name)


# --------------------------------------------------------------------------------------- in-process
def test_import_hook_runs_after_the_module_and_restores_its_loader(tmp_path, monkeypatch):
    from compat.import_hook import after_import

    (tmp_path / "compat_hook_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("compat_hook_target", lambda m: seen.append(m.VALUE))
    import compat_hook_target

    assert seen == [1]
    assert type(compat_hook_target.__loader__).__name__ == "SourceFileLoader"
    assert compat_hook_target.__spec__.loader is compat_hook_target.__loader__
    after_import("compat_hook_target", lambda m: seen.append(2))  # already imported: runs at once
    assert seen == [1, 2]
    del sys.modules["compat_hook_target"]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_client_optimizer_scheduler_drives_the_engine_lr():
    """As in DeepSpeed, the engine optimizer works on the client optimizer's groups: a torch
    scheduler the script built on its own AdamW (accelerate steps it) sets the learning rate the
    engine uses."""
    import megatrain_ds
    from tests.models import tiny_hf

    model = tiny_hf("llama")
    client = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 0.5**step)
    engine, optimizer, _, _ = megatrain_ds.initialize(
        model=model, optimizer=client, config={"train_micro_batch_size_per_gpu": 2}
    )
    assert optimizer.param_groups[0] is client.param_groups[0]
    sched.step()
    sched.step()
    assert engine.get_lr() == [pytest.approx(2.5e-4)]
    engine.destroy()


def test_module_called_without_the_engine_sees_the_last_step():
    """The HF Trainer evaluates ``trainer.model`` (the module, not the engine): after a step its
    resident parameters (embeddings, norm, head) are refreshed before they are used, as the engine's
    forward does."""
    import megatrain_ds
    from tests.models import tiny_hf

    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", tied=False),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        },
    )
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with torch.no_grad():
        direct = engine.module(input_ids=ids.to(engine.device)).logits.cpu()
        through_engine = engine(input_ids=ids).logits.cpu()
    assert torch.equal(direct, through_engine)
    hooked = engine.module.model.embed_tokens
    assert len(hooked._forward_pre_hooks) == 1
    engine.destroy()
    # the module no longer calls into the destroyed engine
    assert len(hooked._forward_pre_hooks) == 0
