"""The way back: real DeepSpeed ZeRO-3 resumes a checkpoint megatrain_ds saved (docs/wayback.md;
wayback.py).

One module fixture makes every run (tests/scripts/wayback_run.py; CPU, gloo, fp32: the exact mode,
whose losses two engines can compare to 1e-5; a bf16 run was checked by hand, see docs/wayback.md).
The DeepSpeed JSON config: ZeRO-3, offload_optimizer cpu (DeepSpeed steps with its CPU Adam), AdamW,
WarmupLR, gradient clipping 1.0, and a sub_group_size small enough that DeepSpeed's sub-groups cut
across layers. For N = 1 (megatrain_ds in this process) and N = 2 (megatrain_ds data parallel, one
process per rank with torchrun's environment), megatrain_ds trains 3 steps, saves, trains 3 more
(the uninterrupted run); then, from the checkpoint, with another init, (a) real DeepSpeed on N ranks
and (b) megatrain_ds each train the same 3 steps. Their losses agree step by step, rank by rank,
within 1e-5 relative (and with the uninterrupted run). DeepSpeed's runs start beside the saving runs
(their start-up is most of their time) and wait for the checkpoint's ``latest``.
"""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.launch import aborted_at_exit

HERE = Path(__file__).resolve().parents[1]  # tests/
SCRIPT = HERE / "scripts" / "wayback_run.py"
REPO = HERE.parent
TOL = 1e-5  # relative, per step
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 8},
    },
    # the model's 87k trained elements make 4 sub-groups on one rank, its 2-rank partitions 2
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "sub_group_size": 25000,
    },
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    for key in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    return env


def _launch(ranks: int, *args: str) -> list[subprocess.Popen]:
    """The script on ``ranks`` ranks: one process per rank, with the environment torchrun would give
    it (no launcher process: on a 2-core machine its start-up is time the runs wait for). Each in
    its own session."""
    env, port = _env(), str(_port())
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
    )
    return [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(ranks)
    ]


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()


def _records(procs: list[subprocess.Popen], out: Path) -> list[dict]:
    """Every rank's record once its process ended. A rank that died of the exit-time abort
    (tests/launch.py) after writing its record finished its script: its record stands."""
    records = []
    for r, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=600)
        path = Path(f"{out}.rank{r}.json")
        if proc.returncode != 0 and not (
            aborted_at_exit(proc.returncode, stderr) and path.is_file()
        ):
            _stop([p for p in procs if p is not proc])
            pytest.fail(
                f"{out.name} rank {r}: exit {proc.returncode}\n--- stdout ---\n{stdout[-3000:]}\n"
                f"--- stderr ---\n{stderr[-8000:]}",
                pytrace=False,
            )
        records.append(json.loads(path.read_text()))
    return records


def _script():
    spec = importlib.util.spec_from_file_location("wayback_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wayback")
    config = tmp / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    ck = {n: tmp / f"ck{n}" for n in (1, 2)}
    # DeepSpeed first (it waits for the checkpoints), then megatrain_ds's 2-rank run, then its
    # 1-rank run here
    launches = {
        f"ds{n}": _launch(
            n,
            "--engine",
            "deepspeed",
            "--config",
            str(config),
            "--resume",
            str(ck[n]),
            "--out",
            str(tmp / f"ds{n}"),
        )
        for n in (1, 2)
    }
    try:
        launches["mt2"] = _launch(
            2,
            "--engine",
            "megatrain",
            "--config",
            str(config),
            "--save",
            str(ck[2]),
            "--out",
            str(tmp / "mt2"),
        )
        mt1 = _script().main(
            [
                "--engine",
                "megatrain",
                "--config",
                str(config),
                "--save",
                str(ck[1]),
                "--out",
                str(tmp / "mt1"),
            ]
        )
        # before DeepSpeed's: they wait for its checkpoint
        mt2 = _records(launches["mt2"], tmp / "mt2")
        records = {
            "mt1": [mt1],
            "mt2": mt2,
            "ds1": _records(launches["ds1"], tmp / "ds1"),
            "ds2": _records(launches["ds2"], tmp / "ds2"),
        }
    finally:
        for procs in launches.values():
            _stop(procs)
    return SimpleNamespace(ck=ck, **records)


