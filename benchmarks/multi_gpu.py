"""Data-parallel runs of the head-to-head harness: N processes per system (``h2h --gpus N``), one
per GPU.

Each system runs as N ranks launched by torchrun (``python -m torch.distributed.run --standalone
--nproc_per_node N -m benchmarks.run_system ...``): megatrain_ds (its engine's data parallelism),
DeepSpeed ZeRO-3 CPU offload (N ranks: parameters and optimizer state partitioned over them, as
DeepSpeed does) and the whole-on-GPU run as plain data parallel (torch DDP). Every rank trains on
its own micro-batch of ``--tokens-per-step`` tokens (seeded by its rank; rank 0's data is the
one-GPU run's), the same model init, and writes ``<stem>.rank<r>.json``; :func:`aggregate` turns the
N files into one result:

- tokens/s = tokens per rank per step × N / rank 0's median step time (after warm-up).
  ``benchmarks.common.measure`` ends every step with a barrier over all ranks, so rank 0's step time
  is the slowest rank's; the ranks must agree on the number of warm-up and measured steps (checked).
- TFLOPS per GPU = ANCHORS formula × tokens/s / N (``tflops`` in the result is this per-GPU number,
  ``tflops_total`` the sum).
- peak host RSS = sum of every rank's process peak (VmHWM), and host bytes per parameter = that sum
  / the model's parameters, so "host bytes per parameter with N GPUs <= 1 GPU" can be read off
  directly. Each process's libraries and CUDA context count once per rank (a few GB each), as they
  do on the box.
- peak GPU memory = the largest rank's; the step-time breakdown is rank 0's, every key the engine
  returns.

The whole-on-GPU bound for N GPUs: DDP over N ranks when the model fits one GPU with DDP's buffers
(``ddp``), else one GPU's tokens/s × N, labelled a bound (``single×N``): h2h ``--resident-mode``.

Cores: torchrun sets OMP_NUM_THREADS=1 for N > 1 processes unless it is set, which would leave
DeepSpeedCPUAdam (OpenMP) one core per rank; and two unbound ranks would each plan their host
optimizer's threads on the same cores (megatrain_ds's placement plans within the process's
affinity). So by default (h2h ``--bind-cores on``) the launch splits the cores this process may use
into N blocks of whole physical cores (SMT siblings together, NUMA node by node, in order: rank r
gets block r), each rank binds itself to its block before any work (``H2H_RANK_CPUS``; every system
alike, as the DeepSpeed launcher's ``--bind_cores_to_rank``), and OMP_NUM_THREADS is the block's
size, what OpenMP would use in a process bound to it. ``--bind-cores off``: no binding,
OMP_NUM_THREADS = the cpus / N. Both recorded with the launch and in each rank's settings.
"""

from __future__ import annotations

import os
import shlex

RESIDENT_MODES = ("auto", "ddp", "single")
# NVLink multicast off in NCCL, PyTorch and NVSHMEM (the lent multi-GPU boxes' rule:
# .library/device/KINDS.md)
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
RANK_KEYS = (
    "rank",
    "status",
    "median_step_s",
    "warmup_step_times_s",
    "step_times_s",
    "peak_host_rss_bytes",
    "peak_gpu_bytes",
    "engine_host_state_bytes",
    "losses",
    "process_wall_s",
    "error",
)


def dist_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) of this process from the launcher's environment; (0, 0, 1)
    without one."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return 0, 0, 1
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world


def rank_json(path: str, rank: int) -> str:
    """Where rank ``rank`` of a data-parallel run writes its result: ``<stem>.rank<r>.json`` beside
    ``path``."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


def threads_per_rank(gpus: int, cpus: int | None = None) -> int:
    """OpenMP threads for each of ``gpus`` ranks: the cpus this process may use, shared evenly (>=
    1)."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:
            cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, gpus))


