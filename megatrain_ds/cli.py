"""``megatrain-ds``: command-line tools that need no GPU.

    megatrain-ds convert CHECKPOINT_DIR OUT_DIR [--tag TAG] [--dtype fp32|bf16|fp16]
                         [--max-shard-size 5GB]
    megatrain-ds bench [benchmarks.h2h options]      (from the repository root)
    megatrain-ds plan MODEL [--config ds_config.json | --tokens-per-step N --seq S] [--gpus N]
                      [--nvme-path P] [--host-budget GiB] [--gpu-memory GiB] [--json]

``convert`` turns a megatrain_ds checkpoint (``save_checkpoint``'s layout; ``latest`` picks the tag)
into a Hugging Face model folder: ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
shards and ``model.safetensors.index.json``) and ``config.json``, loadable with ``from_pretrained``.

``plan`` predicts, before anything is built, the host RAM, disk and GPU bytes a run takes and the
largest micro-batch that fits this machine (plan.py, docs/plan.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .checkpoints import MODEL_FILE, fp32_state_dict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * factor)
    return int(text)


def _resolve(checkpoint_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                tag = f.read().strip()
    path = os.path.join(checkpoint_dir, tag) if tag else checkpoint_dir
    if not os.path.isfile(os.path.join(path, MODEL_FILE)):
        raise SystemExit(
            f"megatrain-ds convert: no {MODEL_FILE} under {path} (give --tag, or a folder with "
            "'latest')"
        )
    return path


def convert(
    checkpoint_dir: str,
    out_dir: str,
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
) -> list[str]:
    from safetensors.torch import save_file

    path = _resolve(checkpoint_dir, tag)
    states = torch.load(os.path.join(path, MODEL_FILE), map_location="cpu", weights_only=False)
    if not states.get("hf_config"):
        raise SystemExit(
            "megatrain-ds convert: the checkpoint has no Hugging Face config (the model was not a "
            "transformers model); DeepSpeed's zero_to_fp32 still reads its weights"
        )
    os.makedirs(out_dir, exist_ok=True)
    # whatever number of ranks saved it: each parameter joined from its partitions
    # (checkpoint.fp32_state_dict); tied names left out (safetensors refuses shared tensors;
    # transformers re-ties them from the config)
    weights = fp32_state_dict(path, tied=False)
    tensors = {
        k: v.to(DTYPES[dtype]).contiguous() if v.is_floating_point() else v.contiguous()
        for k, v in weights.items()
    }
    limit, shards, current, size = _size(max_shard_size), [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    for fname, shard in zip(files, shards):
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {name: fname for fname, shard in zip(files, shards) for name in shard},
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    config = dict(states["hf_config"])
    config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return files


def _bench(argv: list[str]) -> int:
    """``megatrain-ds bench``: the head-to-head harness, benchmarks/h2h.py. The harness is not part
    of the installed package (the one place the package imports ``benchmarks``, lazily): it is found
    only when the current folder is the megatrain_ds repository root (or the root is on
    PYTHONPATH)."""
    try:
        from benchmarks.h2h import main as h2h_main
    except ModuleNotFoundError as exc:
        # the harness is there; something it imports is not
        if exc.name not in ("benchmarks", "benchmarks.h2h"):
            raise SystemExit(
                f"megatrain-ds bench: the harness (benchmarks/h2h.py) needs {exc.name!r}, which is "
                "not "
                f"installed ({exc}); `pip install -e .[bench,test]` installs its extras"
            ) from None
        raise SystemExit(
            f"megatrain-ds bench: the benchmark harness (the benchmarks/ folder) is not importable "
            "from "
            f"{os.getcwd()}: it ships with the megatrain_ds repository, not with the installed "
            "package. "
            f"Run `megatrain-ds bench ...` (or `python -m benchmarks.h2h ...`) from the repository "
            "root, "
            f"or put the root on PYTHONPATH. `megatrain-ds plan` and `convert` work anywhere."
        ) from None
    return h2h_main(argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatrain-ds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser(
        "convert", help="checkpoint -> Hugging Face safetensors folder (no GPU needed)"
    )
    conv.add_argument("checkpoint_dir")
    conv.add_argument("out_dir")
    conv.add_argument(
        "--tag", default=None, help="checkpoint tag (default: the one named in 'latest')"
    )
    conv.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    conv.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
    sub.add_parser(
        "bench",
        help="the head-to-head harness (python -m benchmarks.h2h), run from the repo root",
        add_help=False,
    )
    from .planning import add_plan_arguments

    add_plan_arguments(
        sub.add_parser(
            "plan",
            help="predict host RAM, disk and GPU memory before anything is built (no GPU needed)",
        )
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "plan":
        from .planning import run_plan

        return run_plan(args)
    files = convert(args.checkpoint_dir, args.out_dir, args.tag, args.dtype, args.max_shard_size)
    print(f"wrote {len(files)} safetensors file(s) and config.json to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
