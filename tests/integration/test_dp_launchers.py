"""Data parallel through the launchers users start it with: every rank reaches megatrain_ds's
engine, sees the world DeepSpeed would show it, trains on its own samples, and ends with the same
weights as the other ranks.

CPU only (CUDA hidden), gloo, 2 processes, tiny Qwen2 models built in the scripts
(tests/scripts/dp_*.py):

- ``torchrun --nproc_per_node 2`` running a DeepSpeed-style script (``import megatrain_ds as
  deepspeed``, ``initialize(training_data=...)``): ranks, world sizes, ``train_batch_size`` = micro
  x GA x world, the loader's DistributedSampler shards; and the same script on real DeepSpeed
  (ZeRO-3, CPU offload): the same batches, losses, grad norms and weights;
- the ``deepspeed`` launcher (``deepspeed --num_gpus 2``: it runs on a CPU-only machine, the CPU
  accelerator standing in for the GPUs; the script hides CUDA itself, as the launcher sets
  CUDA_VISIBLE_DEVICES);
- ``MEGATRAIN_DS=1 accelerate launch --num_processes 2`` with examples/accelerate_ds.yaml (ZeRO-3
  offload): accelerate's process count, its config's ``train_batch_size``, its dataloader shards,
  ``accelerator.gather``; and the same launch on real DeepSpeed (with accelerate's CPU process count
  fixed as the switch fixes it: without that, real DeepSpeed stops on CPU,
  compat/accelerate_world.py);
- ``MEGATRAIN_DS=1 torchrun --nproc_per_node 2`` running the HF Trainer with ``deepspeed=`` a config
  of "auto" values, for 2 steps.
"""

import json
import os
import shutil
import site
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.launch import run_again_after_exit_abort

HERE = Path(__file__).resolve().parents[1]  # tests/
REPO = HERE.parent
SCRIPTS = HERE / "scripts"
ENGINE_LINE = "[megatrain_ds] MEGATRAIN_DS=1: the engine is megatrain_ds"
WORLD, MICRO, GA, SAMPLES = 2, 2, 2, 16  # as the scripts and examples/accelerate_ds.yaml set them
TOL = 1e-5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(switch: bool = False, **extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "MEGATRAIN_DS",
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "ACCELERATE_USE_DEEPSPEED",
        )
    }
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
        **extra,
    )
    if switch:
        env["MEGATRAIN_DS"] = "1"
    return env


