"""Migration: megatrain_ds resumes a checkpoint that real DeepSpeed ZeRO-3 saved.

Real DeepSpeed (ZeRO-3, one rank, optimizer offloaded to the CPU so it steps with DeepSpeedCPUAdam,
fp32, GA 2, clipping 1.0, WarmupDecayLR) trains a tiny Llama 3 steps, saves with a client state, and
trains 3 more (the uninterrupted reference). Then from that checkpoint, with a differently
initialised model, (a) megatrain_ds and
(b) DeepSpeed each train 3 more steps: their losses and learning rates agree with each other and
    with the
uninterrupted run, and the client state comes back. All runs are tests/scripts/migrate_train.py, in
subprocesses (a one-process gloo world on the CPU). DeepSpeed JIT-builds its CPU Adam op on first
use (~1 min, then cached).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/
SCRIPT = HERE / "scripts" / "migrate_train.py"
REPO = HERE.parent
CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 1000,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 1e-4,
            "warmup_max_lr": 3e-3,
            "warmup_num_steps": 2,
            "total_num_steps": 8,
        },
    },
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}
# as migrate_train.py saves it
CLIENT = {"epoch": 3, "note": "saved by the first run", "sampler": [0, 1, 2, 3]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(engine: str, out: Path, config: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--engine",
        engine,
        "--config",
        str(config),
        "--out",
        str(out),
        *flags,
    ]
    return subprocess.Popen(
        cmd, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ), out


def _finish(started) -> dict:
    proc, out = started
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    config = tmp / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    ckpt = str(tmp / "ckpt")
    saved = _finish(
        _start(
            "deepspeed", tmp / "saved.json", config, "--steps", "3", "--save", ckpt, "--then", "3"
        )
    )
    # the two resumes are independent: run them side by side
    resumes = [
        _start(
            engine, tmp / f"{engine}.json", config, "--seed", "1", "--load", ckpt, "--steps", "3"
        )
        for engine in ("deepspeed", "megatrain")
    ]
    deepspeed_run, megatrain_run = (_finish(r) for r in resumes)
    return saved, deepspeed_run, megatrain_run, tmp


def _close(got: list, want: list, what: str) -> None:
    assert len(got) == len(want) > 0, what
    for k, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * max(abs(b), 1e-8), f"{what} at {k}: {a} vs {b}"


def test_megatrain_continues_a_deepspeed_zero3_checkpoint(runs):
    saved, deepspeed_run, megatrain_run, _ = runs
    _close(megatrain_run["loss"], deepspeed_run["loss"], "loss, megatrain_ds vs DeepSpeed resuming")
    _close(megatrain_run["lr"], deepspeed_run["lr"], "lr, megatrain_ds vs DeepSpeed resuming")
    # and both continue the uninterrupted run (weights, Adam moments, step count, schedule all came
    # back)
    _close(megatrain_run["loss"], saved["loss"][6:], "loss, megatrain_ds vs the uninterrupted run")
    _close(deepspeed_run["loss"], saved["loss"][6:], "loss, DeepSpeed vs the uninterrupted run")


def test_counters_and_client_state_come_back(runs):
    _, deepspeed_run, megatrain_run, tmp = runs
    path = str(tmp / "ckpt" / "global_step3")
    assert megatrain_run["resumed_at"] == [path, 3, 12]
    assert deepspeed_run["resumed_at"][1:] == [3, 12]  # DeepSpeed's path is its model-states file
    assert megatrain_run["client"] == deepspeed_run["client"] == CLIENT
    assert megatrain_run["client_keys"] == sorted(CLIENT)  # none of DeepSpeed's own keys


def test_the_saved_run_trained(runs):
    """The comparison is about a run that moved: the loss fell over the six steps."""
    saved, *_ = runs
    assert sum(saved["loss"][-4:]) < sum(saved["loss"][:4])
