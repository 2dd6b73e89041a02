"""The switch crosses hosts: with ``MEGATRAIN_DS=1`` in the ``deepspeed`` runner's environment, the
command its pdsh
runs on every host exports it (compat/launcher_env.py). A drift test (tests/drift.py): it rests on
how DeepSpeed's
runner builds its exports, which a release may change.

No services: a stand-in ``pdsh`` first on PATH writes the arguments it was given (the remote command
among them) and
exits 0, so the real runner runs to its end (``--no_ssh_check``: no ssh either). The launches with
real sshd and pdsh
are in test_pdsh_launch.py.
"""

import os
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _deepspeed() -> str:
    here = Path(sys.executable).parent / "deepspeed"
    found = str(here) if here.is_file() else shutil.which("deepspeed")
    assert found, "no `deepspeed` launcher next to this python or on PATH"
    return found


def _remote_command(tmp_path: Path, switch: bool) -> str:
    """What the runner asks pdsh to run on each host, for a 2-host hostfile."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pdsh").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "pdsh.args"}\n')
    (bin_dir / "pdsh").chmod(0o755)
    (tmp_path / "hosts").write_text("node0 slots=1\nnode1 slots=1\n")
    (tmp_path / "train.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_DS")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        CUDA_VISIBLE_DEVICES="",
    )
    if switch:
        env["MEGATRAIN_DS"] = "1"
    proc = subprocess.run(
        [
            _deepspeed(),
            "--hostfile",
            "hosts",
            "--launcher",
            "pdsh",
            "--no_ssh_check",
            "--master_addr",
            "127.0.0.1",
            "train.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    args = (tmp_path / "pdsh.args").read_text().splitlines()
    assert args[args.index("-w") + 1] == "node0,node1"
    return " ".join(args[args.index("-w") + 2 :])


def test_switch_is_exported_to_every_host(tmp_path):
    command = _remote_command(tmp_path, switch=True)
    exports = [
        part.strip() for part in command.split(";")[:-1] if part.strip().startswith("export ")
    ]
    assert "export MEGATRAIN_DS=1" in exports, command
    assert command.index("export MEGATRAIN_DS=1") < command.index("deepspeed.launcher.launch")
    python = Path(
        shlex.split(command.split(";")[-1])[0]
    )  # every host runs the runner's own python (its venv)
    assert python.parent == Path(_deepspeed()).parent, command


def test_without_the_switch_nothing_is_exported(tmp_path):
    assert "MEGATRAIN_DS" not in _remote_command(tmp_path, switch=False)


def test_runner_still_builds_exports_from_export_envs():
    """What compat/launcher_env.py checks at import, against the installed DeepSpeed."""
    import deepspeed.launcher.runner as runner

    from compat import launcher_env

    assert launcher_env.drift(runner) is None


@pytest.mark.parametrize(
    "runner",
    [
        types.SimpleNamespace(main=lambda: None),  # EXPORT_ENVS gone
        types.SimpleNamespace(EXPORT_ENVS=("MLFLOW",), main=lambda: None),  # no longer a list
        types.SimpleNamespace(
            EXPORT_ENVS=["MLFLOW"], main=lambda: ["NCCL"]
        ),  # main builds its exports otherwise
    ],
    ids=["no-export-envs", "tuple", "main-ignores-it"],
)
def test_a_drifted_runner_refuses_to_launch(runner):
    """A runner that no longer builds its exports from EXPORT_ENVS: its main stops, saying what to
    do, instead of
    launching every other host on real DeepSpeed."""
    from compat import launcher_env

    launcher_env.export_switch(runner)
    with pytest.raises(RuntimeError, match=r"MEGATRAIN_DS=1 in \.deepspeed_env"):
        runner.main()
    assert "MEGATRAIN_DS" not in getattr(runner, "EXPORT_ENVS", ())


def test_export_is_added_once():
    from compat import launcher_env

    exports = ["MLFLOW", "PYTHON"]

    def main():
        return EXPORT_ENVS  # noqa: F821 (a global the check looks for by name)

    runner = types.SimpleNamespace(EXPORT_ENVS=exports, main=main)
    launcher_env.export_switch(runner)
    launcher_env.export_switch(runner)
    assert exports == ["MLFLOW", "PYTHON", "MEGATRAIN_DS"] and runner.main is main
