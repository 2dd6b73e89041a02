"""save_checkpoint timed on the same model under real DeepSpeed ZeRO-3 offload and under
megatrain_ds (issue 38: a save no slower than DeepSpeed's), each system in a process of its own, on
whatever machine this runs (CPU: gloo).

    # Qwen2 shape, hidden 1024, 8 layers: 1.5 GB saved
    python -m benchmarks.save_bench
    python -m benchmarks.save_bench --hidden 2048 --layers 8 --repeat 3 --dir /some/disk

Each system builds the model (random init, seed 0), takes one training step (so the optimizer state
exists), then saves ``--repeat`` times into ``--dir`` (a new tag each time, the previous one
removed), timing each ``save_checkpoint`` call. Prints per system the median seconds, the bytes on
disk, GB/s, and megatrain_ds's own breakdown line (device→host, producing, write, hash wait, fsync).
DeepSpeed writes with torch.save and returns without fsync; megatrain_ds fsyncs every file and
writes SHA-256 checksums (docs/checkpoints). Both ZeRO-3 layouts are DeepSpeed's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
}


def _folder_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def one(system: str, hidden: int, layers: int, repeat: int, folder: str) -> dict:
    """One system's saves, in this process."""
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(20000 + random.randrange(20000)),
    )
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if system == "deepspeed":
        import deepspeed
    else:
        import megatrain_ds as deepspeed
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
        )
    )
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    times, size = [], 0
    for k in range(repeat):
        tag = f"save{k}"
        start = time.perf_counter()
        engine.save_checkpoint(folder, tag=tag)
        times.append(time.perf_counter() - start)
        size = _folder_bytes(os.path.join(folder, tag))
        shutil.rmtree(os.path.join(folder, tag))
    return {"system": system, "seconds": times, "median_s": statistics.median(times), "bytes": size}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--dir",
        default=None,
        help="where the checkpoints are written (default: a temporary folder)",
    )
    # a child process
    p.add_argument("--system", choices=("deepspeed", "megatrain"), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.system:
        with open(args.json, "w") as f:
            json.dump(one(args.system, args.hidden, args.layers, args.repeat, args.dir), f)
        return
    root = tempfile.mkdtemp(prefix="save_bench_", dir=args.dir)
    try:
        results = []
        for system in ("deepspeed", "megatrain"):
            out = os.path.join(root, f"{system}.json")
            env = dict(
                os.environ,
                CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                PYTHONPATH=os.pathsep.join(
                    x for x in (REPO, os.environ.get("PYTHONPATH", "")) if x
                ),
            )
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.save_bench",
                    "--system",
                    system,
                    "--json",
                    out,
                    "--hidden",
                    str(args.hidden),
                    "--layers",
                    str(args.layers),
                    "--repeat",
                    str(args.repeat),
                    "--dir",
                    os.path.join(root, system),
                ],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise SystemExit(f"{system} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            results.append(json.load(open(out)))
            results[-1]["breakdown"] = [
                line for line in proc.stdout.splitlines() if "save_checkpoint save" in line
            ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"Qwen2 shape, hidden {args.hidden}, {args.layers} layers; save_checkpoint, median of "
        f"{args.repeat}"
    )
    print("| system | median s | all s | on disk | GB/s |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['system']} | {r['median_s']:.2f} | {', '.join(f'{t:.2f}' for t in r['seconds'])}"
            " | "
            f"{r['bytes'] / 1e9:.2f} GB | {r['bytes'] / 1e9 / r['median_s']:.2f} |"
        )
    ds, mt = results[0]["median_s"], results[1]["median_s"]
    print(f"megatrain_ds / DeepSpeed save time: {mt / ds:.2f}")
    for line in results[1]["breakdown"]:
        print("  ", line)


if __name__ == "__main__":
    main()
