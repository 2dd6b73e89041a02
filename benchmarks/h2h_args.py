"""``python -m benchmarks.h2h``'s command line: the arguments, their checks (``p.error`` names the
bad flag), and the environment the harness hands each system's process (H2H_CLIP,
MEGATRAIN_OPTIONS, MEGATRAIN_DS_CONFIG, ZERO3_DS_CONFIG)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import multi_gpu
from benchmarks.build import INIT_CHOICES
from benchmarks.host_check import HOST_BYTES_PER_PARAM, LORA_HOST_BYTES_PER_PARAM
from benchmarks.shapes import SHAPE_NAMES, is_moe, make_config


def parse(argv: list[str] | None, doc: str) -> tuple[argparse.Namespace, list[str], list]:
    """(args, the systems, the depths: the --depth-sweep layer counts, or [--layers]) of ``argv``
    (the command line when None), checked; exports the children's environment."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--systems", default="megatrain,zero3,resident")
    p.add_argument("--model", default="qwen2.5-3b", choices=SHAPE_NAMES)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument(
        "--best-batch", action="store_true", help="search each system's fastest batch that fits"
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="start of the --best-batch search (default: one sequence); it doubles from there",
    )
    p.add_argument(
        "--max-tokens", type=int, default=262144, help="upper end of the --best-batch search"
    )
    p.add_argument(
        "--depth-sweep", default=None, help="comma-separated layer counts, e.g. 28,56,84,120,180"
    )
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--megatrain-options",
        default=None,
        metavar="JSON",
        help='extra keys for megatrain_ds\'s "megatrain" config block, e.g. '
        '\'{"gpu_optimizer_layers": "auto"}\'',
    )
    p.add_argument(
        "--ds-config",
        default=None,
        metavar="JSON",
        help="DeepSpeed config keys merged into megatrain_ds's config, block by block, e.g. the "
        "NVMe tier: "
        '\'{"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}\'',
    )
    p.add_argument(
        "--zero3-ds-config",
        default=None,
        metavar="JSON",
        help="DeepSpeed config keys merged into the ZeRO-3 peer's config, block by block, e.g. its "
        "bf16 "
        "state: '{\"bf16\": {\"bf16_master_weights_and_grads\": true, \"bf16_optimizer_states\": "
        "true}}'",
    )
    p.add_argument(
        "--clip",
        type=float,
        default=1.0,
        help="gradient_clipping for every system (ANCHORS: 1.0); a large value never clips",
    )
    p.add_argument(
        "--liger",
        default="auto",
        choices=["auto", "on", "off"],
        help="liger-kernel (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy) for every system; "
        "auto: on "
        "when running on CUDA with liger_kernel importable",
    )
    p.add_argument(
        "--gpu-optimizer-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="share of the optimizer state on the GPU for megatrain and ZeRO-3 alike "
        "(offload_optimizer.ratio = 1 - F); 0: all on the host, or megatrain's engine default",
    )
    p.add_argument(
        "--host-only",
        action="store_true",
        help="megatrain: all optimizer state on the host (gpu_optimizer_layers 0), whatever the "
        "engine's default",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        metavar="N",
        help="processes (GPUs) per system: N > 1 launches each system as N ranks under torchrun, "
        "each "
        "on its own micro-batch of --tokens-per-step tokens (benchmarks/multi_gpu.py)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="M",
        help="with --gpus N: launch each system as M torchrun 'nodes' on this box (--nnodes M, N/M "
        "GPUs "
        "each, over 127.0.0.1, NCCL between them through its socket transport): the multi-node "
        "path on one machine (benchmarks/multi_gpu.py node_launches)",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="with --gpus N > 1: also run megatrain on one GPU and print N GPUs / 1 GPU",
    )
    p.add_argument(
        "--resident-mode",
        default="auto",
        choices=list(multi_gpu.RESIDENT_MODES),
        help="the whole-on-GPU bound with --gpus N > 1: ddp (DDP over N ranks), single (one GPU's "
        "tokens/s × N, labelled a bound), auto (DDP; one GPU × N if DDP runs out of memory)",
    )
    p.add_argument(
        "--bind-cores",
        default="on",
        choices=["on", "off"],
        help="with --gpus N > 1: bind each rank of every system to its own 1/N of the physical "
        "cores "
        "(OMP_NUM_THREADS its size); off: no binding, OMP_NUM_THREADS = cpus / N",
    )
    p.add_argument(
        "--host-mem-gib",
        type=float,
        default=None,
        metavar="G",
        help="host memory to check each system's need against (default: MemAvailable; a VM whose "
        "memory grows as it is used reads too little there at first)",
    )
    p.add_argument(
        "--gpu-memory-limit",
        type=float,
        default=None,
        metavar="GIB",
        help="every system sees only this many GiB of the GPU free (the rest held, as by another "
        "process): the consumer-GPU rows on a big GPU; megatrain then builds its model on the CPU "
        "when the fp32 model would not fit",
    )
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="LoRA of rank R (alpha 2R, dropout 0) for megatrain and zero3: the base frozen in "
        "bf16, only "
        "the adapters train (benchmarks.build); 0: full fine-tuning",
    )
    p.add_argument(
        "--lora-targets",
        default="default",
        help="with --lora: default (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj), "
        "all-linear "
        "(peft's choice), or a comma-separated list of module names",
    )
    p.add_argument(
        "--init",
        default="auto",
        choices=INIT_CHOICES,
        help="megatrain's model init: hf (the model's own), fast (layer 0 values repeated, built "
        "on the "
        "CPU), auto (fast from 14 B parameters); ZeRO-3 always builds under zero.Init with "
        "transformers' init",
    )
    p.add_argument(
        "--closing-step",
        default="full",
        choices=["full", "tiny"],
        help="megatrain: close the last measured step's breakdown with one more (untimed) training "
        "step "
        "(full) or an 8-token no-grad forward (tiny: long context, where a step takes minutes)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    # at least one sequence: "--seq 524288" alone is one 512K-token step
    if args.tokens_per_step < args.seq:
        args.tokens_per_step = args.seq
    if args.lora < 0:
        p.error("--lora must be >= 0")
    if args.gpus < 1:
        p.error("--gpus must be >= 1")
    if args.nodes < 1 or args.gpus % args.nodes:
        p.error("--nodes M needs --gpus N with N a multiple of M")
    if args.scaling and args.gpus < 2:
        p.error("--scaling compares N GPUs with one: give --gpus N with N >= 2")
    if not 0.0 <= args.gpu_optimizer_fraction <= 1.0:
        p.error("--gpu-optimizer-fraction must be in [0, 1]")
    if args.host_only and args.gpu_optimizer_fraction > 0:
        p.error("--host-only and --gpu-optimizer-fraction > 0 contradict each other")
    if args.liger == "on" and args.device != "cuda":
        p.error("--liger on: liger-kernel runs on CUDA only")
    # the fair rule: one loss kernel for all
    if args.liger == "auto" and is_moe(make_config(args.model)):
        args.liger = "off"
        print(
            "--liger auto -> off for a mixture-of-experts model: megatrain_ds runs its own loss "
            "(full logits + "
            "router aux loss), so every system gets the model's own kernels and loss",
            file=sys.stderr,
        )
    # read by benchmarks.systems / megatrain_system in each child
    os.environ["H2H_CLIP"] = repr(args.clip)
    if args.megatrain_options is not None:
        try:
            options = json.loads(args.megatrain_options)
        except json.JSONDecodeError as exc:
            p.error(f"--megatrain-options is not JSON: {exc}")
        if not isinstance(options, dict):
            p.error("--megatrain-options must be a JSON object")
        os.environ["MEGATRAIN_OPTIONS"] = json.dumps(options)  # read by benchmarks.megatrain_system
    if args.ds_config:
        # (megatrain_ds_config)
        os.environ["MEGATRAIN_DS_CONFIG"] = json.dumps(json.loads(args.ds_config))
    if args.zero3_ds_config:
        # (systems.run_zero3)
        os.environ["ZERO3_DS_CONFIG"] = json.dumps(json.loads(args.zero3_ds_config))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(HOST_BYTES_PER_PARAM)
    if unknown:
        p.error(f"unknown system(s) {sorted(unknown)}; choose from {sorted(HOST_BYTES_PER_PARAM)}")
    if args.lora and set(systems) - set(LORA_HOST_BYTES_PER_PARAM):
        p.error(f"--lora: systems {sorted(LORA_HOST_BYTES_PER_PARAM)} only (got {systems})")
    depths = [int(d) for d in args.depth_sweep.split(",")] if args.depth_sweep else [args.layers]
    return args, systems, depths
