"""Helpers shared by every benchmarked system: inputs, timing, memory probes and the result dict.

Units: times in seconds, memory in bytes, throughput in tokens/s, compute in TFLOPS (1e12 FLOP/s).
A system module (resident, zero3, megatrain) builds its model and a ``step(input_ids) -> loss``
callable, then hands both to :func:`measure`, which returns the result dict described in
:func:`result_dict`.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from benchmarks.shapes import model_flops_per_token

# ANCHORS "Fair comparison rules": every system trains with these AdamW hyperparameters (weight
# decay included)
OPTIMIZER = {"lr": 1e-5, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
# liger-kernel's defaults for Qwen2 (``apply_liger_kernel_to_qwen2``), i.e. what HF Trainer's
# use_liger_kernel applies
LIGER_KERNELS = ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy")
HF_CHECKPOINTING = "HF per decoder layer (non-reentrant torch.utils.checkpoint)"


def h2h_clip() -> float:
    """gradient_clipping for every system: h2h's --clip, passed to each child as H2H_CLIP (ANCHORS:
    1.0)."""
    return float(os.environ.get("H2H_CLIP", "1.0"))


def liger_importable() -> bool:
    """True when liger-kernel (GPU only: it needs triton) imports here."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return False
    return True


def resolve_liger(mode: str, device: str) -> bool:
    """h2h --liger: "off" -> False; "on" -> True (CUDA and liger-kernel required); "auto" -> on CUDA
    with liger-kernel importable."""
    if mode == "off":
        return False
    cuda = device.startswith("cuda")
    if mode == "on":
        if not cuda:
            raise ValueError("--liger on: liger-kernel runs on CUDA only")
        if not liger_importable():
            raise ValueError("--liger on: liger_kernel is not importable here")
        return True
    if mode != "auto":
        raise ValueError(f"--liger must be auto, on or off, got {mode!r}")
    return cuda and liger_importable()


def apply_hf_liger(model: torch.nn.Module, kernel_config: dict | None = None) -> None:
    """liger-kernel exactly as HF Trainer's ``use_liger_kernel=True`` applies it
    (liger_kernel_config None): ``_apply_liger_kernel_to_instance(model=model)`` with liger's
    defaults, i.e. RMSNorm, SwiGLU MLP and RoPE patched in, and the causal-LM forward replaced by
    one using the fused linear cross-entropy (no logits). ``kernel_config``: the Trainer's
    ``liger_kernel_config`` (e.g. ``{"rms_norm": False}``), passed to liger as keywords."""
    try:
        from transformers.integrations.liger import apply_liger_kernel
    except ImportError:  # older transformers: Trainer calls liger directly
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, **(kernel_config or {}))
    else:
        apply_liger_kernel(model, kernel_config)


def settings_dict(
    *,
    precision: str,
    optimizer: str,
    opt_params: dict,
    clip: float,
    warmup: int,
    steps: int,
    seq: int,
    micro_batch: int,
    kernels: list[str],
    loss_kernel: str,
    gradient_checkpointing: str,
    offload_optimizer_ratio: float | None,
    **extra,
) -> dict:
    """A run's settings as recorded under "settings": what the fairness rules ask to be equal, flat.

    ``opt_params`` are the AdamW hyperparameters actually used (lr, weight_decay, betas, eps);
    ``kernels`` the liger kernels applied ([] = the model's own); ``offload_optimizer_ratio`` the
    fraction of optimizer state on the CPU (None: no offload, everything on the GPU). A peer that
    checkpoints every decoder layer passes ``recomputes_every_layer=True`` (benchmarks.depth's
    recompute-counted TFLOPS read it).
    """
    out = {
        "precision": precision,
        "optimizer": optimizer,
        "lr": float(opt_params["lr"]),
        "weight_decay": float(opt_params["weight_decay"]),
        "betas": [float(b) for b in opt_params["betas"]],
        "eps": float(opt_params["eps"]),
        "clip": float(clip),
        "warmup": int(warmup),
        "steps": int(steps),
        "seq": int(seq),
        "micro_batch": int(micro_batch),
        "tokens_per_step": int(seq) * int(micro_batch),
        "liger": bool(kernels),
        "kernels": list(kernels),
        "loss_kernel": loss_kernel,
        "gradient_checkpointing": gradient_checkpointing,
        "offload_optimizer_ratio": offload_optimizer_ratio,
    }
    out.update(extra)
    return out