def _close(got: list, want: list, what: str) -> None:
    assert len(got) == len(want) == 3, what
    for k, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= TOL * abs(b), f"{what}, step {k + 4}: {a} vs {b}"


def _continues(ours: list[dict], theirs: list[dict], n: int) -> None:
    assert [r["rank"] for r in ours] == [r["rank"] for r in theirs] == list(range(n))
    for mt, ds in zip(ours, theirs):
        r = mt["rank"]
        assert ds["resumed_at"][1] == mt["resumed_at"][1] == 3  # global_steps came back
        _close(
            ds["resume"]["loss"],
            mt["resume"]["loss"],
            f"rank {r}: loss, DeepSpeed vs megatrain_ds resuming",
        )
        _close(
            ds["resume"]["loss"],
            mt["straight"]["loss"][3:],
            f"rank {r}: loss, DeepSpeed vs the uninterrupted run",
        )
        # megatrain_ds's own resume: exact
        assert mt["resume"]["loss"] == mt["straight"]["loss"][3:]
        # the schedule came back: DeepSpeed's WarmupLR goes on from step 3 (still warming up)
        assert ds["resume"]["lr"] == mt["resume"]["lr"] == mt["straight"]["lr"][3:]
        assert len(set(mt["straight"]["lr"])) == 6


def test_deepspeed_resumes_a_one_rank_megatrain_checkpoint(runs):
    _continues(runs.mt1, runs.ds1, 1)


def test_deepspeed_resumes_a_two_rank_megatrain_checkpoint(runs):
    _continues(runs.mt2, runs.ds2, 2)


