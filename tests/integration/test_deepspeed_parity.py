"""The same DeepSpeed tutorial-style script, run by real DeepSpeed (ZeRO-3, CPU offload, gloo on
CPU) and by megatrain_ds (only the import line changed): per-step losses, learning rates and grad
norms agree.

Config: tests/scripts/tutorial_ds_config.json (AdamW, WarmupDecayLR, GA 2, clipping 1.0, fp32,
csv_monitor): the monitor files the two runs write (DeepSpeed's csv writer, relative to each run's
folder) agree too. The DeepSpeed run JIT-builds its CPU Adam op on first use (~1-2 min on a 2-core
machine, then cached).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/
SCRIPT = HERE / "scripts" / "tutorial_train.py"
CONFIG = HERE / "scripts" / "tutorial_ds_config.json"
REPO = HERE.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: Path, out: Path, cwd: Path) -> dict:
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
        str(script),
        "--deepspeed",
        "--deepspeed_config",
        str(CONFIG),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    (tmp / "deepspeed").mkdir()
    (tmp / "megatrain").mkdir()
    real = _run(SCRIPT, tmp / "deepspeed.json", tmp / "deepspeed")
    ours_script = tmp / "tutorial_train_megatrain.py"
    text = SCRIPT.read_text()
    assert text.count("\nimport deepspeed\n") == 1
    ours_script.write_text(
        text.replace("\nimport deepspeed\n", "\nimport megatrain_ds as deepspeed\n")
    )
    ours = _run(ours_script, tmp / "megatrain.json", tmp / "megatrain")
    real["monitor"], ours["monitor"] = (
        tmp / "deepspeed" / "monitor" / "run",
        tmp / "megatrain" / "monitor" / "run",
    )
    return real, ours


@pytest.mark.parametrize("key", ["loss", "lr", "grad_norm"])
def test_matches_real_deepspeed(both_runs, key):
    real, ours = both_runs
    assert len(ours[key]) == len(real[key]) > 0
    for step, (got, want) in enumerate(zip(ours[key], real[key])):
        assert abs(got - want) <= 1e-5 * max(abs(want), 1e-8), (
            f"{key} at step {step}: {got} vs {want}"
        )


def test_the_run_trained(both_runs):
    """The comparison must be about a run that moved: the schedule warmed up and the loss fell."""
    real, _ = both_runs
    assert real["lr"][0] < real["lr"][5] and real["lr"][-1] < real["lr"][5]
    assert sum(real["loss"][-8:]) / 8 < sum(real["loss"][:8]) / 8


def test_monitor_writes_deepspeeds_events(both_runs):
    """csv_monitor: the same files, rows and values as DeepSpeed's (the learning rate per optimizer
    step, x = samples seen)."""
    real, ours = both_runs
    want = sorted(p.name for p in real["monitor"].iterdir())
    assert (
        want == ["Train_Samples_lr.csv"]
        and sorted(p.name for p in ours["monitor"].iterdir()) == want
    )
    rows_real = (real["monitor"] / want[0]).read_text().splitlines()
    rows_ours = (ours["monitor"] / want[0]).read_text().splitlines()
    # a row per optimizer step
    assert rows_real[0] == "step,lr" and len(rows_real) == len(real["lr"]) + 1
    assert rows_ours == rows_real
