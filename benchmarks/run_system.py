"""Run ONE training system in this process and write its result dict as JSON.

Usage:
    python -m benchmarks.run_system --system {resident,zero3,megatrain,fsdp,gemini} --model NAME \
        [--layers N] \
        --tokens-per-step T [--seq 1024] --steps S [--warmup 2] --device cuda|cpu --json OUT.json \
        [--liger auto|on|off] [--gpu-optimizer-fraction F] [--host-only] [--lora R \
            [--lora-targets T]] \
        [--init auto|fast|hf] [--closing-step full|tiny]

A driver runs each system in its own subprocess so that memory peaks and allocator state do not leak
between systems. For zero3 the DeepSpeed config is also written to ``OUT.ds_config.json``. Exit code
0 for status "ok" or "oom"; 1 (with status "error" in the JSON) for any other failure.

Data parallel (``h2h --gpus N``): torchrun starts this module N times (WORLD_SIZE = N); each rank
uses GPU LOCAL_RANK, trains on its own micro-batches, writes ``OUT.rank<r>.json``
(benchmarks.multi_gpu.rank_json) and prints progress on rank 0 only. A rank that is not "ok" (an OOM
too) exits 1, so that torchrun stops the other ranks instead of leaving them waiting in a
collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

from benchmarks import common
from benchmarks.multi_gpu import bind_rank, dist_env, rank_json
from benchmarks.build import INIT_CHOICES
from benchmarks.shapes import SHAPE_NAMES, make_config
from benchmarks.fsdp_system import run_fsdp
from benchmarks.gemini_system import run_gemini
from benchmarks.systems import run_resident, run_zero3

SYSTEMS = {
    "resident": run_resident,
    "zero3": run_zero3,
    "fsdp": run_fsdp,
    "gemini": run_gemini,
}

# ---------------------------------------------------------------------------------------------
# megatrain system: provided by benchmarks/megatrain_system.py (written alongside megatrain_ds). It
# must define run_megatrain(config, tokens_per_step, seq, steps, warmup, device, seed, liger=,
# gpu_optimizer_fraction=, host_only=, lora=, lora_targets=, init=) -> dict with the same keys as
# the baselines (see benchmarks.common.result_dict). A missing or broken module only disables
# "megatrain"; the baselines keep working.
# ---------------------------------------------------------------------------------------------
MEGATRAIN_IMPORT_ERROR: str = ""
try:
    from benchmarks.megatrain_system import run_megatrain
except Exception:  # noqa: BLE001 - any import failure just disables this one system
    MEGATRAIN_IMPORT_ERROR = traceback.format_exc()
else:
    SYSTEMS["megatrain"] = run_megatrain


# How each system runs over N ranks (recorded in its settings under "data_parallel" when WORLD_SIZE
# > 1)
DATA_PARALLEL = {
    "megatrain": "megatrain_ds data parallel: layer i's host state on rank i % N, weights "
    "broadcast and gradients "
    "reduced per layer (megatrain_ds/parallel/dp.py), resident parameters all-reduced",
    "zero3": "DeepSpeed ZeRO-3 over N ranks: parameters, gradients and optimizer state "
    "partitioned, CPU offload",
    "resident": "torch DDP over N ranks (gradient_as_bucket_view), gradients averaged; whole model "
    "on every GPU",
    "fsdp": "PyTorch FSDP2 over N ranks: parameters, gradients and optimizer state sharded, CPU "
    "offload",
    "gemini": "ColossalAI Gemini (GeminiPlugin) over N ranks: chunked ZeRO-3 style sharding, "
    "placement policy",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (tokens are counts of tokens; seq is tokens per sequence)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--system", required=True, choices=sorted(set(SYSTEMS) | {"megatrain"}))
    parser.add_argument("--model", required=True, choices=SHAPE_NAMES)
    parser.add_argument(
        "--layers", type=int, default=None, help="override the number of decoder layers"
    )
    parser.add_argument(
        "--tokens-per-step", type=int, required=True, help="tokens per optimizer step"
    )
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after warm-up)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="warm-up steps, not timed in the median"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--liger",
        default="auto",
        choices=["auto", "on", "off"],
        help="liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy (auto: on CUDA "
        "when liger_kernel imports)",
    )
    parser.add_argument(
        "--gpu-optimizer-fraction",
        type=float,
        default=0.0,
        help="fraction F of the optimizer state on the GPU (offload_optimizer.ratio = 1 - F; zero3 "
        "and megatrain)",
    )
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="megatrain: gpu_optimizer_layers 0 (all optimizer state on the host)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="zero3 and megatrain: peft LoRA of rank R (alpha 2R, dropout 0), the base frozen; 0: "
        "full fine-tuning",
    )
    parser.add_argument(
        "--lora-targets",
        default="default",
        help="with --lora: default (q,k,v,o,gate,up,down), all-linear, or a comma-separated list",
    )
    parser.add_argument(
        "--init",
        default="auto",
        choices=INIT_CHOICES,
        help="megatrain's, fsdp's and gemini's model init (benchmarks.build): hf, fast (layer 0 "
        "values "
        "repeated), auto (fast from 14 B parameters); zero3 always uses transformers' init under "
        "zero.Init",
    )
    parser.add_argument(
        "--closing-step",
        default="full",
        choices=["full", "tiny"],
        help="megatrain: what closes the last measured step's breakdown: one more training step "
        "(full, untimed) or an 8-token no-grad forward (tiny: long context)",
    )
    parser.add_argument(
        "--gpu-memory-limit",
        type=float,
        default=None,
        metavar="GIB",
        help="leave only this many GiB of the GPU free (the rest held, as by another process): "
        "a consumer GPU's memory on a big one",
    )
    parser.add_argument("--json", required=True, help="path of the result JSON")
    parser.add_argument(
        "--progress",
        action="store_true",
        help="print '@@h2h-step DONE TOTAL SECONDS' after each step (read by benchmarks.h2h)",
    )
    return parser.parse_args(argv)


def system_kwargs(args: argparse.Namespace) -> dict:
    """The fairness switches each system takes: liger (all; "auto" resolved here), the GPU's share
    of the optimizer state (zero3, megatrain; resident keeps everything on the GPU), host-only
    (megatrain)."""
    kwargs: dict = {"liger": common.resolve_liger(args.liger, args.device)}
    if args.system in ("zero3", "megatrain"):
        kwargs["gpu_optimizer_fraction"] = args.gpu_optimizer_fraction
    if args.system == "megatrain":
        kwargs["host_only"] = args.host_only
        if args.closing_step != "full":
            kwargs["closing_step"] = args.closing_step
    if args.system in ("zero3", "megatrain"):
        kwargs.update(lora=args.lora, lora_targets=args.lora_targets, init=args.init)
    elif args.system in ("fsdp", "gemini"):
        kwargs["init"] = args.init
    if args.lora and args.system not in ("zero3", "megatrain"):
        raise ValueError(
            f"--lora: the {args.system} system has no LoRA path (zero3 and megatrain have)"
        )
    return kwargs


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` as indented JSON to ``path``, creating its folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, default=str)
        fh.write("\n")


def summary_line(res: dict) -> str:
    """One human-readable line: throughput (tokens/s), TFLOPS, step time (s), memory (GB = 1e9
    bytes)."""
    if res.get("status") != "ok":
        return (
            f"[{res.get('system')}] {res.get('model')} L={res.get('layers')} "
            f"tokens/step={res.get('tokens_per_step')}"
            f" status={res.get('status')}: {str(res.get('error', '')).splitlines()[:1]}"
        )
    losses = res["losses"]
    settings = res.get("settings") or {}
    build = f"build={settings['build_s']:.1f}s " if settings.get("build_s") is not None else ""
    return (
        f"[{res['system']}] {res['model']} L={res['layers']} tokens/step={res['tokens_per_step']} "
        f"{build}"
        f"median_step={res['median_step_s']:.4f}s tokens/s={res['tokens_per_s']:,.0f} "
        f"TFLOPS={res['tflops']:.3f} peak_gpu={res['peak_gpu_bytes'] / 1e9:.2f}GB "
        f"host_rss={res['peak_host_rss_bytes'] / 1e9:.2f}GB "
        f"host_B/param={res['host_bytes_per_param']:.1f} "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} status=ok"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the chosen system once, write the JSON (and ds_config JSON), print one summary line."""
    args = parse_args(argv)
    # torch 2.13 warns on every DeepSpeed collective (all_gather_into_tensor etc. renamed); silence
    # just those.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning
    )
    config = make_config(args.model, layers=args.layers)
    if args.system not in SYSTEMS:
        sys.stderr.write(f"system {args.system!r} unavailable:\n{MEGATRAIN_IMPORT_ERROR}\n")
        return 2
    rank, local_rank, world = dist_env()
    cpus = bind_rank(rank) if world > 1 else None  # h2h --bind-cores: before any thread pool exists
    if world > 1 and args.device == "cuda":
        import torch

        # before any CUDA work: every system's "cuda" is this rank's GPU
        torch.cuda.set_device(local_rank)
    if args.progress and rank == 0:
        common.STEP_PROGRESS = common.print_step_progress
    common.DEFER_TEARDOWN = True  # a run's teardown after its JSON (common.after_result)
    held = 0
    if args.gpu_memory_limit is not None and args.device == "cuda":
        held = common.hold_gpu_memory(args.gpu_memory_limit)
    t0 = time.perf_counter()
    try:
        res = SYSTEMS[args.system](
            config,
            args.tokens_per_step,
            seq=args.seq,
            steps=args.steps,
            warmup=args.warmup,
            device=args.device,
            seed=args.seed,
            **system_kwargs(args),
        )
    except Exception:  # noqa: BLE001 - reported in the JSON for the driver
        res = {
            "system": args.system,
            "model": args.model,
            "layers": config.num_hidden_layers,
            "tokens_per_step": args.tokens_per_step,
            "device": args.device,
            "status": "error",
            "error": traceback.format_exc(),
            "phases": list(common.PHASES),
        }
        sys.stderr.write(f"[rank {rank}] " * (world > 1) + res["error"])
    res["process_wall_s"] = time.perf_counter() - t0  # build + warm-up + measured steps (s)
    if args.gpu_memory_limit is not None and isinstance(res.get("settings"), dict):
        res["settings"].update(gpu_memory_limit_gib=args.gpu_memory_limit, gpu_bytes_held=held)
    recorded = sys.argv[1:] if argv is None else list(argv)
    # no machine paths
    res.setdefault("argv", [os.path.basename(a) if a == args.json else a for a in recorded])
    path = args.json
    if world > 1:
        res.update(rank=rank, world_size=world)
        if isinstance(res.get("settings"), dict):
            res["settings"].update(
                ranks=world,
                data_parallel=DATA_PARALLEL[args.system],
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                rank_cpus=cpus or "not bound",
            )
        path = rank_json(args.json, rank)
    write_json(path, res)
    if "ds_config" in res and rank == 0:
        write_json(os.path.splitext(args.json)[0] + ".ds_config.json", res["ds_config"])
    print(("" if world == 1 else f"[rank {rank}/{world}] ") + summary_line(res), flush=True)
    common.release_after_result()  # the run's teardown, now that its result is on disk
    if world > 1:
        _leave_process_group(res.get("status") == "ok")
        return 0 if res.get("status") == "ok" else 1
    return 0 if res.get("status") in ("ok", "oom") else 1


def _leave_process_group(ok: bool) -> None:
    """Data parallel: leave the launcher's process group cleanly after a good run (a failed rank
    exits at once: its peers may be stuck in a collective, and torchrun stops them on its exit
    code)."""
    import torch.distributed as dist

    if ok and dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the result is written; only the teardown failed
            sys.stderr.write(f"process group teardown: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
