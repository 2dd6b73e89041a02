"""DeepSpeed's multi-node runner over real sshd and pdsh: two "hosts" on this machine (node0 ->
127.0.0.1, node1 ->
127.0.0.2: tests/system/services_ssh.py), one rank each, both on megatrain_ds, training as one host
of two ranks.

    deepspeed --hostfile hosts --launcher pdsh --master_addr 127.0.0.1 train.py       # import
    megatrain_ds as deepspeed
    MEGATRAIN_DS=1 deepspeed --hostfile hosts --launcher pdsh --master_addr 127.0.0.1 train.py   #
    import deepspeed

pdsh starts both hosts' ranks through ssh, with a fresh environment each: only what the runner
exports reaches them.
The import swap needs nothing exported; the switch is exported by compat/launcher_env.py. Each rank
records what
reached it (tests/scripts/rank_env.py: ``MEGATRAIN_DS``, the address its ssh session came in on) and
trains
tests/scripts/dp_plain.py's tiny Qwen2 (CPU, gloo, ZeRO-3 config, GA 2, 2 steps); the losses, grad
norms, batches
and weights must equal ``torchrun --nproc_per_node 2`` running the same script on one host. The
``.deepspeed_env``
in the launch folder carries what the ranks need besides (one OpenMP thread, no CUDA, this PATH), as
a cluster's would.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_dp_launchers import (
    ENGINE_LINE,
    SCRIPTS,
    WORLD,
    _check_world,
    _close,
    _env,
    _port,
    _same_weights,
    _torchrun,
    needs_switch,
)
from tests.launch import run_again_after_exit_abort
from tests.system.services_ssh import launch, ssh_hosts  # noqa: F401 (the fixture)

DEEPSPEED = Path(sys.executable).parent / "deepspeed"
RANK_ENV = SCRIPTS / "rank_env.py"


def _reports(log: str, out: Path) -> tuple[list[dict], list[dict]]:
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    envs = [json.loads((out / f"env{r}.json").read_text()) for r in range(WORLD)]
    assert [r["dist_rank"] for r in reports] == list(range(WORLD)), log[-4000:]
    return reports, envs


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """``torchrun --nproc_per_node 2`` on one host: what the two-host launches must equal."""
    tmp = tmp_path_factory.mktemp("one_host")
    proc = run_again_after_exit_abort(
        lambda: launch(_torchrun("dp_plain.py", "--out", tmp / "out"), _env(), tmp)
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    reports = [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"reports": reports, "weights": torch.load(tmp / "out" / "rank0.pt")}


def _pdsh(
    hosts, tmp_path: Path, *script_args: str, switch: bool
) -> tuple[str, list[dict], list[dict]]:
    """``[MEGATRAIN_DS=1] deepspeed --hostfile hosts --launcher pdsh`` from ``tmp_path``; the log,
    each rank's report
    and what reached each rank."""
    hostfile = hosts.hostfile(tmp_path / "hosts")
    env = hosts.env(_env(switch=switch))
    # read by the runner from the launch folder; PATH as here, so the ranks load DeepSpeed's ops
    # with the same ninja
    # (the venv's and the system's hash build commands differently: the other one would compile them
    # again)
    (tmp_path / ".deepspeed_env").write_text(
        f"OMP_NUM_THREADS=1\nDP_FORCE_CPU=1\nPATH={env['PATH']}\n"
    )
    out = tmp_path / "out"
    cmd = [
        DEEPSPEED,
        "--hostfile",
        hostfile,
        "--launcher",
        "pdsh",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_port()),
        RANK_ENV,
        SCRIPTS / "dp_plain.py",
        "--out",
        out,
        *script_args,
    ]
    proc = run_again_after_exit_abort(lambda: launch(cmd, env, tmp_path, hosts=hosts))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:] + "\nsshd log:\n" + hosts.log()[-2000:]
    return (log, *_reports(log, out))


def _check_hosts(envs: list[dict], hosts) -> None:
    """Rank r ran in an ssh session to host r's address: pdsh started it on that host."""
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == "0"
        assert env["SSH_CONNECTION"].split()[2] == hosts.hosts[f"node{rank}"], env


def _same_training(reports: list[dict], one_host: dict, weights: dict) -> None:
    _check_world(reports)
    for ours, ref in zip(reports, one_host["reports"]):
        assert ours["batches"] == ref["batches"]
        _close(ours["loss"], ref["loss"], "loss")
        _close(ours["grad_norm"], ref["grad_norm"], "grad_norm")
    _same_weights(weights, one_host["weights"], rtol=1e-5, atol=1e-7)


def test_pdsh_two_hosts_import_swap(ssh_hosts, one_host, tmp_path):
    """``import megatrain_ds as deepspeed``: no variable needed; both hosts' ranks train on
    megatrain_ds."""
    log, reports, envs = _pdsh(ssh_hosts, tmp_path, switch=False)
    _check_hosts(envs, ssh_hosts)
    assert [env["MEGATRAIN_DS"] for env in envs] == [None, None]
    _same_training(reports, one_host, torch.load(tmp_path / "out" / "rank0.pt"))
    for rank, r in enumerate(reports):
        assert f"node{rank}: DP_REPORT " in log and r["local_rank_arg"] == 0


@needs_switch
def test_pdsh_two_hosts_switch(ssh_hosts, one_host, tmp_path):
    """``MEGATRAIN_DS=1`` for the runner and ``import deepspeed`` in the script: the runner exports
    the switch, so
    every host's rank (each started by its ssh session with a fresh environment) runs megatrain_ds's
    engine."""
    log, reports, envs = _pdsh(ssh_hosts, tmp_path, "--real", switch=True)
    _check_hosts(envs, ssh_hosts)
    assert [env["MEGATRAIN_DS"] for env in envs] == ["1", "1"]
    assert "export MEGATRAIN_DS=1;" in log  # the runner's logged pdsh command
    engine_lines = [line for line in log.splitlines() if ENGINE_LINE in line]
    assert len(engine_lines) == WORLD, log[-8000:]
    for rank in range(WORLD):  # pdsh prefixes each host's output with its name
        assert any(
            line.startswith(f"node{rank}: {ENGINE_LINE}")
            and line.endswith(f"(rank {rank} of {WORLD})")
            for line in engine_lines
        ), engine_lines
    _same_training(reports, one_host, torch.load(tmp_path / "out" / "rank0.pt"))