def rank_cpu_sets(gpus: int, topology: dict | None = None) -> list[list[int]] | None:
    """The usable cpus split into ``gpus`` blocks of whole physical cores (siblings kept together),
    NUMA node by node; block sizes differ by at most one core. None when there are fewer physical
    cores than ranks."""
    if topology is None:
        from megatrain_ds.host.placement import host_topology

        topology = host_topology()
    allowed = set(topology["cpus"])
    cores, seen = [], set()
    for node in sorted(topology["nodes"]):
        for c in topology["nodes"][node]:
            if c in seen:
                continue
            group = sorted(
                {s for s in topology.get("siblings", {}).get(c, (c,)) if s in allowed} | {c}
            )
            seen.update(group)
            cores.append(group)
    if len(cores) < gpus:
        return None
    per, extra = divmod(len(cores), gpus)
    out, start = [], 0
    for r in range(gpus):
        n = per + (1 if r < extra else 0)
        out.append(sorted(c for group in cores[start : start + n] for c in group))
        start += n
    return out


def cpulist(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the sysfs / taskset form)."""
    parts, i = [], 0
    cpus = sorted(cpus)
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def bind_rank(rank: int) -> str | None:
    """In a rank: bind this process to its block of ``H2H_RANK_CPUS`` (``"0-7,16-23;8-15,24-31"``,
    one block per rank) before any threads exist, so that every thread it starts inherits it;
    returns the block (cpulist) or None when nothing was asked."""
    spec = os.environ.get("H2H_RANK_CPUS")
    if not spec:
        return None
    from megatrain_ds.host.placement import parse_cpulist

    block = spec.split(";")[rank]
    os.sched_setaffinity(0, parse_cpulist(block))
    return block


def launch_cmd(python: str, gpus: int, run_system_args: list[str]) -> list[str]:
    """torchrun (as ``python -m torch.distributed.run``: no script on PATH needed) over
    ``benchmarks.run_system``."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(gpus),
        "-m",
        "benchmarks.run_system",
        *run_system_args,
    ]


def node_launches(
    python: str, gpus: int, nodes: int, run_system_args: list[str], port: int, env: dict
) -> list[tuple[list[str], dict]]:
    """``h2h --nodes M``: M torchrun launches on this box standing for M hosts of ``gpus / M`` GPUs
    each (the multi-node launch of docs/data_parallel.md: ``--nnodes M --node_rank r`` over
    127.0.0.1), each with its block of GPUs (CUDA_VISIBLE_DEVICES) and its own NCCL host identity
    (NCCL_HOSTID), so NCCL connects the "nodes" through its network transport (sockets here: no
    InfiniBand between them; NCCL_P2P_DISABLE and NCCL_SHM_DISABLE forbid the same-box paths, so
    even the ranks of one "node" talk over sockets) as it would between hosts; every rank keeps its
    global rank's core block (``H2H_RANK_CPUS``). (cmd, env) per node, node 0 first."""
    per = gpus // nodes
    visible = [
        d for d in env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",") if d
    ][:gpus]
    out = []
    for node in range(nodes):
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nodes),
            "--node_rank",
            str(node),
            "--nproc_per_node",
            str(per),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            "benchmarks.run_system",
            *run_system_args,
        ]
        node_env = dict(
            env,
            CUDA_VISIBLE_DEVICES=",".join(visible[node * per : (node + 1) * per]),
            NCCL_HOSTID=f"h2h-node{node}",
            NCCL_IB_DISABLE="1",
            NCCL_SOCKET_IFNAME="lo",
            NCCL_P2P_DISABLE="1",
            NCCL_SHM_DISABLE="1",
        )
        out.append((cmd, node_env))
    return out


def launch_env(
    gpus: int, bind: bool = True, env: dict | None = None, topology: dict | None = None
) -> dict:
    """The launch's environment: ``env`` (default os.environ) with H2H_RANK_CPUS (``bind``, when the
    cores split) and OMP_NUM_THREADS per rank (the smallest block's cpus, or the cpus / N) unless
    OMP_NUM_THREADS is set."""
    out = dict(os.environ if env is None else env)
    for key, value in NO_MULTICAST.items():  # the lent boxes set these; keep them set in every rank
        out.setdefault(key, value)
    out.pop("H2H_RANK_CPUS", None)
    blocks = rank_cpu_sets(gpus, topology) if bind else None
    if blocks:
        out["H2H_RANK_CPUS"] = ";".join(cpulist(b) for b in blocks)
        out.setdefault("OMP_NUM_THREADS", str(min(len(b) for b in blocks)))
    else:
        cpus = len(topology["cpus"]) if topology is not None else None
        out.setdefault("OMP_NUM_THREADS", str(threads_per_rank(gpus, cpus)))
    return out


