"""``megatrain-ds plan``: predict host RAM, disk and GPU memory before anything is built.

    megatrain-ds plan qwen2.5-7b --tokens-per-step 16384 --seq 1024
    megatrain-ds plan ./my-model --config ds_config.json --seq 4096 --gpus 2 --json

This module owns the command line of the planner (``megatrain-ds plan``, cli.py's subcommand, and
``python -m megatrain_ds.planning.plan_cli``): its arguments, MODEL (a shape name of shapes.py, a
folder or file with config.json, a hub id in the local cache) built on the meta device and the
DeepSpeed config parsed as ``initialize`` parses it (plan.py's ``load_model_config``,
``meta_model``, ``load_train_config``), and ``plan.plan_model``'s prediction printed as a table or
JSON. docs/plan.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from .config import ConfigError
from ..model import UnsupportedModelError
from .plan import GiB, Prediction, load_model_config, load_train_config, meta_model, plan_model
from .plan_gpu import DTYPES


def default_ds_config(micro_batch: int, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="a harness shape (qwen2.5-7b, tiny, olmoe-1b-7b, ...), a folder with "
        "config.json, a config.json path, or a hub id in the local HF cache",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="DeepSpeed config (JSON/HJSON): micro-batch, GA, precision, "
        "offload_optimizer, megatrain block",
    )
    parser.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        help="without --config: tokens per optimizer step over every GPU (default 16384)",
    )
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument(
        "--dtype", default="bf16", choices=sorted(DTYPES), help="without --config (default bf16)"
    )
    parser.add_argument(
        "--gpus", type=int, default=1, help="data-parallel GPUs on this host (default 1)"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="hosts of --gpus GPUs each (default 1): the plan is one host's",
    )
    parser.add_argument(
        "--host-sharding",
        default=None,
        choices=["node", "job"],
        help="which ranks split the host state (default: megatrain.host_sharding, \"node\": a copy "
        "per host; \"job\": 1/nodes of it per host)",
    )
    parser.add_argument("--layers", type=int, default=None, help="override the model's depth")
    parser.add_argument(
        "--nvme-path", default=None, help="the NVMe tier's folder (overrides the config's)"
    )
    parser.add_argument(
        "--host-budget",
        type=float,
        default=None,
        metavar="GiB",
        help="host RAM budget (default: megatrain.host_memory_budget, or MemAvailable - 5%% of "
        "MemTotal; the memory cgroup's room when smaller, either way)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="plan for a GPU with this much memory (default: this machine's GPU)",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="where the engine computes (default cuda, with or without a GPU here)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand: only the plan goes to stdout (what importing DeepSpeed and
    transformers print goes to stderr, so ``--json`` output parses). Exit status 0 when the run
    fits, 1 when it does not."""
    with contextlib.redirect_stdout(sys.stderr):
        pred = _plan_from_args(args)
    print(
        json.dumps(pred.to_dict(), indent=2, default=str) if args.json else pred.table(), flush=True
    )
    return 0 if pred.fits else 1


def _plan_from_args(args: argparse.Namespace) -> Prediction:
    if args.config and args.tokens_per_step is not None:
        raise SystemExit(
            "megatrain-ds plan: give --config or --tokens-per-step, not both (the config holds the "
            "micro-batch)"
        )
    if args.gpus < 1 or args.seq < 1 or args.nodes < 1:
        raise SystemExit("megatrain-ds plan: --gpus, --nodes and --seq must be >= 1")
    ranks = args.gpus * args.nodes
    if args.config:
        try:
            config = load_train_config(args.config, world=ranks)
        except ConfigError as exc:
            raise SystemExit(f"megatrain-ds plan: config {args.config}: {exc}") from None
    else:
        tokens = args.tokens_per_step or 16384
        micro = max(1, tokens // (args.seq * ranks))
        config = load_train_config(default_ds_config(micro, args.dtype), world=ranks)
    hf_config, name = load_model_config(args.model, args.layers)
    model = meta_model(hf_config)
    gpu_memory = int(args.gpu_memory * GiB) if args.gpu_memory else None
    try:
        pred = plan_model(
            model,
            config,
            seq=args.seq,
            device=args.device,
            world=args.gpus,
            nvme_path=args.nvme_path,
            host_budget=args.host_budget,
            gpu_memory=gpu_memory,
            name=name,
            nodes=args.nodes,
            sharding=args.host_sharding,
        )
    except (ConfigError, UnsupportedModelError) as exc:
        raise SystemExit(f"megatrain-ds plan: {exc}") from None
    return pred


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain-ds plan", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