@pytest.mark.parametrize("n", [1, 2])
def test_the_files_hold_deepspeeds_own_layout(runs, n):
    """Each rank's files: DeepSpeed's sub-groups as its running engine built them (names in order,
    partition sizes), its optimizer state layout, its loss scaler object; and the saving run found
    nothing DeepSpeed could not resume."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    folder = runs.ck[n] / "global_step3"
    for ds in getattr(runs, f"ds{n}"):
        r = ds["rank"]
        states = torch.load(
            folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", weights_only=False
        )
        zero = torch.load(
            folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False
        )["optimizer_state_dict"]
        names, sizes = [g for g, _ in ds["layout"]], [s for _, s in ds["layout"]]
        # every trained parameter (the frozen norms are not), and in
        assert sum(map(len, names)) == 25
        # a
        assert any(
            len({name.split(".")[2] for name in group if ".layers." in name}) == 2
            for group in names
        )
        # sub-group cut inside layer 1's parameters
        assert [list(group) for group in states["param_shapes"]] == names
        assert [t.numel() for t in zero["fp32_flat_groups"]] == sizes
        inner = zero["optimizer_state_dict"]
        assert [g["params"] for g in inner["param_groups"]] == [list(range(len(names)))]
        assert (
            inner["param_groups"][0]["bias_correction"] is True
            and inner["param_groups"][0]["amsgrad"] is False
        )
        assert all(
            inner["state"][k]["step"] == 3 and inner["state"][k]["exp_avg"].numel() == sizes[k]
            for k in range(len(names))
        )
        assert type(zero["loss_scaler"]) is LossScaler and zero["loss_scaler"].cur_scale == 1.0
        assert zero["dynamic_loss_scale"] is False and zero["partition_count"] == n
        assert set(states["frozen_param_fragments"]) == {
            f"model.layers.{i}.input_layernorm.weight" for i in (0, 1)
        }
        assert states["deepspeed_resume"] == []


@pytest.mark.parametrize("n", [1, 2])
def test_the_checksums_cover_every_file(runs, n, tmp_path):
    """Every rank's manifest names its two files (all the folder holds), megatrain_ds's load
    verifies them, and a flipped byte in what DeepSpeed reads (the loss scaler and Adam state live
    in the optimizer file) is refused."""
    from megatrain_ds.checkpoints.checksums import ChecksumError, verify

    folder = runs.ck[n] / "global_step3"
    listed = []
    for r in range(n):
        listed += [
            line.split("  ")[1].strip()
            for line in (folder / f"zero_pp_rank_{r}_checksums.sha256").open()
        ]
    assert sorted(listed) == sorted(f for f in os.listdir(folder) if not f.endswith(".sha256"))
    assert sum(verify(str(folder), r, n) for r in range(n)) == 2 * n
    broken = tmp_path / "step"
    shutil.copytree(folder, broken)
    name = f"zero_pp_rank_{n - 1}_mp_rank_00_optim_states.pt"
    data = bytearray((broken / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (broken / name).write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=f"{name} is corrupted"):
        verify(str(broken), (n - 1) % n, n)


def test_the_previous_megatrain_layout_still_loads(runs, tmp_path):
    """Checkpoints megatrain_ds wrote before the way back (its own flat moments, no DeepSpeed loss
    scaler) resume as before: the 1-rank checkpoint rewritten so, loaded by megatrain_ds, continues
    as the new one did."""
    import megatrain_ds

    old = tmp_path / "old"
    shutil.copytree(runs.ck[1], old)
    os.remove(old / "global_step3" / "zero_pp_rank_0_checksums.sha256")
    path = old / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim = torch.load(path, weights_only=False)
    zero = optim["optimizer_state_dict"]
    inner = zero["optimizer_state_dict"]
    state = [inner["state"][k] for k in range(len(inner["state"]))]
    zero["optimizer_state_dict"] = {
        "step_count": state[0]["step"],
        "adam_w_mode": True,
        "resident_exp_avg": [],
        "resident_exp_avg_sq": [],
        "param_groups": [
            {k: v for k, v in g.items() if k not in ("params", "bias_correction", "amsgrad")}
            for g in inner["param_groups"]
        ],
        "exp_avg": torch.cat([s["exp_avg"] for s in state]),
        "exp_avg_sq": torch.cat([s["exp_avg_sq"] for s in state]),
    }
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow"):
        del zero[key]
    torch.save(optim, path)
    script = _script()
    config = {**CONFIG, "train_batch_size": 2}
    engine = script.start(megatrain_ds, config, seed=1)
    engine.load_checkpoint(str(old))
    record = {"loss": [], "lr": []}
    script.train(engine, 3, 3, 0, record)
    engine.destroy()
    assert record == runs.mt1[0]["resume"]


def test_sub_groups_cut_where_deepspeed_cuts():
    """wayback.sub_groups against DeepSpeed's own _create_fp16_sub_groups, on partition sizes around
    the cut."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from megatrain_ds.checkpoints.wayback import sub_groups

    class Param:
        def __init__(self, numel: int, world: int) -> None:
            self.numel, self.part = numel, -(-numel // world)

        def partition_numel(self) -> int:
            return self.part

    g = torch.Generator().manual_seed(0)
    for world in (1, 2, 3):
        for size in (1, 7, 50, 120, 10**9):
            params = [Param(int(k), world) for k in torch.randint(1, 60, (12,), generator=g)]
            theirs = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(
                SimpleNamespace(sub_group_size=size), params
            )
            ours = sub_groups([params], lambda p: p.numel, world, size)
            assert [params for _, params in ours] == theirs, (world, size)


def test_what_deepspeed_cannot_resume_is_named():
    from megatrain_ds.checkpoints.wayback import resume_problems

    assert resume_problems(CONFIG, []) == []
    stage2 = resume_problems({**CONFIG, "zero_optimization": {"stage": 2}}, [])
    assert len(stage2) == 1 and "zero_optimization.stage is 2" in stage2[0]
    nvme = resume_problems(
        {
            **CONFIG,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
            },
        },
        ["lm_head.weight"],
    )
    assert "offloaded_tensors" in nvme[0] and "lm_head.weight" in nvme[1] and len(nvme) == 2