def recorded_cmd(cmd: list[str], json_path: str) -> str:
    """The launch command as recorded in the results: ``python3`` for the interpreter, the JSON
    path's base name (no machine paths)."""
    parts = [
        "python3" if i == 0 else (os.path.basename(a) if a == json_path else a)
        for i, a in enumerate(cmd)
    ]
    return " ".join(shlex.quote(p) for p in parts)


# per rank, from its settings: where its threads ran and what it held (megatrain)
RANK_SETTINGS = (
    "rank_cpus",
    "host_placement",
    "owned_layers",
    "gpu_optimizer_layers_used",
    "kept_layers",
    "dp_world_size",
)


def _rank_summary(r: dict) -> dict:
    out = {k: r[k] for k in RANK_KEYS if k in r}
    settings = r.get("settings") or {}
    out.update({k: settings[k] for k in RANK_SETTINGS if k in settings})
    return out


def aggregate(per_rank: list[dict], gpus: int) -> dict:
    """One result from the ranks' results of one data-parallel run (see the module docstring for
    each number).

    A rank missing, or any rank not "ok", makes the whole run that status ("oom" if any rank ran out
    of memory, else "error") with every rank's error; ranks that disagree on the step count or the
    tokens per step are an error too. Keys as :func:`benchmarks.common.result_dict`, with
    tokens_per_s summed over the ranks, ``tflops`` per GPU, memory summed (host) or the largest
    rank's (GPU), plus gpus, tokens_per_rank, global_tokens_per_step, tflops_total, tflops_per_gpu,
    peak_host_rss_bytes_per_rank and per_rank (each rank's status, step times, memory, losses)."""
    ranks = sorted(per_rank, key=lambda r: int(r.get("rank", 0)))
    first = next((r for r in ranks if int(r.get("rank", -1)) == 0), ranks[0] if ranks else {})
    out = dict(first)
    out.update(gpus=int(gpus), per_rank=[_rank_summary(r) for r in ranks])
    out.pop("rank", None)
    seen = {int(r.get("rank", -1)) for r in ranks}
    missing = sorted(set(range(gpus)) - seen)
    errors = [
        f"rank {r.get('rank')}: {r.get('status')}: {str(r.get('error', '')).strip()[-1500:]}"
        for r in ranks
        if r.get("status") != "ok"
    ]
    if missing:
        errors.append(
            f"no result from rank(s) {missing} (killed after another rank failed, or crashed)"
        )
    if not errors:
        counts = {
            (len(r.get("warmup_step_times_s") or []), len(r.get("step_times_s") or []))
            for r in ranks
        }
        tokens = {int(r["tokens_per_step"]) for r in ranks}
        if len(counts) != 1:
            errors.append(f"ranks disagree on the step count (warm-up, measured): {sorted(counts)}")
        if len(tokens) != 1:
            errors.append(f"ranks disagree on tokens per step: {sorted(tokens)}")
        if not first.get("median_step_s"):
            errors.append("rank 0 measured no step")
    if errors:
        status = "oom" if any(r.get("status") == "oom" for r in ranks) else "error"
        out.update(status=status, error="\n".join(errors), tokens_per_s=0.0, tflops=0.0)
        return out
    per_rank_tokens = int(first["tokens_per_step"])
    tok_s = per_rank_tokens * gpus / first["median_step_s"]
    total = first["flops_per_token"] * tok_s / 1e12
    rss = [int(r.get("peak_host_rss_bytes") or 0) for r in ranks]
    n_params = int(first.get("n_params") or 0)
    out.update(
        tokens_per_rank=per_rank_tokens,
        global_tokens_per_step=per_rank_tokens * gpus,
        tokens_per_s=tok_s,
        tflops_total=total,
        tflops_per_gpu=total / gpus,
        tflops=total / gpus,
        peak_host_rss_bytes=sum(rss),
        peak_host_rss_bytes_per_rank=rss,
        host_bytes_per_param=sum(rss) / n_params if n_params else 0.0,
        peak_gpu_bytes=max(int(r.get("peak_gpu_bytes") or 0) for r in ranks),
        rank_median_step_s=[r["median_step_s"] for r in ranks],
    )
    if all("engine_host_state_bytes" in r for r in ranks):
        state = sum(int(r["engine_host_state_bytes"]) for r in ranks)
        out.update(
            engine_host_state_bytes=state,
            engine_host_bytes_per_param=state / n_params if n_params else 0.0,
        )
    return out


