"""The host's memory limits, as this process meets them: what the machine has (/proc/meminfo), what
its memory
cgroup allows (SLURM, Kubernetes and Docker set one; v1 or v2, every level from this process's
cgroup up to the
mount's root) and RLIMIT_MEMLOCK (``ulimit -l``).

Only reads, from paths given as arguments (tests hand a fake tree), and the standard library:
planning/host_bytes.py
turns these numbers into the host budget, host_memory.py names them when page-locking fails.

[Note: which limits bind host memory]

=========================  ===========================================
=========================================
limit                      what it bounds                               when it is exceeded
=========================  ===========================================
=========================================
MemAvailable               the machine's free + reclaimable memory      the kernel's OOM killer
picks a process
memory cgroup limit        every page the cgroup's processes fault in   the cgroup's OOM killer
kills one of them,
                           (anonymous, page cache; pinned pages too)    with no message in the
                           process
RLIMIT_MEMLOCK             mlock() and RDMA registration (ibv_reg_mr)   mlock / registration fails
(ENOMEM)
=========================  ===========================================
=========================================

NVIDIA's driver pins ``cudaHostRegister`` and ``cudaHostAlloc`` memory with ``pin_user_pages``
(os_lock_user_pages),
which RLIMIT_MEMLOCK does not count: the engine's page-locked buffers are bound by the cgroup and
the machine, not by
``ulimit -l`` (``pinning_limits`` says so where it matters).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

GiB = 2**30
V1_UNLIMITED = (
    2**62
)  # a v1 limit at or above this is "none": the kernel shows 2^63 - 1 rounded down to a page
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes, from /proc/meminfo (sysconf where there is none)."""
    values = {}
    try:
        with open(path) as f:
            for line in f:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    return values.get("MemAvailable", values.get("MemFree", 0)), values.get("MemTotal", 0)


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The memory cgroup level above this process with the least room left (``cgroup_memory``)."""

    path: str  # the cgroup, as /proc/self/cgroup names it: "/slurm/uid_0/job_1"
    limit: int  # memory.limit_in_bytes (v1) / memory.max (v2), bytes
    # memory.usage_in_bytes / memory.current less the inactive page cache (reclaimed before an OOM
    # kill)
    used: int
    version: int  # 1 or 2

    @property
    def headroom(self) -> int:
        """Bytes the cgroup's processes may still fault in before its OOM killer runs."""
        return max(0, self.limit - self.used)


def cgroup_memory(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> CgroupMemory | None:
    """The tightest memory limit over this process's cgroup and each cgroup above it (a parent's
    limit binds its
    children), or None when no level has one. v1 when a hierarchy with the memory controller is
    mounted under
    ``root`` (``root``/memory), else v2 (``root`` itself, or ``root``/unified on a hybrid host). A
    path that
    /proc/self/cgroup names but the mount does not hold (a container sees its own cgroup as the
    mount's root) is
    looked up with its leading components dropped, down to the root."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for version, mount, path in _hierarchies(root, lines):
        found = _tightest(version, mount, path)
        if found is not None:
            return found
    return None


def _hierarchies(root: str, lines: list[list[str]]) -> list[tuple[int, str, str]]:
    """(version, mount directory, this process's path in it) for each memory hierarchy, v1 first."""
    out = []
    v1 = next((path for _, controllers, path in lines if "memory" in controllers.split(",")), None)
    if v1 is not None:
        mounts = [os.path.join(root, "memory")] + sorted(
            os.path.join(root, d)
            for d in _listdir(root)
            if "memory" in d.split(",") and d != "memory"
        )
        out += [
            (1, m, v1) for m in mounts if os.path.isfile(os.path.join(m, "memory.limit_in_bytes"))
        ][:1]
    v2 = next((path for hid, controllers, path in lines if hid == "0" and controllers == ""), None)
    if v2 is not None:
        for mount in (root, os.path.join(root, "unified")):
            if os.path.isfile(os.path.join(mount, "cgroup.controllers")):
                out.append((2, mount, v2))
                break
    return out


def _tightest(version: int, mount: str, path: str) -> CgroupMemory | None:
    parts = [p for p in path.split("/") if p]
    while parts and not os.path.isdir(os.path.join(mount, *parts)):
        parts = parts[
            1:
        ]  # the mount's root is an ancestor of this process's cgroup (a container's view)
    best = None
    for depth in range(len(parts), -1, -1):  # this cgroup, then each parent up to the mount's root
        level = _read_level(
            version, os.path.join(mount, *parts[:depth]), "/" + "/".join(parts[:depth])
        )
        if level is not None and (best is None or level.headroom < best.headroom):
            best = level
    return best


def _read_level(version: int, directory: str, path: str) -> CgroupMemory | None:
    limit_file, usage_file, inactive = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        if version == 1
        else ("memory.max", "memory.current", "inactive_file")
    )
    limit, usage = (
        _read(os.path.join(directory, limit_file)),
        _read(os.path.join(directory, usage_file)),
    )
    if limit is None or limit == "max" or usage is None:
        return None
    limit = int(limit)
    if version == 1 and limit >= V1_UNLIMITED:
        return None
    cache = _stat(os.path.join(directory, "memory.stat")).get(inactive, 0)
    return CgroupMemory(path, limit, max(0, int(usage) - cache), version)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str) -> dict[str, int]:
    text = _read(path) or ""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes (``ulimit -l``), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def fmt_bytes(n: int) -> str:
    """``n`` bytes in GiB, MiB or KiB, two decimals (as the plan's table prints them)."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def pinning_limits(
    pinned: int,
    asked: int,
    *,
    memlock: int | None,
    cgroup: CgroupMemory | None,
    available: int | None,
    memlock_counts: bool = False,
) -> list[str]:
    """The limits that page-locking ``asked`` more bytes, with ``pinned`` already page-locked by
    this process, runs
    into, each with its numbers and by how much it is short: what a pinning failure says and what
    the plan notes.
    ``memlock``: RLIMIT_MEMLOCK (None: unlimited); ``cgroup``: ``cgroup_memory()``; ``available``:
    MemAvailable;
    ``memlock_counts``: the pinning is charged to RLIMIT_MEMLOCK (mlock, RDMA; not cudaHostRegister,
    see the Note).
    Pure."""
    out = []
    total = pinned + asked
    if memlock is not None and total > memlock:
        why = (
            ""
            if memlock_counts
            else " (cudaHostRegister is not charged to it by NVIDIA's driver; mlock is)"
        )
        out.append(
            f"RLIMIT_MEMLOCK (ulimit -l) {fmt_bytes(memlock)}: {fmt_bytes(pinned)} page-locked + "
            f"{fmt_bytes(asked)} asked exceeds it by {fmt_bytes(total - memlock)}{why}"
        )
    if cgroup is not None and asked > cgroup.headroom:
        out.append(
            f"memory cgroup {cgroup.path} limit {fmt_bytes(cgroup.limit)} - "
            f"{fmt_bytes(cgroup.used)} used "
            f"leaves {fmt_bytes(cgroup.headroom)}: short by {fmt_bytes(asked - cgroup.headroom)}"
        )
    if available is not None and asked > available:
        out.append(f"MemAvailable {fmt_bytes(available)}: short by {fmt_bytes(asked - available)}")
    return out
