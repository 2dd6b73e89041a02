"""Two "hosts" on this machine behind an sshd of the test's own, and an ssh client that reaches them
as pdsh does.

    from tests.system.services_ssh import ssh_hosts  # noqa: F401  (the fixture, for a test module)

    def test_x(ssh_hosts, tmp_path):
        ssh_hosts.hostfile(tmp_path / "hosts")                  # node0 slots=1 / node1 slots=1
        subprocess.run(["pdsh", "-w", "node0,node1", "hostname"], env=ssh_hosts.env(os.environ))

- The sshd: a free port on 127.0.0.1 and 127.0.0.2 (both loopback), a host key made for it, root by
key only (one
  ``authorized_keys`` of its own: the system's files are not read), its log in ``ROOT/sshd.log``. It
  needs the
  privilege-separation folder ``/run/sshd`` (Debian's service creates it at boot; made here if
  absent, and kept).
- The client: an ``ssh_config`` that maps ``node0`` -> 127.0.0.1 and ``node1`` -> 127.0.0.2 (port,
key, no host-key
  prompt, batch mode), used through a ``ssh`` wrapper (``exec ssh -F ssh_config "$@"``) first on
  ``PATH``. OpenSSH
  reads ``~/.ssh/config`` from the passwd home, not ``$HOME``, so the wrapper keeps root's own
  config untouched, and
  both callers find it on ``PATH``: DeepSpeed's runner (its ``ssh node0 hostname`` check) and pdsh's
  ssh module.
- Teardown stops every process the sshd started (the sessions pdsh opened, and what runs in them)
and then the sshd,
  each by its pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HOSTS = {"node0": "127.0.0.1", "node1": "127.0.0.2"}  # ssh name -> loopback address
MISSING = "run .ci/system-packages.sh (Debian's openssh-server, openssh-client, pdsh)"


@dataclass(kw_only=True)
class SshHosts:
    """A running sshd and the client files that reach it."""

    root: Path
    """Folder of the keys, configs, the wrapper and the sshd's log."""
    port: int
    hosts: dict[str, str] = field(default_factory=lambda: dict(HOSTS))
    """ssh name -> address the sshd listens on."""
    sshd: subprocess.Popen | None = None

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    def env(self, base: dict, **extra: str) -> dict:
        """``base`` with the ssh wrapper first on PATH (and ``extra``)."""
        env = dict(base, **extra)
        env["PATH"] = os.pathsep.join(p for p in (str(self.bin_dir), env.get("PATH")) if p)
        return env

    def hostfile(self, path: Path, slots: int = 1) -> Path:
        """A DeepSpeed hostfile naming every host with ``slots`` slots."""
        path.write_text("".join(f"{name} slots={slots}\n" for name in self.hosts))
        return path

    def ssh(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin_dir / "ssh"), host, command],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def log(self) -> str:
        path = self.root / "sshd.log"
        return path.read_text() if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> None:
    subprocess.run(
        [
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "megatrain_ds-tests",
            "-f",
            str(path),
        ],
        check=True,
        capture_output=True,
    )


def _write_configs(h: SshHosts) -> None:
    listen = "".join(f"ListenAddress {address}\n" for address in sorted(set(h.hosts.values())))
    (h.root / "sshd_config").write_text(
        f"Port {h.port}\n{listen}HostKey {h.root / 'host_key'}\nPidFile {h.root / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {h.root / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication "
        "no\nUsePAM no\n"
        "StrictModes no\nX11Forwarding no\nPrintMotd no\nMaxStartups 64\n"
    )
    names = "".join(f"Host {name}\n  HostName {address}\n" for name, address in h.hosts.items())
    (h.root / "ssh_config").write_text(
        f"{names}Host *\n  Port {h.port}\n  User root\n  IdentityFile {h.root / 'id_key'}\n  "
        "IdentitiesOnly yes\n"
        "  BatchMode yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel "
        "ERROR\n"
    )
    h.bin_dir.mkdir(exist_ok=True)
    wrapper = h.bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {h.root / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)


def start_sshd(root: Path, hosts: dict[str, str] | None = None, wait_s: float = 20) -> SshHosts:
    """Start an sshd for ``hosts`` (default: node0, node1) with its files under ``root``; fails
    naming what is
    missing, or with the sshd's log when no host answers."""
    sshd_bin = shutil.which("sshd") or (
        "/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None
    )
    for tool, path in (
        ("sshd", sshd_bin),
        ("ssh", shutil.which("ssh")),
        ("ssh-keygen", shutil.which("ssh-keygen")),
        ("pdsh", shutil.which("pdsh")),
    ):
        assert path, f"{tool} is not installed: {MISSING}"
    root.mkdir(parents=True, exist_ok=True)
    h = SshHosts(root=root, port=_free_port(), **({"hosts": hosts} if hosts else {}))
    _keygen(root / "host_key")
    _keygen(root / "id_key")
    shutil.copy(root / "id_key.pub", root / "authorized_keys")
    (root / "authorized_keys").chmod(0o600)
    _write_configs(h)
    os.makedirs(
        "/run/sshd", mode=0o755, exist_ok=True
    )  # privilege separation (sshd refuses to start without it)
    check = subprocess.run(
        [sshd_bin, "-t", "-f", str(root / "sshd_config")], capture_output=True, text=True
    )
    assert check.returncode == 0, f"sshd rejects its config: {check.stderr}"
    with open(root / "sshd.log", "w") as log:
        h.sshd = subprocess.Popen(
            [sshd_bin, "-D", "-e", "-f", str(root / "sshd_config")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + wait_s
    for name in h.hosts:
        while True:
            assert h.sshd.poll() is None, f"sshd exited ({h.sshd.returncode}):\n{h.log()}"
            probe = h.ssh(name, "echo ok")
            if probe.returncode == 0 and probe.stdout.strip() == "ok":
                break
            if time.monotonic() > deadline:
                stop_sshd(h)
                raise AssertionError(
                    f"ssh {name} does not answer: {probe.stderr}\nsshd log:\n{h.log()}"
                )
            time.sleep(0.2)
    return h


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children first found, then theirs)."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_sshd(h: SshHosts) -> None:
    """Stop what the sshd's sessions still run (a launch cut short), then the sshd; each by its
    pid."""
    if h.sshd is None:
        return
    for pid in descendants(h.sshd.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if h.sshd.poll() is None:
        h.sshd.terminate()
        try:
            h.sshd.wait(10)
        except subprocess.TimeoutExpired:
            h.sshd.kill()
            h.sshd.wait()
    h.sshd = None


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory):
    """node0 (127.0.0.1) and node1 (127.0.0.2) behind a running sshd, for the module's tests;
    stopped after."""
    h = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield h
    finally:
        stop_sshd(h)


def launch(
    cmd: list, env: dict, cwd: Path, timeout: float = 300, hosts: SshHosts | None = None
) -> subprocess.CompletedProcess:
    """Run a launcher to its end in a session of its own; past ``timeout`` its whole group (pdsh,
    its ssh clients)
    is killed, and so is what ``hosts``' sshd still runs for it, and the result says so (returncode
    -9)."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[services_ssh.launch] stopped after {timeout} s"
        if hosts is not None and hosts.sshd is not None:
            for pid in descendants(hosts.sshd.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