def bound_from_single(single: dict, gpus: int, reason: str) -> dict:
    """The whole-on-GPU bound for ``gpus`` GPUs from one GPU's run: its tokens/s × N (TFLOPS per GPU
    unchanged), labelled ``resident_mode`` "single×N" with ``reason``; host memory is the one
    process's (not measured × N)."""
    out = dict(single)
    out.update(gpus=int(gpus), resident_mode="single×N", bound_note=reason)
    if single.get("status") == "ok":
        out.update(
            tokens_per_rank=single["tokens_per_step"],
            global_tokens_per_step=single["tokens_per_step"] * gpus,
            tokens_per_s=single["tokens_per_s"] * gpus,
            tflops_total=single["tflops"] * gpus,
            tflops_per_gpu=single["tflops"],
            tflops=single["tflops"],
        )
    return out


def label(r: dict) -> str:
    """A row's system with how it ran on N GPUs: ``megatrain ×2``, ``resident ×2 (DDP)``,
    ``resident ×2 (bound: 1 GPU × 2)``."""
    g = int(r.get("gpus", 1))
    base = f"{r.get('system')} ×{g}"
    if r.get("system") == "resident" and g > 1:
        return base + (
            " (bound: 1 GPU × %d)" % g if r.get("resident_mode") == "single×N" else " (DDP)"
        )
    return base


def _key(r: dict) -> tuple:
    return (int(r.get("tokens_per_step") or 0), int(r.get("layers") or 0), int(r.get("gpus", 1)))


def _ratio(r: dict, peer: dict | None) -> str:
    if not peer or not peer.get("tokens_per_s") or r.get("status") != "ok":
        return "–"
    return f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}×"


def _gb(x) -> str:
    return f"{x / 1e9:.1f}" if x else "–"


