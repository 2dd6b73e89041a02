"""A one-node SLURM cluster on this machine, as a site runs one: munged with a key of its own,
slurmctld and slurmd
(Debian's munge and slurm-wlm, which .ci/system-packages.sh installs), every file in one temporary
folder.

    with slurm_cluster(folder) as env:          # env: os.environ + SLURM_CONF
        subprocess.run(["srun", "-N1", "-n2", "hostname"], env=env)

Root only (munged runs as root with --force; slurmd as root). The daemons run in the foreground as
children of this
process (``-F`` / ``-D``) on free ports; on exit every job is cancelled and each daemon is stopped
by its pid
(SIGTERM, then SIGKILL). A daemon that does not come up raises, with its log: nothing is skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 60.0
# the CI machine's cores; tasks may oversubscribe nothing else (task/none: no binding, no cgroups)
CPUS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(folder: Path, munge_socket: Path, node: str) -> str:
    """slurm.conf for one node of ``CPUS`` cores, no accounting, state and spool under
    ``folder``."""
    return "\n".join(
        [
            "ClusterName=mtds-test",
            "SlurmctldHost=localhost",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=5",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} not written)"


def _wait_for(
    what: str, ready, procs: dict, logs: list[Path], timeout: float = START_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited (status {proc.returncode}) before {what}:\n"
                    + "\n".join(f"--- {p}\n{_tail(p)}" for p in logs)
                )
        time.sleep(0.2)
    raise RuntimeError(
        f"no {what} within {timeout:g} s:\n" + "\n".join(f"--- {p}\n{_tail(p)}" for p in logs)
    )


def _stop(procs: dict) -> None:
    for proc in reversed(list(procs.values())):  # slurmd, slurmctld, then munged
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def slurm_cluster(folder: Path):
    """munged + slurmctld + slurmd under ``folder``; yields the environment for srun/sbatch/sinfo
    (SLURM_CONF)."""
    missing = [
        exe
        for exe in ("munged", "slurmctld", "slurmd", "srun", "sinfo")
        if shutil.which(exe) is None
    ]
    if missing:
        raise RuntimeError(
            f"SLURM is not installed ({', '.join(missing)} not found): run .ci/system-packages.sh"
        )
    folder = Path(folder)
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key, sock = folder / "munge.key", folder / "munge.sock"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder, sock, node))
    env = dict(os.environ, SLURM_CONF=str(conf))
    for k in [
        k
        for k in env
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"
    ]:
        del env[k]  # a test run inside a SLURM job: these would describe the outer job
    procs: dict[str, subprocess.Popen] = {}
    logs = [folder / "munged.log", folder / "slurmctld.out", folder / "slurmd.out"]

    def start(name: str, cmd: list[str], out: Path) -> None:
        with open(out, "w") as f:
            procs[name] = subprocess.Popen(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=folder
            )

    try:
        start(
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--log-file={folder / 'munged.log'}",
                f"--pid-file={folder / 'munged.pid'}",
                f"--seed-file={folder / 'munged.seed'}",
            ],
            folder / "munged.out",
        )
        logs.insert(0, folder / "munged.out")
        _wait_for(
            "munge socket",
            lambda: (
                subprocess.run(["munge", "-S", str(sock), "-n"], capture_output=True).returncode
                == 0
            ),
            procs,
            logs,
        )
        start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)], folder / "slurmctld.out")
        _wait_for(
            "slurmctld answering",
            lambda: subprocess.run(["sinfo", "-h"], env=env, capture_output=True).returncode == 0,
            procs,
            logs,
        )
        start("slurmd", ["slurmd", "-D", "-f", str(conf), "-N", node], folder / "slurmd.out")
        _wait_for(
            f"node {node} idle in sinfo",
            lambda: (
                subprocess.run(
                    ["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True
                ).stdout.strip()
                == "idle"
            ),
            procs,
            logs,
        )
        yield env
    finally:
        if "slurmctld" in procs and procs["slurmctld"].poll() is None:
            subprocess.run(
                ["scancel", "--full", "--quiet", f"--user={os.getuid()}"], env=env, timeout=30
            )
            deadline = time.monotonic() + 30
            while (
                time.monotonic() < deadline
                and subprocess.run(
                    ["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30
                ).stdout.strip()
            ):
                time.sleep(0.5)
        _stop(procs)