def micro_batch_for(tokens_per_step: int, seq: int) -> int:
    """Sequences per micro-batch (count) for ``tokens_per_step`` tokens at ``seq`` tokens each (>=
    1)."""
    return max(1, int(tokens_per_step) // int(seq))


def make_batches(
    vocab: int, micro_batch: int, seq: int, n: int, seed: int, rank: int = 0
) -> list[torch.Tensor]:
    """``n`` CPU int64 tensors of shape (micro_batch, seq) holding seeded random token ids in [0,
    vocab).

    ``rank``: a data-parallel rank's own micro-batches (rank 0 gets the one-process data)."""
    gen = torch.Generator().manual_seed(seed + 1_000_003 * int(rank))
    return [torch.randint(0, vocab, (micro_batch, seq), generator=gen) for _ in range(n)]


def peak_host_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident set size of process ``pid`` (this one by default) in bytes (VmHWM of
    /proc/PID/status; 0 if unavailable)."""
    return _proc_status_bytes("VmHWM", pid)


def host_rss_bytes(pid: int | str = "self") -> int:
    """Current resident set size of process ``pid`` in bytes (VmRSS; 0 if unavailable)."""
    return _proc_status_bytes("VmRSS", pid)


def _proc_status_bytes(key: str, pid: int | str) -> int:
    return proc_kb_bytes(f"/proc/{pid}/status", key)


def proc_kb_bytes(path: str, key: str) -> int:
    """The ``key:`` line of a /proc file that counts in kB (``/proc/PID/status``,
    ``/proc/meminfo``), in bytes; 0 if the file or the key is missing."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# Phases of a run (model built, engine initialized, steps done) with the host memory at their end:
# recorded in the result under "phases", and printed (``@@h2h-phase {json}``, with --progress) so
# that benchmarks.h2h keeps them even when the process is killed before it writes its result (the
# kernel's OOM killer).
PHASE_TAG = "@@h2h-phase"
PHASES: list[dict] = []
_T0 = time.perf_counter()


def report_phase(name: str, **extra) -> dict:
    """Record the end of phase ``name``: seconds since the process started (t_s) and since the last
    phase (phase_s), current and peak host RSS and the process's memory in transparent huge pages
    (bytes; 0 where the kernel does not say), plus ``extra``."""
    now = time.perf_counter() - _T0
    entry = {
        "phase": name,
        "t_s": round(now, 3),
        "phase_s": round(now - (PHASES[-1]["t_s"] if PHASES else 0.0), 3),
        "rss_bytes": host_rss_bytes(),
        "peak_rss_bytes": peak_host_rss_bytes(),
        # of it in transparent huge pages: the host update ran at 5.23 Gparam/s against the same
        # machine's 7.01 after two peers had held 191 and 178 GB (2026-11-30), a cause to tell apart
        "anon_huge_bytes": proc_kb_bytes("/proc/self/smaps_rollup", "AnonHugePages"),
        **extra,
    }
    PHASES.append(entry)
    if STEP_PROGRESS is not None:  # --progress (rank 0): for the driver
        print(f"{PHASE_TAG} {json.dumps(entry, default=str)}", flush=True)
    return entry


# A run's teardown, left until its result is written (``benchmarks.run_system`` sets
# DEFER_TEARDOWN, writes the JSON, then calls ``release_after_result``): freeing a 7B run's host
# memory took 5-22 s after its steps (115-191 GB; 2026-11-30), time in which a phase's limit landed
# before the result was on disk (one megatrain_ds run lost so: call 2 of
# benchmarks/results/2026-11-30_h200x2_7b_24gib_alloc_row). Elsewhere (tests calling a system in
# their own process) the teardown runs where the system asks for it, as before.
DEFER_TEARDOWN = False
_AFTER_RESULT: list[Callable[[], object]] = []


def after_result(teardown: Callable[[], object]) -> None:
    """Run ``teardown`` (an engine's stop, or a list's ``clear`` that lets go of the run's objects)
    after the result is written when DEFER_TEARDOWN is set; at once otherwise."""
    if DEFER_TEARDOWN:
        _AFTER_RESULT.append(teardown)
    else:
        teardown()


def release_after_result() -> int:
    """The teardowns ``after_result`` kept, last first, then a collection (DeepSpeed's engine holds
    reference cycles); returns how many ran."""
    n = 0
    while _AFTER_RESULT:
        _AFTER_RESULT.pop()()
        n += 1
    gc.collect()
    return n


_GPU_BLOCKER = None  # --gpu-memory-limit: the process that holds the rest of the GPU
# --gpu-memory-limit in bytes once held, for a peer that plans from the device's total memory
# rather than what is free (Gemini's "auto" placement: gemini_system.cap_gemini_capacity)
GPU_LIMIT_BYTES: int | None = None


def hold_gpu_memory(limit_gib: float) -> int:
    """Leave only ``limit_gib`` GiB of this GPU free, as another process holding the rest would (a
    consumer GPU's memory on a big one): a child process allocates the difference and holds it until
    this process ends (its stdin closes). Held outside this process, the bytes are not in its
    caching allocator: the engine's "auto" placements and the peers' allocators see only the limit,
    as on a card of that size. Returns the bytes held."""
    global _GPU_BLOCKER, GPU_LIMIT_BYTES
    import subprocess

    free, _ = torch.cuda.mem_get_info()
    # the child's own CUDA context takes some of what it frees; it allocates until only the limit is
    # left
    code = (
        "import sys, torch\n"
        f"limit = int({limit_gib!r} * 2**30)\n"
        f"torch.cuda.set_device({torch.cuda.current_device()})\n"
        "free, _ = torch.cuda.mem_get_info()\n"
        "held = torch.empty(max(free - limit, 0), dtype=torch.uint8, device='cuda')\n"
        "print(held.numel(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = child.stdout.readline()
    if not line.strip().isdigit():
        raise RuntimeError(
            f"--gpu-memory-limit: the process holding the GPU memory failed (exit {child.poll()})"
        )
    _GPU_BLOCKER = child
    GPU_LIMIT_BYTES = int(limit_gib * 2**30)
    now_free, _ = torch.cuda.mem_get_info()
    print(
        f"[gpu-memory-limit] another process holds {int(line) / 2**30:.1f} GiB; "
        f"{now_free / 2**30:.1f} GiB free "
        f"(was {free / 2**30:.1f})",
        file=sys.stderr,
        flush=True,
    )
    return int(line)


def peak_gpu_bytes(device: str) -> int:
    """Peak bytes allocated by the torch CUDA caching allocator since the last reset (0 on CPU);
    what ``hold_gpu_memory`` holds is another process's."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return 0


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator was told to grow its segments
    (``expandable_segments:True`` in PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, as the
    process's environment says)."""
    conf = ",".join(
        os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def summarize_allocator(stats: dict, segments: list[dict], names: dict | None = None) -> dict:
    """The allocator's record (``allocator_record``) from ``torch.cuda.memory_stats()`` and
    ``torch.cuda.memory_snapshot()``: its peaks, its retries (an allocation that found the GPU full,
    freed the cache, synchronising the device, and tried again) and out-of-memory errors, and what
    it reserves now by stream (``names``: stream handle -> name; others by handle) and pool, in
    bytes: where a gap between the reserved and the allocated peak sits."""
    names = names or {}
    by_stream: dict[str, dict] = {}
    for seg in segments:
        handle = int(seg.get("stream", 0))
        key = f"{names.get(handle, 'default' if handle == 0 else hex(handle))} " + (
            seg.get("segment_type") or "?"
        )
        row = by_stream.setdefault(key, {"segments": 0, "reserved": 0, "allocated": 0})
        row["segments"] += 1
        row["reserved"] += int(seg.get("total_size", 0))
        row["allocated"] += int(seg.get("allocated_size", 0))
    return {
        "allocated_peak": int(stats.get("allocated_bytes.all.peak", 0)),
        "reserved_peak": int(stats.get("reserved_bytes.all.peak", 0)),
        "inactive_split_peak": int(stats.get("inactive_split_bytes.all.peak", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "ooms": int(stats.get("num_ooms", 0)),
        "expandable_segments": expandable_segments(),
        "reserved_now_by_stream": by_stream,
    }


def allocator_record(device: str, names: dict | None = None) -> dict:
    """``summarize_allocator`` of this process's CUDA allocator now (the peaks since the last
    ``reset_memory_stats``); {} off CUDA."""
    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return {}
    return summarize_allocator(torch.cuda.memory_stats(), torch.cuda.memory_snapshot(), names)


def allocator_line(res: dict) -> str:
    """One line of a run's allocator record (``settings.allocator``), "" without one: the peaks,
    the retries, and the reserved memory not allocated now, by stream."""
    rec = (res.get("settings") or {}).get("allocator") or res.get("allocator") or {}
    if not rec:
        return ""
    gib = 2**30
    idle = ", ".join(
        f"{k} {(v['reserved'] - v['allocated']) / gib:.2f}"
        for k, v in sorted(rec.get("reserved_now_by_stream", {}).items())
        if v["reserved"] > v["allocated"]
    )
    return (
        f"    [{res.get('system', '?')}] allocator: allocated peak "
        f"{rec['allocated_peak'] / gib:.2f} GiB, "
        f"reserved peak {rec['reserved_peak'] / gib:.2f} GiB, "
        f"retries {rec['alloc_retries']}, expandable segments "
        f"{'on' if rec['expandable_segments'] else 'off'}; reserved, not allocated, now (GiB): "
        f"{idle or 'none'}"
    )


def sync(device: str) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_memory_stats(device: str) -> None:
    """Reset the CUDA peak-memory counter so ``peak_gpu_bytes`` covers only this run."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is a device (or pinned-host) out-of-memory error."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def set_single_process_env() -> None:
    """Fill in the torch.distributed env vars of a one-process world, keeping any already set.

    MASTER_PORT "0": the one rank's store binds whatever port the OS gives it at bind time (the
    ``env://`` and ``tcp://`` rendezvous both accept it). A port chosen earlier (``free_port``)
    can be taken by another process, a client socket's ephemeral port, before the store binds it:
    a suite run saw ZeRO-3's child fail with EADDRINUSE that way (2026-11-29)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    for key in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(key, "0")
    os.environ.setdefault("WORLD_SIZE", "1")


def enable_hf_checkpointing(model: torch.nn.Module) -> None:
    """Turn on HF per-decoder-layer activation checkpointing (non-reentrant torch.utils.checkpoint).

    Newer transformers name it ``activation_checkpointing_enable``; older ones
    ``gradient_checkpointing_enable``.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (elements); uses ``ds_numel`` for ZeRO-3 partitioned ones."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += int(getattr(p, "ds_numel", p.numel()))
    return total


# Called after every step with (steps done, steps in all, that step's seconds);
# benchmarks.run_system sets it to print a progress line that benchmarks.h2h turns into a progress
# bar per system.
STEP_PROGRESS: Callable[[int, int, float], None] | None = None
PROGRESS_TAG = "@@h2h-step"


def print_step_progress(done: int, total: int, seconds: float) -> None:
    """One machine-readable line on stdout: ``@@h2h-step DONE TOTAL SECONDS``."""
    print(f"{PROGRESS_TAG} {done} {total} {seconds:.4f}", flush=True)


def data_rank() -> int:
    """This process's data-parallel rank (0 without a launcher, or in a world of one)."""
    return (
        int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0
    )


def step_barrier():
    """A callable that waits for every rank (a gloo group of its own, so it never queues behind the
    systems' NCCL work), or None in one process. Every rank must call this at the same point (it
    makes a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    group = dist.new_group(backend="gloo")
    return lambda: dist.barrier(group=group)


def measure(
    step: Callable[[torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    warmup: int,
    device: str,
) -> tuple[list[float], list[float], list[float]]:
    """Run ``step`` on every batch; return (warm-up step times s, measured step times s, losses).

    Each step is timed with time.perf_counter between device synchronisations; the batch is moved to
    ``device`` before the clock starts. Losses are read after the clock stops. Data parallel
    (several ranks): every rank starts each step after a barrier and ends it with its device sync
    and a barrier, so each rank's step time is the slowest rank's (h2h reports rank 0's).
    """
    barrier = step_barrier()
    warm_times, times, losses = [], [], []
    for i, cpu_batch in enumerate(batches):
        batch = cpu_batch.to(device, non_blocking=False)
        sync(device)
        if barrier:
            barrier()
        t0 = time.perf_counter()
        loss = step(batch)
        sync(device)
        if barrier:
            barrier()
        elapsed = time.perf_counter() - t0
        (warm_times if i < warmup else times).append(elapsed)
        losses.append(float(loss.detach().float().item()))
        if STEP_PROGRESS is not None:
            STEP_PROGRESS(i + 1, len(batches), elapsed)
    return warm_times, times, losses


@dataclass(frozen=True)
class Run:
    """What every result of one system's run names: the system, the model's config and its layer
    count, the batch (``micro_batch`` sequences of ``seq`` tokens) and the device."""

    system: str
    config: Any
    layers: int
    micro_batch: int
    seq: int
    device: str


def oom_result(run: Run, n_params: int, exc: BaseException, **extra) -> dict:
    """The result of a run that ran out of memory (status "oom", the error's first 4000
    characters), after freeing what it held on the device."""
    cleanup()
    return result_dict(run, n_params, status="oom", error=str(exc)[:4000], **extra)


def result_dict(
    run: Run,
    n_params: int = 0,
    warm_times: list[float] | None = None,
    times: list[float] | None = None,
    losses: list[float] | None = None,
    status: str = "ok",
    error: str = "",
    lora_params: int | None = None,
    **extra,
) -> dict:
    """The JSON-ready result of one run.

    Keys: system, model, layers, seq, micro_batch, tokens_per_step (tokens), warmup_step_times_s,
    step_times_s (measured steps, s), median_step_s (s), tokens_per_s, flops_per_token (FLOP),
    tflops (benchmarks.shapes formula: full fine-tuning, or LoRA when ``lora_params`` (adapter
    count) is given), losses, peak_gpu_bytes, peak_host_rss_bytes (bytes), n_params (count),
    host_bytes_per_param (bytes/param), device, status ("ok" | "oom" | "error"), error, phases (see
    report_phase), plus ``extra``.
    """
    config, seq, micro_batch, device = run.config, run.seq, run.micro_batch, run.device
    tokens = micro_batch * seq
    median = statistics.median(times) if times else None
    tok_s = tokens / median if times else 0.0
    flops = model_flops_per_token(config, seq, lora_params)
    rss = peak_host_rss_bytes()
    out = {
        "system": run.system,
        "model": getattr(config, "name_or_path", "") or "?",
        "layers": int(run.layers),
        "seq": int(seq),
        "micro_batch": int(micro_batch),
        "tokens_per_step": int(tokens),
        "warmup_step_times_s": list(warm_times or []),
        "step_times_s": list(times or []),
        "median_step_s": median,  # None when no step ran
        "tokens_per_s": tok_s,
        "flops_per_token": flops,
        "tflops": flops * tok_s / 1e12,
        "losses": list(losses or []),
        "peak_gpu_bytes": peak_gpu_bytes(device),
        "peak_host_rss_bytes": rss,
        "n_params": int(n_params),
        "host_bytes_per_param": rss / n_params if n_params else 0.0,
        "device": device,
        "status": status,
        "error": error,
        "phases": list(PHASES),
        # every system's allocator at its end (megatrain_ds's, by stream, is in its settings)
        "allocator": allocator_record(device),
    }
    out.update(extra)
    return out


def cleanup() -> None:
    """Collect garbage and return cached CUDA memory to the driver (best effort, e.g. after an
    OOM)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
