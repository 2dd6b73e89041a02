"""``accelerate launch`` on two machines (machine_rank 0 and 1, one process each) with a DeepSpeed
config, under
``MEGATRAIN_DS=1``: every rank runs megatrain_ds's engine and the two machines train as one machine
of two processes.

    # standard launcher (torchrun underneath): one launch per machine, each with the switch in its
    environment
    MEGATRAIN_DS=1 accelerate launch --config_file machines.yaml --machine_rank 0 train.py      # on
    127.0.0.1
    MEGATRAIN_DS=1 accelerate launch --config_file machines.yaml --machine_rank 1 train.py      # on
    the other
    # pdsh (deepspeed_multinode_launcher: pdsh, deepspeed_hostfile: hosts): one launch, DeepSpeed's
    runner and
    # pdsh start every machine's rank over ssh
    MEGATRAIN_DS=1 accelerate launch --config_file machines_pdsh.yaml train.py

The yamls are examples/accelerate_ds.yaml (ZeRO-3 offload, GA 2) with ``num_machines: 2``,
``num_processes: 2``,
``main_process_ip: 127.0.0.1``. The machines are this host (standard) or node0 -> 127.0.0.1 and
node1 -> 127.0.0.2
behind a real sshd (pdsh: tests/system/services_ssh.py). Script: tests/scripts/dp_accelerate.py
(through
tests/scripts/rank_env.py, which records what reached each rank); the reference is ``accelerate
launch
--num_processes 2`` on one machine: losses, grad norms, shards and weights equal.

accelerate's pdsh path writes its whole environment into ``.deepspeed_env`` in the launch folder
(appending, every
launch), so the switch reaches the other machines through that file as well as through the runner's
exports
(compat/launcher_env.py).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.test_dp_launchers import (
    ENGINE_LINE,
    MICRO,
    REPO,
    SCRIPTS,
    WORLD,
    _check_world,
    _close,
    _env,
    _port,
    _same_weights,
    needs_switch,
)
from tests.launch import run_again_after_exit_abort, wait_both
from tests.system.services_ssh import launch, ssh_hosts  # noqa: F401 (the fixture)

pytestmark = needs_switch

RANK_ENV = SCRIPTS / "rank_env.py"


def _yaml(path: Path, **changes) -> Path:
    config = yaml.safe_load((REPO / "examples" / "accelerate_ds.yaml").read_text())
    deepspeed = changes.pop("deepspeed_config", {})
    config.update(changes)
    config["deepspeed_config"].update(deepspeed)
    path.write_text(yaml.safe_dump(config))
    return path


def _machines_yaml(path: Path, port: int, **deepspeed) -> Path:
    return _yaml(
        path,
        num_machines=2,
        num_processes=WORLD,
        machine_rank=0,
        main_process_ip="127.0.0.1",
        main_process_port=port,
        deepspeed_config=deepspeed,
    )


def _launch_cmd(config: Path, out: Path, *extra) -> list:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config,
        *extra,
        RANK_ENV,
        SCRIPTS / "dp_accelerate.py",
        "--out",
        out,
        "--batch_size",
        str(MICRO),
    ]


def _env_with_bin(folder: Path) -> dict:
    """The switch on, and this venv's ``deepspeed`` first on PATH (accelerate's pdsh path runs
    ``deepspeed`` by name).
    Only that script: the venv's ``bin`` would also put its own ``ninja`` first, whose build-command
    hashes differ
    from the system's, so every DeepSpeed op loaded afterwards would be compiled again (and again by
    the next
    process that finds the other ninja)."""
    (folder / "bin").mkdir(exist_ok=True)
    link = folder / "bin" / "deepspeed"
    if not link.exists():
        link.symlink_to(Path(sys.executable).parent / "deepspeed")
    env = _env(switch=True)
    env["PATH"] = f"{folder / 'bin'}:{env.get('PATH', '')}"
    return env


def _reports(out: Path, log: str) -> tuple[list[dict], list[dict]]:
    try:
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
        envs = [json.loads((out / f"env{r}.json").read_text()) for r in range(WORLD)]
    except FileNotFoundError as missing:
        raise AssertionError(f"{missing}\n{log[-8000:]}") from None
    return reports, envs


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    """``MEGATRAIN_DS=1 accelerate launch --num_processes 2`` on one machine: what two machines must
    equal."""
    tmp = tmp_path_factory.mktemp("one_machine")
    cmd = _launch_cmd(
        REPO / "examples" / "accelerate_ds.yaml",
        tmp / "out",
        "--num_processes",
        str(WORLD),
        "--main_process_port",
        str(_port()),
    )
    proc = run_again_after_exit_abort(lambda: launch(cmd, _env_with_bin(tmp), tmp))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    reports, _ = _reports(tmp / "out", proc.stdout + proc.stderr)
    return {"reports": reports, "weights": torch.load(tmp / "out" / "rank0.pt")}


def _same_training(reports: list[dict], envs: list[dict], one_machine: dict, weights: dict) -> None:
    _check_world(reports)
    assert [env["MEGATRAIN_DS"] for env in envs] == ["1", "1"]
    for rank, (ours, ref) in enumerate(zip(reports, one_machine["reports"])):
        assert (ours["num_processes"], ours["process_index"], ours["is_main_process"]) == (
            WORLD,
            rank,
            rank == 0,
        )
        assert (
            ours["config_train_batch_size"] == ours["train_batch_size"] == ref["train_batch_size"]
        )
        assert ours["batches"] == ref["batches"]
        _close(ours["loss"], ref["loss"], "loss")
        _close(ours["grad_norm"], ref["grad_norm"], "grad_norm")
        assert ours["gathered_loss"] == [
            [r["loss"][step] for r in reports] for step in range(len(ours["loss"]))
        ]
    _same_weights(weights, one_machine["weights"], rtol=1e-5, atol=1e-7)


def test_standard_launcher_two_machines(one_machine, tmp_path):
    """Two ``accelerate launch`` processes, machine_rank 0 and 1 (torchrun --nnodes 2 underneath):
    each machine's
    launch carries the switch in its own environment, as each machine's shell would."""
    port, out = _port(), tmp_path / "out"
    config = _machines_yaml(
        tmp_path / "machines.yaml", port, deepspeed_multinode_launcher="standard"
    )

    def both():
        logs, procs = [], []
        for machine in (0, 1):
            logs.append(open(tmp_path / f"machine{machine}.log", "w+"))
            procs.append(
                subprocess.Popen(
                    [str(c) for c in _launch_cmd(config, out, "--machine_rank", str(machine))],
                    cwd=tmp_path,
                    env=_env_with_bin(tmp_path),
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        wait_both(procs, limit=300)
        text = []
        for f in logs:
            f.seek(0)
            text.append(f.read())
            f.close()
        failed = [p for p in procs if p.returncode != 0]
        proc = (failed or procs)[0]
        return subprocess.CompletedProcess(proc.args, proc.returncode, "", "\n".join(text))

    proc = run_again_after_exit_abort(both)
    assert proc.returncode == 0, proc.stderr[-8000:]
    machine_logs = [(tmp_path / f"machine{m}.log").read_text() for m in (0, 1)]
    for machine, log in enumerate(
        machine_logs
    ):  # each machine's own rank: its engine line in its own log
        assert f"{ENGINE_LINE}" in log and f"(rank {machine} of {WORLD})" in log, log[-4000:]
    reports, envs = _reports(out, proc.stderr)
    assert [env["SSH_CONNECTION"] for env in envs] == [None, None]
    _same_training(reports, envs, one_machine, torch.load(out / "rank0.pt"))


def test_pdsh_launcher_two_machines(ssh_hosts, one_machine, tmp_path):
    """One ``accelerate launch`` with ``deepspeed_multinode_launcher: pdsh``: DeepSpeed's runner,
    then pdsh over
    real ssh to node0 and node1, each rank in a fresh ssh session."""
    out = tmp_path / "out"
    hostfile = ssh_hosts.hostfile(tmp_path / "hosts")
    config = _machines_yaml(
        tmp_path / "machines_pdsh.yaml",
        _port(),
        deepspeed_multinode_launcher="pdsh",
        deepspeed_hostfile=str(hostfile),
    )
    proc = run_again_after_exit_abort(
        lambda: launch(
            _launch_cmd(config, out),
            ssh_hosts.env(_env_with_bin(tmp_path)),
            tmp_path,
            hosts=ssh_hosts,
        )
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:] + "\nsshd log:\n" + ssh_hosts.log()[-2000:]
    engine_lines = [line for line in log.splitlines() if ENGINE_LINE in line]
    assert len(engine_lines) == WORLD, log[-8000:]
    for rank in range(WORLD):  # pdsh prefixes each machine's output with its name
        assert any(
            line.startswith(f"node{rank}: {ENGINE_LINE}")
            and line.endswith(f"(rank {rank} of {WORLD})")
            for line in engine_lines
        ), engine_lines
    reports, envs = _reports(out, log)
    for rank, env in enumerate(envs):  # rank r ran in an ssh session to machine r's address
        assert env["SSH_CONNECTION"].split()[2] == ssh_hosts.hosts[f"node{rank}"], env
    assert (
        "MEGATRAIN_DS=1\n" in (tmp_path / ".deepspeed_env").read_text()
    )  # accelerate's own copy of its env
    _same_training(reports, envs, one_machine, torch.load(out / "rank0.pt"))
