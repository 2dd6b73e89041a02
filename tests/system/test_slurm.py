"""SLURM as its users run it: a real munged, slurmctld and slurmd on this machine
(tests/system/services_slurm.py),
jobs started with srun and sbatch, and the ranks train exactly as under ``torchrun --nproc_per_node
2``.

- ``srun -N1 -n2 python train.py``: each SLURM task is a rank. Nothing sets RANK or WORLD_SIZE;
megatrain_ds's
  ``init_distributed`` (called by ``initialize``) reads SLURM_PROCID, SLURM_STEP_NUM_TASKS,
  SLURM_LOCALID and the
  step's node list (``comm.slurm_discovery``), where DeepSpeed's would try MPI discovery (mpi4py).
- ``sbatch`` of a script whose step is ``srun torchrun --nproc_per_node 2 train.py``: torchrun
inside the allocation
  sets the ranks itself.

The script is tests/scripts/cluster_train.py (a tiny Llama, 5 steps, 2 ranks on CPU); each launch's
per-rank losses
equal the torchrun run's bit for bit.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain_ds.parallel.comm import first_host, slurm_discovery
from tests.launch import run_again_after_exit_abort
from tests.scripts import cluster_train as ct
from tests.system.services_slurm import slurm_cluster

STEPS = 5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def _run(launch, tmp: Path) -> Path:
    """``launch(folder)`` -> (command, env, the job's log file or None), run in a fresh folder
    (launched again after
    the exit-time abort tests/launch.py describes); returns the folder, whose ``out`` holds the
    ranks' records."""
    attempt = iter(range(3))

    def once():
        folder = tmp / f"attempt{next(attempt)}"
        folder.mkdir()
        cmd, env, job_log = launch(folder)
        proc = subprocess.run(
            [str(c) for c in cmd], env=env, cwd=folder, capture_output=True, text=True, timeout=300
        )
        if job_log is not None and job_log.exists():
            proc.stderr += job_log.read_text()
        proc.folder = folder
        return proc

    proc = run_again_after_exit_abort(once)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.folder / "out"


def test_srun_tasks_are_the_ranks(cluster, tmp_path):
    """``srun -N1 -n2 python cluster_train.py``: 2 ranks of one world, ranks from SLURM, the
    torchrun losses."""
    out = _run(
        lambda d: (
            [
                "srun",
                "-N1",
                "-n2",
                "--kill-on-bad-exit=1",
                sys.executable,
                ct.SCRIPT,
                "--out",
                d / "out",
                "--steps",
                STEPS,
            ],
            ct.launch_env(
                cluster, MASTER_PORT=str(_port())
            ),  # no MASTER_ADDR: the step's first host
            None,
        ),
        tmp_path,
    )
    recs = ct.records(str(out))
    for rank, lines in recs.items():
        assert lines and all(
            (e["rank"], e["world"], e["env_rank"], e["local_rank"])
            == (rank, 2, str(rank), str(rank))
            for e in lines
        ), lines
        assert all(e["restart"] == -1 for e in lines)  # not torchrun: SLURM's tasks
    assert ct.losses(str(out)) == ct.reference_losses(STEPS)


def test_sbatch_srun_torchrun(cluster, tmp_path):
    """A batch script whose step runs torchrun (one task of 2 cores, torchrun's 2 workers): the
    torchrun losses."""

    def launch(folder: Path):
        batch, log = folder / "job.sh", folder / "job.log"
        torchrun = " ".join(ct.torchrun("--out", folder / "out", "--steps", STEPS))
        batch.write_text(f"#!/bin/bash\n#SBATCH -N1 -n1 -c2 -o {log}\nsrun {torchrun}\n")
        return ["sbatch", "-W", batch], ct.launch_env(cluster), log

    out = _run(launch, tmp_path)
    recs = ct.records(str(out))
    assert all(
        lines and all(e["restart"] == 0 and e["world"] == 2 for e in lines)
        for lines in recs.values()
    ), recs
    assert ct.losses(str(out)) == ct.reference_losses(STEPS)


def test_slurm_discovery_reads_a_step_only(monkeypatch):
    """Unit: the variables a step's task gets; a batch script's shell (no SLURM_STEP_NUM_TASKS) and
    torchrun inside
    srun (RANK set) are left alone."""
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ct.LAUNCH_ENV:
            monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    assert not slurm_discovery() and "RANK" not in os.environ  # the batch shell: one process
    for k, v in {
        "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
        "SLURM_STEP_NODELIST": "gpu[07-09]",
    }.items():
        monkeypatch.setenv(k, v)
    assert slurm_discovery(port=29511)
    got = {
        k: os.environ[k]
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    assert got == {
        "RANK": "5",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "29511",
    }
    monkeypatch.setenv("RANK", "3")  # torchrun's (srun torchrun): kept
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert not slurm_discovery() and os.environ["RANK"] == "3"
    assert [first_host(n) for n in ("vm", "a[1-2]-b[03-04],c", "n[3]", "x1,x2")] == [
        "vm",
        "a1-b03",
        "n3",
        "x1",
    ]


def test_srun_ends_every_task_when_a_rank_hangs(cluster, tmp_path):
    """Rank 1 sleeps for ever between backward() and step() of step 2: rank 0's engine names it
    within
    ``collective_timeout`` (3 s) and exits 1; ``srun --kill-on-bad-exit=1`` then ends the hung task
    (without it
    srun would wait for that task until the job's time limit)."""
    out, timeout = tmp_path / "out", 3.0
    proc = subprocess.run(
        [
            str(c)
            for c in [
                "srun",
                "-N1",
                "-n2",
                "--kill-on-bad-exit=1",
                sys.executable,
                ct.SCRIPT,
                "--out",
                out,
                "--steps",
                STEPS,
                "--timeout",
                timeout,
                "--hang-rank",
                1,
                "--hang-at",
                2,
            ]
        ],
        env=ct.launch_env(cluster, MASTER_PORT=str(_port())),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ended = time.time()
    assert proc.returncode != 0
    recs = ct.records(str(out))
    hang = next(e["time"] for e in recs[1] if e.get("fault") == "hang")
    error = next(e["error"] for e in recs[0] if "error" in e)
    assert (
        error["type"] == "CollectiveError" and timeout - 0.5 <= error["time"] - hang <= timeout + 10
    )
    assert ended - hang <= timeout + 45, ended - hang
    for said in (
        "did not arrive: rank 1.",
        "rank 1 (did not arrive; host ",
        "between backward() and step() of micro-step 2: backward() returned",
    ):
        assert said in error["message"], error["message"]
