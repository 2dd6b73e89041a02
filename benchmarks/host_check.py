"""What each benchmark system needs of the host, checked before a run starts (``host_precheck``),
and the machine a result was measured on (``hardware``).

megatrain_ds is checked with its own planner (the check ``initialize`` runs) and this run's config;
every other system (and megatrain_ds under LoRA or with the NVMe tier) by peak host bytes per
parameter, measured on the lent boxes. A run that would not fit is skipped with the numbers instead
of being killed for host memory half-way.
"""

from __future__ import annotations

import os
import platform
import subprocess

from benchmarks.common import proc_kb_bytes
from benchmarks.shapes import n_params

# Peak host bytes per parameter each system needs (measured: 3B on the H200 box,
# benchmarks/results/): model build (fp32, 4 B) + state. megatrain 17.3, zero3 25.9, resident builds
# on the GPU.
HOST_BYTES_PER_PARAM = {
    "megatrain": 18.0,
    "zero3": 27.0,
    "resident": 1.0,
    # peak host RSS / params measured on H200 boxes (2026-11-29, benchmarks/results/): FSDP2 18.4
    # (5.85 B) to 20.2 (3B) and 23.4 (7B); Gemini 17.4 (5.85 B), 18.0 (3B), 19.8 (7B). The
    # pre-check uses the middle: a higher one would refuse FSDP2's 5.85 B point, which ran in 108 GB
    "fsdp": 20.0,
    "gemini": 18.0,
}
# LoRA (per base parameter; predictions, not yet measured): megatrain_ds keeps the frozen base in
# bf16 only (2 B) + the adapters' state, and the fast init holds one layer while building; ZeRO-3
# holds the bf16 partitions in pinned host memory, which torch's caching host allocator rounds up to
# powers of two (about 2.22 B at 72B).
LORA_HOST_BYTES_PER_PARAM = {"megatrain": 2.4, "zero3": 2.5}


def hardware() -> dict:
    info = {
        "cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
        "host_mem_bytes": meminfo("MemTotal"),
    }
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["gpu"] = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


def host_snapshot() -> dict:
    """The host's state as a run starts, to tell a slow host update's causes apart (the first
    call of a fresh machine updated at 3.6-4.2 Gparam/s where its later calls ran 5.6-5.9:
    2026-11-29_h200_depth_one_lease): free and cached memory and transparent huge pages in use
    (bytes), the 1-minute load average and the THP mode. Missing entries are left out."""
    snap = {
        name: meminfo(key)
        for name, key in (
            ("mem_free_bytes", "MemFree"),
            ("cached_bytes", "Cached"),
            ("anon_huge_bytes", "AnonHugePages"),
        )
    }
    try:
        snap["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
        snap["thp"] = mode[mode.index("[") + 1 : mode.index("]")]
    except (OSError, ValueError):
        pass
    return snap


def meminfo(key: str) -> int:
    """/proc/meminfo's ``key`` (MemTotal, MemAvailable) in bytes; 0 if unreadable."""
    return proc_kb_bytes("/proc/meminfo", key)


# megatrain with its NVMe tier (--ds-config with offload_optimizer.device nvme): fp32 master + fp32
# gradient stay in RAM (8), the Adam moments of as many layers as needed go to disk
NVME_HOST_BYTES_PER_PARAM = 8.0
# ZeRO-3 with DeepSpeed's bf16 master weights and optimizer states (--zero3-ds-config): a
# prediction, not a measurement (bf16 offloaded params 2 + master 2 + gradient 2 + moments 4, and
# its buffers): checked loosely
ZERO3_BF16_STATE_HOST_BYTES_PER_PARAM = 14.0
# Data parallel: host bytes one more process costs beyond the model's state (libraries, CUDA
# context)
PER_PROCESS_HOST_BYTES = 3 * 2**30


def planned_megatrain_host_bytes(args, config, tokens: int, gpus: int) -> int | None:
    """The host bytes megatrain_ds's planner (the check ``initialize`` runs) predicts for this run's
    config, summed over ``gpus`` ranks (``--nodes``: over the "nodes" on this box, each one's own
    plan): engine state, NVMe staging, optimizer scratch. None where the plan does not apply here
    (LoRA: the harness applies peft after building; an NVMe config: the engine places layers on disk
    itself)."""
    if getattr(args, "lora", 0) or '"nvme"' in (getattr(args, "ds_config", None) or ""):
        return None
    from benchmarks.common import micro_batch_for, resolve_liger
    from benchmarks.megatrain_system import megatrain_ds_config
    from megatrain_ds.planning.config import parse_config
    from megatrain_ds.planning.plan import meta_model, plan_model

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    ds = megatrain_ds_config(
        micro_batch_for(tokens, args.seq),
        device,
        resolve_liger(args.liger, args.device),
        args.gpu_optimizer_fraction,
        args.host_only,
    )
    # h2h --nodes: every "node" is on this box
    nodes = int(getattr(args, "nodes", 1) or 1) if gpus > 1 else 1
    pred = plan_model(
        meta_model(config),
        parse_config(ds, world_size=gpus, warn=False),
        device=device,
        # (GiB: no budget; compared with what is free)
        world=gpus // nodes,
        nodes=nodes,
        host_budget=1e9,
    )
    return int(pred.host_need_bytes) * nodes


def host_precheck(system: str, args, config, tokens: int, gpus: int) -> str | None:
    """Why ``system`` would not fit this host's memory (the skip message), or None. megatrain: its
    own planner with this run's config; the others (and megatrain under LoRA or NVMe): measured
    bytes per parameter. The resident system builds on each GPU (1 B/param of host per process); the
    offloading systems partition their state."""
    per_param = (
        LORA_HOST_BYTES_PER_PARAM[system]
        if getattr(args, "lora", 0)
        else HOST_BYTES_PER_PARAM[system]
    )
    if system == "megatrain" and '"nvme"' in (getattr(args, "ds_config", None) or ""):
        # the moments may go to disk; the engine's own check (plan.py) decides
        per_param = NVME_HOST_BYTES_PER_PARAM
    if system == "zero3" and "bf16_optimizer_states" in (
        getattr(args, "zero3_ds_config", None) or ""
    ):
        per_param = ZERO3_BF16_STATE_HOST_BYTES_PER_PARAM
    need = (
        per_param * n_params(config) * (gpus if system == "resident" else 1)
        + (gpus - 1) * PER_PROCESS_HOST_BYTES
    )
    source = f"{per_param:g} B/param"
    planned = (
        planned_megatrain_host_bytes(args, config, tokens, gpus) if system == "megatrain" else None
    )
    # the engine's own planner, with this run's config (precision, masters, placements)
    if planned is not None:
        need, source = (
            planned + gpus * PER_PROCESS_HOST_BYTES,
            "megatrain_ds's plan + 3 GiB per process",
        )
    have = (
        int(args.host_mem_gib * 2**30)
        if getattr(args, "host_mem_gib", None)
        else meminfo("MemAvailable")
    )
    if have and need > have:
        return f"needs ~{need / 2**30:.0f} GiB host memory ({source}), {have / 2**30:.0f} GiB free"
    return None
