"""Host bytes: what each persistent host buffer of the engine takes, counted from the layer layouts.

This module owns the byte arithmetic of host memory and the NVMe tier, by the same rules as the code
that allocates the buffers (host_state.py's ``HostLayerStore``, optimizer.py's ``ResidentParams``
and ``HostAdamW`` scratch, nvme.py's tier and staging buffers): ``layer_store_bytes``,
``resident_host_bytes``, ``optimizer_scratch_bytes``, ``nvme_layer_bytes``; the NVMe split rule
(``nvme_split``: how many trailing layers must leave RAM to fit a budget); the host budget
(``host_budget``: the smallest of MemAvailable, the memory cgroup's room and the user's setting,
with the limit that binds; host/host_limits.py reads them) and the disk's free space. It decides
nothing about a run: decisions.py applies the split rule to a config, capacity.py sums these parts
into a prediction. Pure, but for the reads of /proc/meminfo, the cgroup files and statvfs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ConfigError
from .settings import TrainConfig
from ..host import (
    available_bytes,
    CGROUP_ROOT,
    PROC_CGROUP,
    CgroupMemory,
    cgroup_memory,
    fmt_bytes,
    meminfo,
)
from ..model import LayerLayout
from .plan_gpu import dtype_size

GiB = 2**30
MiB = 2**20
NVME_ALIGN = 4096  # disk layers' moments are page aligned (O_DIRECT)
NVME_BUFFER_COUNT = 4  # DeepSpeed's offload_optimizer.buffer_count default
HOST_RESERVE_FRACTION = 0.05  # host_memory_budget "auto": MemAvailable - 5% of MemTotal
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# ---------------------------------------------------------------------------------------- NVMe tier
def align(n: int, to: int = NVME_ALIGN) -> int:
    return -(-int(n) // to) * to


def nvme_layer_bytes(n_train: int, masters: bool = False) -> int:
    """Disk bytes of one disk layer: exp_avg and exp_avg_sq (fp32), and with ``masters`` its fp32
    master, each page aligned (nvme.layer_disk_bytes)."""
    return (3 if masters else 2) * align(4 * n_train)


def nvme_split(
    ram_bytes_without_moments: int,
    moment_bytes: list[int],
    staging_count: int,
    budget: int,
    setting,
    masters: bool = False,
) -> int:
    """How many trailing streamed layers keep their Adam moments on disk.

    ``ram_bytes_without_moments``: host RAM with no layer's moments in it (and no staging);
    ``moment_bytes[i]``: what layer i's disk placement takes out of RAM (``8 * n_train_i``, ``12 *``
    with ``masters``: the fp32 master goes too; 0 for a layer this rank does not hold);
    ``staging_count``: the staging buffers the tier allocates
    (``staging_buffers(offload_optimizer.buffer_count)``), each the size of the largest disk layer's
    region (``nvme_layer_bytes``; none without a disk layer); ``budget``: host bytes allowed
    (``host_budget_bytes``); ``setting``: ``megatrain.nvme_layers``, an int (that many trailing
    layers, at most all) or "auto"/None (the fewest trailing layers with which RAM fits the budget;
    all of them when nothing fits: the caller then refuses). Pure."""
    n = len(moment_bytes)
    if setting is None or setting == "auto":
        kept = sum(moment_bytes)  # moments still in RAM with k trailing disk layers
        largest = 0  # the largest disk layer's moments on disk
        for k in range(n + 1):
            if k:
                m = moment_bytes[n - k]
                kept -= m
                largest = max(largest, nvme_layer_bytes(m // (12 if masters else 8), masters))
            if ram_bytes_without_moments + kept + staging_count * largest <= budget:
                return k
        return n
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ConfigError(
            f"megatrain.nvme_layers must be a layer count >= 0 or \"auto\", got {setting!r}"
        )
    return min(setting, n)


@dataclass(frozen=True, slots=True)
class HostLimits:
    """What the host budget is measured against (``read_host_limits``): the machine and the memory
    cgroup."""

    available: int  # MemAvailable, bytes
    total: int  # MemTotal, bytes
    # the tightest memory cgroup level above this process (None: no limit)
    cgroup: CgroupMemory | None


@dataclass(frozen=True, slots=True)
class HostBudget:
    """Host bytes the engine's state may take (``host_budget``), and the limit that sets them, in
    words: what ``plan``, a refusal at ``initialize`` and its log line print."""

    bytes: int
    # "memory cgroup /slurm/job_1 limit 6.00 GiB - 0.31 GiB used - 5% of the limit", ...
    source: str


def read_host_limits(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> HostLimits:
    """The machine's memory (/proc/meminfo) and this process's memory cgroup
    (host_limits.cgroup_memory), now."""
    available, total = meminfo()
    return HostLimits(available, total, cgroup_memory(cgroup_root, proc_cgroup))


def host_budget(setting, freed_bytes: int = 0, limits: HostLimits | None = None) -> HostBudget:
    """Host bytes the engine's state may take: the smallest of
    - MemAvailable + ``freed_bytes`` - 5% of MemTotal (``setting`` "auto"/None), or ``setting``
      (``megatrain.host_memory_budget``, GiB: used as given, whatever the machine has);
    - the memory cgroup's limit - what the cgroup uses + ``freed_bytes`` - 5% of the limit (its OOM
      killer ends the process with no message: a set budget above it is cut to it, and the source
      says so).
    ``freed_bytes``: what the caller will free before the state fills (the engine passes the bytes
    of the model's own weights, which ``load_layer`` releases; a fresh process passes 0).
    ``limits``: read now unless given (``read_host_limits``). Pure given ``limits``."""
    if (
        setting is not None
        and setting != "auto"
        and (isinstance(setting, bool) or not isinstance(setting, (int, float)) or not setting > 0)
    ):
        raise ConfigError(
            f"megatrain.host_memory_budget must be a number of GiB > 0 or \"auto\", got {setting!r}"
        )
    limits = read_host_limits() if limits is None else limits
    freed = f" + {fmt_bytes(freed_bytes)} freed" if freed_bytes else ""
    if setting is None or setting == "auto":
        budget = HostBudget(
            max(0, int(limits.available + freed_bytes - HOST_RESERVE_FRACTION * limits.total)),
            f"MemAvailable {fmt_bytes(limits.available)}{freed} - 5% of MemTotal "
            f"{fmt_bytes(limits.total)}",
        )
    else:
        budget = HostBudget(int(setting * GiB), f"megatrain.host_memory_budget {setting:g} GiB")
    cg = limits.cgroup
    if cg is None:
        return budget
    room = max(0, int(cg.limit - cg.used + freed_bytes - HOST_RESERVE_FRACTION * cg.limit))
    if room >= budget.bytes:
        return budget
    below = "" if setting is None or setting == "auto" else f" (below {budget.source})"
    return HostBudget(
        room,
        f"memory cgroup {cg.path} limit {fmt_bytes(cg.limit)} - {fmt_bytes(cg.used)} used"
        f"{freed} - 5% of the limit{below}",
    )


def host_budget_bytes(setting, freed_bytes: int = 0) -> int:
    """``host_budget(setting, freed_bytes).bytes``: the budget's bytes, for callers that print no
    source."""
    return host_budget(setting, freed_bytes).bytes


def disk_free_bytes(path: str | None) -> int | None:
    """Free bytes of the file system holding ``path`` (its nearest existing parent) for this
    process: statvfs's ``f_bavail``, root's reserved blocks not counted (host/disk_space.py)."""
    return available_bytes(path) if path else None


# -------------------------------------------------------------------------------- the NVMe settings
def nvme_settings(config: TrainConfig) -> tuple[bool, str | None, int]:
    """(NVMe tier on, nvme_path, buffer_count) from ``zero_optimization.offload_optimizer``
    (config.nvme when config.py parses it, else the raw dict)."""
    parsed = getattr(config, "nvme", None)
    if parsed is not None:
        return True, parsed.nvme_path or None, int(parsed.buffer_count)
    block = (config.raw.get("zero_optimization") or {}).get("offload_optimizer") or {}
    on = block.get("device") == "nvme"
    return on, block.get("nvme_path") or None, int(block.get("buffer_count", NVME_BUFFER_COUNT))


def nvme_masters(config: TrainConfig) -> bool:
    """Whether the NVMe layers' fp32 masters go to disk too (``offload_param.device: nvme`` beside
    the tier)."""
    parsed = getattr(config, "nvme", None)
    return bool(parsed is not None and getattr(parsed, "masters", False))


def staging_buffers(buffer_count: int) -> int:
    """Staging buffers the NVMe tier allocates for ``offload_optimizer.buffer_count``
    (nvme.NvmeMoments: one being updated, one being read or written, at least)."""
    return max(2, int(buffer_count))


# --------------------------------------------------------------------------------------- host state
def layer_store_bytes(
    layouts: list[LayerLayout],
    owned: list[bool],
    wire: str,
    grad: str,
    ga: int,
    disk: frozenset[int] = frozenset(),
    master: str = "fp32",
    staging_count: int = 0,
    disk_masters: bool = False,
    moments: str = "fp32",
    hold: bool = False,
) -> dict[str, int]:
    """Bytes of one rank's ``HostLayerStore`` buffers, as host_state.py allocates them (its
    ``nbytes()``): the moments of the ``disk`` layers (NVMe tier, a suffix) are not in RAM, nor
    their masters with ``disk_masters``; ``staging_count`` staging buffers of the largest of this
    rank's disk layers are (nvme.NvmeMoments, counted by ``fixed_nbytes``). ``hold``: the gradients
    wait for the norm on the device, read through three slabs (grad_hold.py)."""
    full = sum(lay.numel for lay, mine in zip(layouts, owned) if mine)
    train = sum(lay.n_train for lay, mine in zip(layouts, owned) if mine)
    moments_dtype = moments  # "fp32", or "bf16" ([Note: compact moments])
    moments = sum(
        lay.n_train for i, (lay, mine) in enumerate(zip(layouts, owned)) if mine and i not in disk
    )
    wire_is_master = wire == master  # the master is the wire copy: whole layers, one copy
    ram_train = moments if disk_masters else train  # an NVMe layer's master is on disk too
    # else trainable only
    parts = {
        f"{master} master": dtype_size(master) * (full if wire_is_master else ram_train),
        "exp_avg + exp_avg_sq": 2 * dtype_size(moments_dtype) * moments,
        f"{wire} wire copy": 0 if wire_is_master else dtype_size(wire) * full,
        f"{grad} gradients": 0 if hold else dtype_size(grad) * train,
    }
    if hold:
        max_train = max((lay.n_train for lay, mine in zip(layouts, owned) if mine), default=0)
        parts[f"{grad} gradient slabs (gradients held on the GPU)"] = (
            3 * max_train * dtype_size(grad)
        )
    # landing ring: 4 slabs of the largest layer (wire dtype) + an fp32 scratch (fixed_nbytes)
    if ga > 1:
        max_train = max((lay.n_train for lay, mine in zip(layouts, owned) if mine), default=0)
        parts["landing ring (GA > 1)"] = 4 * max_train * dtype_size(wire) + 4 * max_train
    on_disk = [
        lay.n_train
        for i, (lay, mine) in enumerate(zip(layouts, owned))
        if mine and i in disk and lay.n_train
    ]
    parts["NVMe staging buffers"] = staging_count * max(
        (nvme_layer_bytes(n, disk_masters) for n in on_disk), default=0
    )
    return parts


def resident_items(resident) -> list[tuple[int, bool]]:
    """(elements, trainable) per resident parameter: tensors (trainable = requires_grad), ints
    (trainable) or pairs."""
    out = []
    for item in resident:
        if isinstance(item, torch.Tensor):
            out.append((item.numel(), bool(item.requires_grad)))
        elif isinstance(item, (tuple, list)):
            out.append((int(item[0]), bool(item[1])))
        else:
            out.append((int(item), True))
    return out


def resident_host_bytes(
    resident: list[tuple[int, bool]], compute: str, device_type: str, state_on_device: bool
) -> int:
    """Bytes of one rank's ``ResidentParams`` on the host (counted by ``host_memory()``). Trainable:
    fp32 master, exp_avg, exp_avg_sq, grad (16) + compute-dtype wire and landing copies (pinned in
    mappings of their own: no 2^k rounding), on the host unless the state is on the device; frozen:
    their one compute-dtype copy is on the device (host memory only when the device is the CPU)."""
    c, exact = dtype_size(compute), 0
    for n, trainable in resident:
        if not trainable:
            exact += c * n if device_type == "cpu" else 0
        elif state_on_device:
            exact += 16 * n if device_type == "cpu" else 0
        else:
            exact += (16 + 2 * c) * n
    return exact


def optimizer_scratch_bytes(layouts: list[LayerLayout], owned: list[bool], master: str) -> int:
    """HostAdamW's fp32 scratch of the largest layer (bf16 gradients converted for the fused
    kernel), and in bf16-master mode its fp32 copy of that layer's master: host memory beside
    ``host_memory()``."""
    max_train = max((lay.n_train for lay, mine in zip(layouts, owned) if mine), default=0)
    return 4 * max_train * (1 if master == "fp32" else 2)
