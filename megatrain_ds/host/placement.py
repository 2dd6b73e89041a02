"""Where the host optimizer's threads run: cores, NUMA node, and one core kept free for the main
thread.

The host worker (one ``ThreadPoolExecutor`` thread) runs torch's fused CPU AdamW; torch parallelises
it with OpenMP. The main thread meanwhile launches the streamed layers' CUDA kernels: a launch it
makes late is GPU time lost. If OpenMP's team spans every core, one optimizer thread shares a core
with the main thread: the main thread can be preempted, and the team (which splits the update
evenly) waits for its slowest thread. ``plan_placement`` keeps ``reserve_main`` physical core(s) for
the main thread and gives the optimizer one thread per remaining physical core (SMT siblings
skipped) on the GPU's NUMA node. The measurement behind this: ``python -m benchmarks.host_adam
--sweep``, results in docs/placement.md.

Usage (the engine creates its worker this way)::

    from megatrain_ds.host import placement as pl
    # on the main thread; None for "off" (or unreadable host)
    plan = pl.resolve(mt.host_threads, device.index)
    worker = ThreadPoolExecutor(1, initializer=pl.apply_placement, initargs=(plan,))
    # optional; see its docstring
    pl.pin_main_thread(plan)

What is per-thread and what is not (Linux, torch built with OpenMP/libgomp; measured, see
docs/placement.md):

* ``os.sched_setaffinity(0, cores)`` changes the calling thread only. Threads it creates afterwards
  inherit the mask; threads that already exist keep theirs.
* libgomp's thread pool belongs to the thread that opens the parallel region: the worker's first
  parallel op creates ``threads - 1`` OpenMP threads with the worker's mask at that moment. Setting
  the mask later does not reach them, so ``apply_placement`` must run before the worker's first op
  (the executor's initializer).
* ``torch.set_num_threads(n)`` sets the calling thread's OpenMP thread count (a per-thread ICV) and
  a process-global default that every thread which has not yet used torch's CPU parallelism adopts
  on its first use. ``resolve`` touches the main thread's count first so the worker's setting does
  not leak into it. It also (re)creates ``n - 1`` threads of a process-global pool at once (torch's
  pthreadpool, idle in training), which inherit the calling thread's mask.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from dataclasses import dataclass

import torch

SETTING = "megatrain.host_threads"
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{SETTING}: {message}; continuing without it", RuntimeWarning, stacklevel=3)


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8-11"`` (sysfs cpulist, optional ``:stride``) -> sorted cpu ids; empty string ->
    []."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        rng, _, stride = part.partition(":")
        lo, _, hi = rng.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1, int(stride or 1)))
    return sorted(cpus)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def host_topology(sysfs_root: str = "/sys", usable: list[int] | None = None) -> dict:
    """The cores this process may use, grouped by NUMA node, with their SMT siblings.

    Returns ``{"cpus": [...], "nodes": {node: [cpus]}, "siblings": {cpu: (siblings incl. cpu)},
    "smt": bool}``; only usable cpus appear anywhere (nodes without any are dropped). Without NUMA
    information: one node, 0. Without sibling information: every cpu is its own core.
    """
    cpus = sorted(usable) if usable is not None else _usable_cpus()
    allowed = set(cpus)
    nodes: dict[int, list[int]] = {}
    for path in glob.glob(os.path.join(sysfs_root, "devices/system/node/node*/cpulist")):
        m = re.search(r"node(\d+)/cpulist$", path)
        text = _read(path)
        if m is None or text is None:
            continue
        mine = [c for c in parse_cpulist(text) if c in allowed]
        if mine:
            nodes[int(m.group(1))] = mine
    placed = {c for cs in nodes.values() for c in cs}
    if not nodes:
        nodes = {0: list(cpus)}
    # cpus the node lists miss (odd sysfs): a node of their own would mislead; add to the first
    elif placed != allowed:
        first = min(nodes)
        nodes[first] = sorted(set(nodes[first]) | (allowed - placed))
    siblings: dict[int, tuple[int, ...]] = {}
    for c in cpus:
        text = _read(
            os.path.join(sysfs_root, f"devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        )
        sib = [s for s in parse_cpulist(text) if s in allowed] if text else []
        siblings[c] = tuple(sorted(set(sib) | {c}))
    return {
        "cpus": cpus,
        "nodes": dict(sorted(nodes.items())),
        "siblings": siblings,
        "smt": any(len(s) > 1 for s in siblings.values()),
    }


def _normalize_bus_id(bus_id: str) -> str:
    """``"00000000:3B:00.0"`` (NVML/CUDA) or ``"3b:00.0"`` -> ``"0000:3b:00.0"`` (sysfs)."""
    parts = bus_id.strip().lower().split(":")
    domain = parts[0] if len(parts) == 3 else "0"
    return f"{int(domain, 16):04x}:{parts[-2]}:{parts[-1]}"


def _node_of(bus_id: str, sysfs_root: str) -> int | None:
    try:
        text = _read(
            os.path.join(sysfs_root, "bus/pci/devices", _normalize_bus_id(bus_id), "numa_node")
        )
        node = int(text) if text is not None else -1
    except (ValueError, IndexError):
        return None
    return node if node >= 0 else None


def gpu_numa_node(device_index: int = 0, sysfs_root: str = "/sys") -> int | None:
    """The NUMA node of CUDA device ``device_index`` (from sysfs ``numa_node``); None when unknown
    or -1.

    The PCI bus id comes from ``torch.cuda.get_device_properties``
    (``pci_bus_id``/``pci_domain_id``/ ``pci_device_id``, torch >= 2.7); without those, if every
    NVIDIA PCI device sits on the same node, that node (no index mapping needed). No nvidia-smi.
    """
    try:
        props = torch.cuda.get_device_properties(device_index)
        bus, dom, dev = (
            getattr(props, k, None) for k in ("pci_bus_id", "pci_domain_id", "pci_device_id")
        )
        if isinstance(bus, str):
            return _node_of(bus, sysfs_root)
        if all(isinstance(x, int) for x in (bus, dom, dev)):
            return _node_of(f"{dom:04x}:{bus:02x}:{dev:02x}.0", sysfs_root)
    except Exception:  # noqa: BLE001 - no CUDA, or an old torch: fall through to sysfs
        pass
    found = set()
    for dev_dir in glob.glob(os.path.join(sysfs_root, "bus/pci/devices/*")):
        klass = _read(os.path.join(dev_dir, "class")) or ""
        if _read(os.path.join(dev_dir, "vendor")) == "0x10de" and klass[:6] in ("0x0300", "0x0302"):
            found.add(_node_of(os.path.basename(dev_dir), sysfs_root))
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class Placement:
    threads: int  # torch.set_num_threads on the worker (its OpenMP team size)
    cores: tuple[int, ...]  # the worker's affinity mask; its OpenMP threads inherit it
    main_cores: tuple[int, ...]  # kept free of optimizer threads, for pin_main_thread
    numa_node: int | None  # the node the cores were taken from first
    shared_with_main: bool  # the optimizer had to use the main thread's core(s) (1-core box)
    reason: str

    def describe(self) -> str:
        return (
            f"host optimizer: {self.threads} thread(s) on cores {_fmt(self.cores)}, main thread on "
            f"{_fmt(self.main_cores) or '-'} ({self.reason})"
        )


def _fmt(cores) -> str:
    return ",".join(map(str, cores))


def plan_placement(
    topology: dict, gpu_numa_node: int | None, reserve_main: int = 1, threads: int | None = None
) -> Placement:
    """Choose the optimizer's cores and the main thread's core(s).

    Home node: the GPU's node when it has usable cores, else the node with the most. The main thread
    gets the first ``reserve_main`` physical cores of the home node. ``threads=None`` ("auto"): one
    thread per other physical core of the home node (at least 1). An explicit count takes cores in
    this order: home node's physical cores, other nodes' physical cores, then SMT siblings; a count
    above the cores available is kept (oversubscribed) and said so in ``reason``. With no core left,
    the optimizer shares the main's.
    """
    nodes: dict[int, list[int]] = topology["nodes"]
    siblings: dict[int, tuple[int, ...]] = topology.get("siblings") or {}
    if not nodes or not any(nodes.values()):
        raise ValueError("topology has no usable cpus")
    notes = []
    if gpu_numa_node is not None and nodes.get(gpu_numa_node):
        home = gpu_numa_node
        notes.append(f"GPU's NUMA node {home}")
    else:
        home = max(nodes, key=lambda n: (len(nodes[n]), -n))
        notes.append(
            f"NUMA node {home} (most cores; GPU node "
            + ("unknown)" if gpu_numa_node is None else f"{gpu_numa_node} has no usable cores)")
        )

    def split(cpus):  # physical cores (lowest sibling) and the SMT siblings left over
        phys, smt, seen = [], [], set()
        for c in cpus:
            if c in seen:
                continue
            group = [s for s in siblings.get(c, (c,)) if s in cpus] or [c]
            seen.update(group)
            phys.append(group[0])
            smt.extend(s for s in group[1:])
        return phys, smt

    home_phys, home_smt = split(nodes[home])
    other_phys, other_smt = [], []
    for n in sorted(nodes):
        if n != home:
            p, s = split(nodes[n])
            other_phys += p
            other_smt += s
    reserve_main = max(0, reserve_main)
    main = home_phys[:reserve_main]
    if len(main) < reserve_main:  # a tiny home node: the rest from other nodes
        main += other_phys[: reserve_main - len(main)]
    main_set = set(main)
    # the main thread's SMT siblings are left idle, not handed to the optimizer
    for c in list(main):
        main_set.update(siblings.get(c, (c,)))
    order = [c for c in home_phys + other_phys + home_smt + other_smt if c not in main_set]
    # last resort before sharing: the main thread's SMT siblings
    order += sorted(main_set - set(main))
    shared = False
    if threads is None:
        cores = [c for c in home_phys if c not in main_set]
        if not cores:
            cores = order[:1]
        if not cores:
            cores, shared = list(main) or nodes[home][:1], True
        n = len(cores)
        notes.append(f"one thread per physical core, {len(main)} kept for the main thread")
    else:
        if threads < 1:
            raise ValueError(f"{SETTING} must be >= 1, got {threads}")
        n = threads
        cores = order[:threads]
        if not cores:
            cores, shared = list(main) or nodes[home][:1], True
        notes.append(f"{threads} thread(s) requested")
        if threads > len(cores):
            notes.append(f"oversubscribed: {threads} threads on {len(cores)} core(s)")
    if shared:
        notes.append("no core left besides the main thread's: shared")
    return Placement(
        threads=n,
        cores=tuple(cores),
        main_cores=tuple(main),
        numa_node=home,
        shared_with_main=shared,
        reason="; ".join(notes),
    )


def parse_setting(setting) -> int | str:
    """``megatrain.host_threads`` checked, with no side effects: "auto", "off" or a thread count
    >= 1."""
    if setting is None:
        return "auto"
    if isinstance(setting, str) and setting.strip().lower() in ("auto", "off"):
        return setting.strip().lower()
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    if isinstance(setting, str) and setting.strip().isdigit() and int(setting) >= 1:
        return int(setting)
    raise ValueError(f'{SETTING} must be "auto", "off" or a thread count >= 1, got {setting!r}')


def share_between_local_ranks(
    topology: dict, node_of_rank: list[int | None], local_rank: int
) -> dict:
    """Data parallel (several ranks on one host): this rank's share of the host's cores, disjoint
    from the other local ranks' (each runs its own host AdamW). Ranks whose GPUs sit on the same
    NUMA node split that node's physical cores (with their SMT siblings) into equal contiguous
    parts; a rank's topology then holds its part only, so no thread count spills onto a neighbour's
    cores. Ranks whose GPU node is unknown split the node with the most cores."""
    nodes, siblings = topology["nodes"], topology.get("siblings") or {}
    biggest = max(nodes, key=lambda n: (len(nodes[n]), -n))
    home = [n if n is not None and nodes.get(n) else biggest for n in node_of_rank]
    node = home[local_rank]
    peers = [r for r, n in enumerate(home) if n == node]
    leaders, seen = [], set()
    for c in nodes[node]:
        if c not in seen:
            group = [x for x in siblings.get(c, (c,)) if x in nodes[node]] or [c]
            seen.update(group)
            leaders.append(group)
    k, j = len(peers), peers.index(local_rank)
    lo, hi = j * len(leaders) // k, (j + 1) * len(leaders) // k
    mine = sorted(c for group in leaders[lo:hi] for c in group) or nodes[node][:1]
    return {**topology, "nodes": {node: mine}}


def resolve(
    setting="auto",
    device_index: int | None = None,
    topology: dict | None = None,
    reserve_main: int = 1,
    local_rank: int = 0,
    local_world: int = 1,
) -> Placement | None:
    """``megatrain.host_threads``: "auto" (default; plan as above), "off" (touch nothing: None), or
    a thread count >= 1. Call on the main thread. Anything else raises ValueError; a host where the
    topology cannot be read warns once and returns None (training goes on unplaced). ``local_world``
    > 1 (data parallel): this rank plans within its share of the host
    (``share_between_local_ranks``; GPU i is local rank i's), unless the launcher bound the process
    to some cores already (its affinity is then its share)."""
    threads = parse_setting(setting)
    if threads == "off":
        return None
    threads = None if threads == "auto" else threads
    try:
        # fixes the main thread's OpenMP count before the worker's set_num_threads
        torch.get_num_threads()
        topo = topology if topology is not None else host_topology()
        node = None
        if device_index is None and torch.cuda.is_available():
            device_index = torch.cuda.current_device()
        if device_index is not None:
            node = gpu_numa_node(device_index)
        # not bound to a share by the
        if local_world > 1 and len(_usable_cpus()) >= (os.cpu_count() or 1):
            others = [
                gpu_numa_node(r) if r < torch.cuda.device_count() else None
                for r in range(local_world)
            ]
            others[local_rank] = node
            topo = share_between_local_ranks(topo, others, local_rank)
        return plan_placement(topo, node, reserve_main=reserve_main, threads=threads)
    except Exception as exc:  # noqa: BLE001 - placement is an optimisation, never a reason to stop
        _warn_once("plan", f"could not plan host thread placement ({type(exc).__name__}: {exc})")
        return None


def apply_placement(placement: Placement | None) -> bool:
    """On the worker thread (the executor's initializer): confine this thread to ``placement.cores``
    and set its OpenMP team size. Returns whether the affinity was applied; failures warn once,
    never raise."""
    if placement is None:
        return False
    applied = True
    try:
        os.sched_setaffinity(0, placement.cores)  # 0 = the calling thread on Linux
    except (AttributeError, OSError, ValueError) as exc:
        _warn_once(
            "affinity",
            f"could not set the host worker's affinity to {_fmt(placement.cores)} ({exc})",
        )
        applied = False
    try:
        torch.set_num_threads(placement.threads)
    except (RuntimeError, ValueError) as exc:
        _warn_once("threads", f"torch.set_num_threads({placement.threads}) failed ({exc})")
    return applied


def task_affinities() -> dict[int, set[int]]:
    """Every thread of this process (Linux task id) -> its allowed cpus, from
    /proc/self/task/*/status: how docs/placement.md's finding on OpenMP threads' inherited masks was
    checked."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        status = _read(f"/proc/self/task/{tid}/status") or ""
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(tid)] = set(parse_cpulist(line.split(":", 1)[1]))
    return out


def pin_main_thread(placement: Placement | None) -> set[int] | None:
    """Confine the calling (main) thread to ``placement.main_cores``; returns its previous mask (to
    restore with ``os.sched_setaffinity(0, previous)``), or None when nothing was changed. Note the
    main thread's own OpenMP threads created after this inherit the narrow mask (its CPU-side torch
    ops then run on those cores only); call it after the main thread's first CPU parallel op if that
    matters."""
    if placement is None or not placement.main_cores:
        return None
    try:
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, placement.main_cores)
        return previous
    except (AttributeError, OSError, ValueError) as exc:
        _warn_once("main", f"could not pin the main thread to {_fmt(placement.main_cores)} ({exc})")
        return None
