"""System tests: the engine under the limits and launchers of a cluster, with real services
(cgroups, tmpfs or loop
filesystems, sshd + pdsh, munge + slurmctld + slurmd) that each test starts itself on this machine.

They need root (CI runs as root) and Debian's packages that ``.ci/system-packages.sh`` installs;
``make test-system``
runs them (``.ci/run`` calls it after ``make test``). A test whose service cannot start fails,
naming what is missing:
nothing here skips on a machine that has the packages.
"""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.geteuid() != 0:
        skip = pytest.mark.skip(
            reason="system tests need root (cgroups, mounts, sshd, slurmd): run them as CI does"
        )
        for item in items:
            item.add_marker(skip)