def throughput_table(rows: list[dict]) -> str:
    """One row per run, grouped by (tokens per rank, layers, GPUs); ratios against the group's
    ZeRO-3 and whole-on-GPU rows (same number of GPUs)."""
    out = [
        "| run | system | GPUs | layers | tokens/step per rank | s/step (rank 0) | tokens/s (all "
        "ranks) | "
        "TFLOPS per GPU | vs ZeRO-3 | vs whole-on-GPU | peak GPU GB (max rank) | host RSS GB (sum) "
        "| "
        "host B/param (sum) | engine host B/param |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted({_key(r) for r in rows}):
        group = [r for r in rows if _key(r) == key]
        zero3 = next((r for r in group if r["system"] == "zero3" and r.get("status") == "ok"), None)
        resident = next(
            (r for r in group if r["system"] == "resident" and r.get("status") == "ok"), None
        )
        tokens, layers, gpus = key
        for r in sorted(group, key=lambda r: -(r.get("tokens_per_s") or 0)):
            head = f"| {r.get('name', '')} | {label(r)} | {gpus} | {layers} | {tokens} |"
            if r.get("status") != "ok":
                out.append(f"{head} {r.get('status')} | | | | | | | | |")
                continue
            engine = (
                f"{r['engine_host_bytes_per_param']:.1f}"
                if r.get("engine_host_bytes_per_param")
                else "–"
            )
            if r.get("resident_mode") == "single×N":  # one process measured, not N
                host = "– | –"
            else:
                host = f"{_gb(r['peak_host_rss_bytes'])} | {r['host_bytes_per_param']:.1f}"
            out.append(
                f"{head} {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
                f"{_ratio(r, zero3)} | {_ratio(r, resident)} | {_gb(r['peak_gpu_bytes'])} | {host} "
                "| "
                f"{engine} |"
            )
    return "\n".join(out)


def breakdown_table(rows: list[dict]) -> str:
    """Rank 0's step-time breakdown (median over the measured steps) with every key the engine
    returned."""
    with_b = [r for r in rows if r.get("breakdown")]
    if not with_b:
        return ""
    keys: list[str] = []
    for r in with_b:
        keys += [k for k in r["breakdown"] if k not in keys]
    out = ["| run | GPUs | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for r in with_b:
        b = r["breakdown"]
        cells = " | ".join(_cell(b.get(k)) for k in keys)
        out.append(f"| {r.get('name', '')} ({label(r)}) | {r.get('gpus', 1)} | {cells} |")
    return "Step-time breakdown, rank 0 (s unless named otherwise):\n\n" + "\n".join(out)


def _cell(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def scaling(rows: list[dict]) -> list[dict]:
    """megatrain's N-GPU run against its 1-GPU run of the same tokens per rank, layers and settings
    file: one dict per pair with ratio = tokens/s(N) / tokens/s(1), the issue's target 0.95·N, and
    the N-rank ZeRO-3 row's tokens/s when one is there (ANCHORS: >= 2.5×)."""
    out = []
    ok = [r for r in rows if r.get("status") == "ok"]
    shape = lambda r: (int(r.get("layers") or 0), int(r["tokens_per_step"]))  # noqa: E731
    for r in ok:
        g = int(r.get("gpus", 1))
        if r["system"] != "megatrain" or g < 2:
            continue
        one = next(
            (
                s
                for s in ok
                if s["system"] == "megatrain"
                and int(s.get("gpus", 1)) == 1
                and s.get("file") == r.get("file")
                and shape(s) == shape(r)
            ),
            None,
        )
        zero3 = next(
            (
                s
                for s in ok
                if s["system"] == "zero3" and int(s.get("gpus", 1)) == g and shape(s) == shape(r)
            ),
            None,
        )
        out.append(
            {
                "name": r.get("name"),
                "gpus": g,
                "tokens_per_step": r["tokens_per_step"],
                "layers": r["layers"],
                "tokens_per_s": r["tokens_per_s"],
                "one_gpu_tokens_per_s": one["tokens_per_s"] if one else None,
                "ratio": r["tokens_per_s"] / one["tokens_per_s"] if one else None,
                "target": 0.95 * g,
                "zero3_tokens_per_s": zero3["tokens_per_s"] if zero3 else None,
                "vs_zero3": r["tokens_per_s"] / zero3["tokens_per_s"] if zero3 else None,
            }
        )
    return out


def scaling_lines(rows: list[dict]) -> str:
    lines = []
    for s in scaling(rows):
        head = f"- scaling {s['name']}: megatrain ×{s['gpus']} {s['tokens_per_s']:,.0f} tokens/s"
        if s["ratio"] is not None:
            head += (
                f" vs ×1 {s['one_gpu_tokens_per_s']:,.0f} = **{s['ratio']:.2f}×** (target ≥ 0.95·N "
                "= "
                f"{s['target']:.2f}×: {'met' if s['ratio'] >= s['target'] else 'not met'})"
            )
        else:
            head += " (no 1-GPU megatrain run in the same file)"
        if s["vs_zero3"] is not None:
            head += (
                f"; vs ZeRO-3 ×{s['gpus']} {s['zero3_tokens_per_s']:,.0f} = {s['vs_zero3']:.2f}× "
                f"(target ≥ 2.5×: {'met' if s['vs_zero3'] >= 2.5 else 'not met'})"
            )
        lines.append(head)
    return "\n".join(lines)


def report_line(r: dict) -> str:
    """One line per data-parallel run (h2h prints it after the run)."""
    if r.get("status") != "ok":
        err = str(r.get("error", "")).strip().splitlines()
        return (
            f"[{label(r)}] tokens/step per rank={r.get('tokens_per_step')} "
            f"{str(r.get('status')).upper()}: "
            f"{err[-3:] if err else ''}"
        )
    line = (
        f"[{label(r)}] L={r['layers']} tokens/step per rank={r['tokens_per_step']} "
        f"{r['tokens_per_s']:,.0f} tokens/s (all ranks) {r['tflops']:.1f} TFLOPS per GPU "
        f"step {r['median_step_s']:.3f} s (rank 0) peak GPU {_gb(r['peak_gpu_bytes'])} GB"
    )
    if r.get("resident_mode") != "single×N":
        line += (
            f" host {_gb(r['peak_host_rss_bytes'])} GB summed ({r['host_bytes_per_param']:.1f} "
            "B/param)"
        )
    if r.get("breakdown"):
        line += "\n  rank 0 breakdown: " + ", ".join(
            f"{k} {_cell(v)}" for k, v in r["breakdown"].items()
        )
    return line
