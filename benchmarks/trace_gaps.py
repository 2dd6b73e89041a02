"""Where does the GPU idle? Profile a few megatrain_ds steps and list the compute stream's gaps.

    python -m benchmarks.trace_gaps --model qwen2.5-3b --tokens-per-step 16384 --steps 2 \
        --megatrain-options '{"gpu_optimizer_layers": 0}' --out runs/trace

Trains ``warmup`` steps unprofiled, then ``steps`` under ``torch.profiler`` (CPU + CUDA activities). The kernels of
the stream that runs the most kernel time (the compute stream) are sorted by start; every gap between two of
them longer than ``--min-gap-ms`` is printed with the megatrain_ds ranges (``megatrain.*``: waits, H2D/D2H,
landings, AdamW, norm; executor.py and optimizer.py name them) that overlap it on the host, so a stall shows
what the GPU was waiting for. Writes the Chrome trace (``trace.json``) and the table (``gaps.md``) to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def compute_gaps(events: list[dict], min_gap_us: float) -> tuple[list[dict], dict]:
    """``events``: Chrome-trace events (``ph: X``, ``ts``/``dur`` in µs, ``cat``, ``name``, ``tid``). Returns the
    gaps of the busiest kernel stream (start, duration, overlapping megatrain ranges) and totals."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy = defaultdict(float)
    for e in kernels:
        if e.get("cat") == "kernel":
            busy[e["tid"]] += e["dur"]
    if not busy:
        return [], {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0}
    stream = max(busy, key=busy.get)
    mine = sorted((e for e in kernels if e["tid"] == stream and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    ranges = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("megatrain.")
              and e.get("cat") in ("user_annotation", "cpu_op", "python_function", None)]
    gaps, end = [], mine[0]["ts"] + mine[0]["dur"]
    for e in mine[1:]:
        if e["ts"] - end >= min_gap_us:
            a, b = end, e["ts"]
            over = sorted({r["name"] for r in ranges if r["ts"] < b and r["ts"] + r["dur"] > a})
            gaps.append({"start_us": a - mine[0]["ts"], "dur_us": b - a, "next_kernel": e["name"][:60],
                         "host_ranges": over})
        end = max(end, e["ts"] + e["dur"])
    window = end - mine[0]["ts"]
    totals = {"window_us": window, "busy_us": busy[stream], "idle_us": window - busy[stream],
              "gaps_listed_us": sum(g["dur_us"] for g in gaps)}
    return gaps, totals


def gaps_table(gaps: list[dict], totals: dict, limit: int = 40) -> str:
    lines = [f"compute stream: window {totals['window_us'] / 1e3:.1f} ms, kernels {totals['busy_us'] / 1e3:.1f} ms, "
             f"idle {totals['idle_us'] / 1e3:.1f} ms ({totals['gaps_listed_us'] / 1e3:.1f} ms in the gaps below)",
             "", "| at (ms) | gap (ms) | next kernel | megatrain ranges on the host meanwhile |", "|---|---|---|---|"]
    for g in sorted(gaps, key=lambda g: -g["dur_us"])[:limit]:
        names = ", ".join(_compress(g["host_ranges"]))
        lines.append(f"| {g['start_us'] / 1e3:.1f} | {g['dur_us'] / 1e3:.2f} | {g['next_kernel']} | {names} |")
    return "\n".join(lines)


def _compress(names: list[str]) -> list[str]:
    """megatrain.adamw.L3, megatrain.adamw.L4 -> adamw.L3-4 (per phase, layer ranges)."""
    by_phase: dict[str, list] = defaultdict(list)
    for n in names:
        head, _, layer = n.removeprefix("megatrain.").rpartition(".L")
        if head and layer.isdigit():
            by_phase[head].append(int(layer))
        else:
            by_phase[n.removeprefix("megatrain.")].append(None)
    out = []
    for phase, layers in by_phase.items():
        nums = sorted(x for x in layers if x is not None)
        out.append(phase if not nums else f"{phase}.L{nums[0]}" + (f"-{nums[-1]}" if len(nums) > 1 else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--megatrain-options", default="{}")
    p.add_argument("--min-gap-ms", type=float, default=1.0)
    p.add_argument("--out", required=True)
    p.add_argument("--trace", default=None, help="where the Chrome trace goes (default OUT/trace.json; large)")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    import megatrain_ds
    from benchmarks.common import make_batches, micro_batch_for
    from benchmarks.shapes import make_config

    os.makedirs(args.out, exist_ok=True)
    config = make_config(args.model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config).float()
    mb = micro_batch_for(args.tokens_per_step, args.seq)
    ds_config = {"train_micro_batch_size_per_gpu": mb, "gradient_clipping": args.clip, "bf16": {"enabled": True},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
                 "wall_clock_breakdown": True, "megatrain": json.loads(args.megatrain_options)}
    engine, *_ = megatrain_ds.initialize(model=model, config=ds_config)
    batches = make_batches(config.vocab_size, mb, args.seq, args.warmup + args.steps + 1, 0)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    for ids in batches[:args.warmup]:
        step(ids)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for ids in batches[args.warmup:args.warmup + args.steps]:
            step(ids)
        torch.cuda.synchronize()
    step(batches[-1])  # closes the breakdown of the last profiled step
    path = args.trace or os.path.join(args.out, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gaps, totals = compute_gaps(events, args.min_gap_ms * 1e3)
    table = gaps_table(gaps, totals)
    breakdown = engine.timer.format(engine.last_step_breakdown())
    with open(os.path.join(args.out, "gaps.md"), "w") as f:
        f.write(f"{' '.join(sys.argv[1:] if argv is None else argv)}\n\nlast step: {breakdown}\n\n{table}\n")
    print(f"last step: {breakdown}\n{table}")
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