def _run(cmd: list, env: dict, cwd: Path, out: Path) -> tuple[str, list[dict]]:
    """Run a launch; its log and each rank's report (DIR/rank{R}.json), by rank."""
    proc = run_again_after_exit_abort(
        lambda: subprocess.run(
            [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["dist_rank"] for r in reports] == list(range(WORLD))
    return log, reports


def _torchrun(script: str, *args) -> list:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(WORLD),
        SCRIPTS / script,
        *args,
    ]


def _close(got, want, what, tol=TOL):
    assert len(got) == len(want) > 0, what
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= tol * max(abs(w), 1e-8), f"{what}[{i}]: {g} vs {w}"


def _same_weights(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


def _pth_installed() -> bool:
    dirs = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    return any((Path(d) / "megatrain_ds_switch.pth").is_file() for d in dirs)


needs_switch = pytest.mark.skipif(
    not _pth_installed(),
    reason="the package is not installed (pip install -e .): "
    "the MEGATRAIN_DS switch lives in the .pth it installs",
)


def _check_world(reports: list[dict]) -> None:
    """What every rank's engine says about the run: DeepSpeed's answers for 2 data-parallel
    ranks."""
    for rank, r in enumerate(reports):
        assert r["engine"] == "megatrain_ds.engine.MegaTrainEngine"
        assert (r["dist_world"], r["dp_world_size"], r["global_rank"], r["backend"]) == (
            WORLD,
            WORLD,
            rank,
            "gloo",
        )
        assert r["train_batch_size"] == MICRO * GA * WORLD
    assert len({r["digest"] for r in reports}) == 1  # every rank ends with the same fp32 weights


def _sampler_shards() -> list[list[list[int]]]:
    """The micro-batches DeepSpeed's DeepSpeedDataLoader gives each rank: a DistributedSampler over
    the data-parallel ranks (shuffled, seed 0), micro-batch size per rank."""
    shards = []
    for rank in range(WORLD):
        order = list(
            torch.utils.data.DistributedSampler(range(SAMPLES), num_replicas=WORLD, rank=rank)
        )
        shards.append([order[i : i + MICRO] for i in range(0, len(order), MICRO)])
    return shards


def _disjoint(batches_by_rank: list[list[list[int]]], count: int) -> None:
    seen = [i for batches in batches_by_rank for batch in batches[:count] for i in batch]
    assert len(seen) == len(set(seen)) == WORLD * count * MICRO, batches_by_rank


# ----------------------------------------------------------------------------------------- torchrun
@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_plain")
    log, reports = _run(_torchrun("dp_plain.py", "--out", tmp / "out"), _env(), tmp, tmp / "out")
    return {
        "log": log,
        "reports": reports,
        "weights": [torch.load(tmp / "out" / f"rank{r}.pt") for r in range(WORLD)],
    }


def test_torchrun_plain_script_trains_data_parallel(plain_run):
    reports = plain_run["reports"]
    _check_world(reports)
    for rank, r in enumerate(reports):
        # deepspeed.comm agrees
        assert r["env_rank"] == r["comm_rank"] == rank and r["comm_world"] == WORLD
        assert (r["micro"], r["ga"]) == (MICRO, GA)
        # initialize(training_data=...): this rank's shard
        assert r["loader_len"] == SAMPLES // WORLD // MICRO
        assert len(r["loss"]) == 2 * GA and all(0 < x < 10 for x in r["loss"])
    assert [r["batches"] for r in reports] == _sampler_shards()
    _disjoint([r["batches"] for r in reports], 2 * GA)
    assert reports[0]["grad_norm"] == reports[1]["grad_norm"]  # one global norm
    # safe_set_full_optimizer_state: rank 0's value (0.5; rank 1 passed 0.25), on every rank
    for r in reports:
        assert len(r["set_readback"]) == 3 and all(v == [0.5] for v in r["set_readback"].values())
    assert reports[0]["loss"] != reports[1]["loss"]  # different samples
    # + safe_get_full_grad / _optimizer_state of 3 params
    _same_weights(*plain_run["weights"], rtol=0, atol=0)


def test_torchrun_plain_script_matches_real_deepspeed(plain_run, tmp_path):
    """The same script with ``import deepspeed`` (ZeRO-3, CPU offload, 2 ranks): the same world,
    batches and training; ``safe_get_full_grad`` / ``safe_get_full_optimizer_state`` give the same
    values (a parameter of a layer rank 0 owns, of one rank 1 owns, and a resident one)."""
    _, real = _run(
        _torchrun("dp_plain.py", "--out", tmp_path / "out", "--real"),
        _env(),
        tmp_path,
        tmp_path / "out",
    )
    ours = plain_run["reports"]
    for o, r in zip(ours, real):
        assert r["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
        for key in (
            "dist_world",
            "comm_world",
            "global_rank",
            "world_size",
            "dp_world_size",
            "train_batch_size",
            "micro",
            "ga",
            "loader_len",
            "batches",
        ):
            assert o[key] == r[key], key
        _close(o["loss"], r["loss"], "loss")
        _close(o["grad_norm"], r["grad_norm"], "grad_norm")
    real_weights = torch.load(tmp_path / "out" / "rank0.pt")
    _same_weights(plain_run["weights"][0], real_weights, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- deepspeed launcher
def _deepspeed_launcher() -> str | None:
    here = Path(sys.executable).parent / "deepspeed"
    return str(here) if here.is_file() else shutil.which("deepspeed")


@pytest.mark.skipif(_deepspeed_launcher() is None, reason="no `deepspeed` launcher script on PATH")
def test_deepspeed_launcher_runs_two_ranks_on_cpu(plain_run, tmp_path):
    """``deepspeed --num_gpus 2 script.py``: on a CPU-only machine the launcher starts 2 ranks (the
    CPU accelerator stands in for the GPUs) and passes --local_rank; they train as under torchrun.
    Here the script builds its model inside ``deepspeed.zero.Init`` first, which joins the
    launcher's group (no group exists yet)."""
    cmd = [
        _deepspeed_launcher(),
        "--num_gpus",
        str(WORLD),
        "--master_port",
        str(_port()),
        SCRIPTS / "dp_plain.py",
        "--out",
        tmp_path / "out",
        "--zero-init",
    ]
    _, reports = _run(cmd, _env(DP_FORCE_CPU="1"), tmp_path, tmp_path / "out")
    _check_world(reports)
    for rank, r in enumerate(reports):
        assert r["local_rank_arg"] == r["env_rank"] == rank
        # zero.Init made the launcher's group, not a world of one
        assert r["zero_init_world"] == WORLD
    # (without zero.Init: initialize makes it)
    assert plain_run["reports"][0]["zero_init_world"] is None
    assert [r["batches"] for r in reports] == [r["batches"] for r in plain_run["reports"]]
    for o, r in zip(plain_run["reports"], reports):
        _close(r["loss"], o["loss"], "loss")
    _same_weights(
        torch.load(tmp_path / "out" / "rank0.pt"), plain_run["weights"][0], rtol=1e-5, atol=1e-7
    )


# --------------------------------------------------------------------------------------- accelerate
def _accelerate(out: Path) -> list:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        REPO / "examples" / "accelerate_ds.yaml",
        "--num_processes",
        str(WORLD),
        "--main_process_port",
        str(_port()),
        SCRIPTS / "dp_accelerate.py",
        "--out",
        out,
        "--batch_size",
        str(MICRO),
    ]


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_accelerate")
    log, reports = _run(_accelerate(tmp / "out"), _env(switch=True), tmp, tmp / "out")
    return {"log": log, "reports": reports, "weights": torch.load(tmp / "out" / "rank0.pt")}


@needs_switch
def test_accelerate_launch_two_processes_on_megatrain_ds(accelerate_run):
    reports = accelerate_run["reports"]
    assert accelerate_run["log"].count(ENGINE_LINE) == WORLD
    for rank in range(WORLD):
        assert f"(rank {rank} of {WORLD})" in accelerate_run["log"]
    _check_world(reports)
    for rank, r in enumerate(reports):
        assert (r["num_processes"], r["process_index"], r["is_main_process"]) == (
            WORLD,
            rank,
            rank == 0,
        )
        assert r["config_train_batch_size"] == r["train_batch_size"] and r["config_micro"] == MICRO
        assert r["loader_len"] == SAMPLES // WORLD // MICRO
        # accelerate's shards of the script's (unshuffled) loader: rank r takes global batches r,
        # r + 2, ...
        assert r["batches"] == [
            [b * MICRO + i for i in range(MICRO)] for b in range(rank, SAMPLES // MICRO, WORLD)
        ]
    for step, gathered in enumerate(reports[0]["gathered_loss"]):
        assert gathered == reports[1]["gathered_loss"][step] == [r["loss"][step] for r in reports]
    assert reports[0]["grad_norm"] == reports[1]["grad_norm"] and len(reports[0]["grad_norm"]) == 2


@needs_switch
def test_accelerate_launch_matches_real_deepspeed(accelerate_run, tmp_path):
    """The same launch on real DeepSpeed (accelerate's CPU process count fixed as under the switch):
    the same world, config, shards and training."""
    _, real = _run(
        _accelerate(tmp_path / "out"), _env(DP_COUNT_CPU_WORLD="1"), tmp_path, tmp_path / "out"
    )
    for o, r in zip(accelerate_run["reports"], real):
        assert r["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
        for key in (
            "num_processes",
            "process_index",
            "dist_world",
            "config_train_batch_size",
            "config_micro",
            "train_batch_size",
            "ga",
            "dp_world_size",
            "global_rank",
            "loader_len",
            "batches",
        ):
            assert o[key] == r[key], key
        _close(o["loss"], r["loss"], "loss")
        _close(o["grad_norm"], r["grad_norm"], "grad_norm")
    # torch AdamW's eps 1e-8: an element whose gradient is near zero moves by up to lr (1e-2) x the
    # sign of rounding noise, which the two engines' reduction orders round differently (seen: 4e-5
    # on 1 of 8192)
    _same_weights(
        accelerate_run["weights"], torch.load(tmp_path / "out" / "rank0.pt"), rtol=1e-4, atol=1e-4
    )


# --------------------------------------------------------------------------------------- HF Trainer
@needs_switch
def test_trainer_under_torchrun_two_processes(tmp_path):
    cmd = _torchrun("dp_trainer.py", "--out", tmp_path / "out", "--steps", "2")
    log, reports = _run(cmd, _env(switch=True), tmp_path, tmp_path / "out")
    assert log.count(ENGINE_LINE) == WORLD
    _check_world(reports)
    for rank, r in enumerate(reports):
        assert (r["world_size"], r["num_processes"], r["process_index"]) == (WORLD, WORLD, rank)
        # the Trainer's "auto": micro x GA x world
        assert r["config_train_batch_size"] == r["train_batch_size"]
        assert r["global_step"] == 2 and [step for step, _ in r["logged"]] == [1, 2]
        assert all(len(batch) == MICRO for batch in r["batches"][: 2 * GA])
    # the sampler's shards: each rank its own samples
    _disjoint([r["batches"] for r in reports], 2 * GA)
    # the Trainer logs the loss averaged over the ranks
    assert reports[0]["logged"] == reports[1]["logged"]


# --------------------------------------------------------------------------------------- in-process
def test_accelerate_world_counts_a_cpu_deepspeed_group(monkeypatch):
    """compat/accelerate_world.py: a DeepSpeed PartialState without a backend of its own (CPU) on a
    group of 2 takes the group's world; one with a backend (GPU), or a group of one, is left as it
    is."""
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    from compat.accelerate_world import count_the_world

    class State:
        def __init__(self, **values):
            self.__dict__.update(values)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cpu = State(
        distributed_type=DistributedType.DEEPSPEED,
        backend=None,
        num_processes=1,
        process_index=0,
        local_process_index=0,
    )
    count_the_world(cpu)
    assert (cpu.backend, cpu.num_processes, cpu.process_index, cpu.local_process_index) == (
        "gloo",
        2,
        1,
        1,
    )
    gpu = State(
        distributed_type=DistributedType.DEEPSPEED, backend="nccl", num_processes=2, process_index=1
    )
    count_the_world(gpu)
    assert (gpu.backend, gpu.num_processes) == ("nccl", 2)
    plain = State(
        distributed_type=DistributedType.NO, backend=None, num_processes=1, process_index=0
    )
    count_the_world(plain)
    assert (plain.backend, plain.num_processes) == (None, 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    alone = State(
        distributed_type=DistributedType.DEEPSPEED, backend=None, num_processes=1, process_index=0
    )
    count_the_world(alone)
    assert (alone.backend, alone.num_processes) == (None, 1)
