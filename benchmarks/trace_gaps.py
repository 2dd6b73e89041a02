"""Where does the GPU idle? Profile a few megatrain_ds steps and list the compute stream's gaps.

    python -m benchmarks.trace_gaps --model qwen2.5-3b --tokens-per-step 16384 --steps 2 \
        --megatrain-options '{"gpu_optimizer_layers": 0}' --out runs/trace

Trains ``warmup`` steps unprofiled, then ``steps`` under ``torch.profiler`` (CPU + CUDA activities).
The kernels of the stream that runs the most kernel time (the compute stream) are sorted by start;
every gap between two of them longer than ``--min-gap-ms`` is printed with the megatrain_ds ranges
(``megatrain.*``: waits, H2D/D2H, landings, AdamW, norm; executor.py and optimizer.py name them)
that overlap it on the host, so a stall shows what the GPU was waiting for. Writes the Chrome trace
(``trace.json``) and the table (``gaps.md``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def compute_gaps(events: list[dict], min_gap_us: float) -> tuple[list[dict], dict]:
    """``events``: Chrome-trace events (``ph: X``, ``ts``/``dur`` in µs, ``cat``, ``name``,
    ``tid``). Returns the gaps of the busiest kernel stream (start, duration, overlapping megatrain
    ranges) and totals."""
    kernels = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    busy = defaultdict(float)
    for e in kernels:
        if e.get("cat") == "kernel":
            busy[e["tid"]] += e["dur"]
    if not busy:
        return [], {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0}
    stream = max(busy, key=busy.get)
    mine = sorted(
        (e for e in kernels if e["tid"] == stream and e.get("cat") == "kernel"),
        key=lambda e: e["ts"],
    )
    ranges = [
        e
        for e in events
        if e.get("ph") == "X"
        and str(e.get("name", "")).startswith("megatrain.")
        and e.get("cat") in ("user_annotation", "cpu_op", "python_function", None)
    ]
    gaps, end = [], mine[0]["ts"] + mine[0]["dur"]
    for e in mine[1:]:
        if e["ts"] - end >= min_gap_us:
            a, b = end, e["ts"]
            over = sorted({r["name"] for r in ranges if r["ts"] < b and r["ts"] + r["dur"] > a})
            gaps.append(
                {
                    "start_us": a - mine[0]["ts"],
                    "dur_us": b - a,
                    "next_kernel": e["name"][:60],
                    "host_ranges": over,
                }
            )
        end = max(end, e["ts"] + e["dur"])
    window = end - mine[0]["ts"]
    totals = {
        "window_us": window,
        "busy_us": busy[stream],
        "idle_us": window - busy[stream],
        "t0_us": mine[0]["ts"],
        "gaps_listed_us": sum(g["dur_us"] for g in gaps),
    }
    return gaps, totals


def gaps_table(gaps: list[dict], totals: dict, limit: int = 40) -> str:
    lines = [
        f"compute stream: window {totals['window_us'] / 1e3:.1f} ms, kernels "
        f"{totals['busy_us'] / 1e3:.1f} ms, "
        f"idle {totals['idle_us'] / 1e3:.1f} ms ({totals['gaps_listed_us'] / 1e3:.1f} ms in the "
        "gaps below)",
        "",
        "| at (ms) | gap (ms) | next kernel | megatrain ranges on the host meanwhile |",
        "|---|---|---|---|",
    ]
    for g in sorted(gaps, key=lambda g: -g["dur_us"])[:limit]:
        names = ", ".join(_compress(g["host_ranges"]))
        lines.append(
            f"| {g['start_us'] / 1e3:.1f} | {g['dur_us'] / 1e3:.2f} | {g['next_kernel']} | {names} "
            "|"
        )
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
        out.append(
            phase if not nums else f"{phase}.L{nums[0]}" + (f"-{nums[-1]}" if len(nums) > 1 else "")
        )
    return out


def write_ranges(events: list[dict], gaps: list[dict], t0: float, path: str) -> None:
    """The host timeline: each megatrain.* range (by thread) and each compute-stream gap, times from
    the first kernel of the compute stream (``t0``, µs), sorted by start."""
    rows = [
        ((e["ts"] - t0) / 1e3, e["dur"] / 1e3, str(e.get("tid")), e["name"])
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("megatrain.")
    ]
    rows += [
        ((e["ts"] - t0) / 1e3, e["dur"] / 1e3, f"copy-{e.get('tid')}", e["name"][:40])
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy" and e.get("dur", 0) >= 200
    ]
    rows += [(g["start_us"] / 1e3, g["dur_us"] / 1e3, "gpu-gap", g["next_kernel"]) for g in gaps]
    with open(path, "w") as f:
        f.write("start_ms,dur_ms,thread,name\n")
        for start, dur, tid, name in sorted(rows):
            f.write(f"{start:.3f},{dur:.3f},{tid},{name.replace(',', ';')}\n")


def timeline_gaps(rows: list[tuple], min_gap_s: float) -> list[dict]:
    """``rows``: (start_s, end_s, thread, name). The gaps between the device's compute spans
    (``gpu-compute``) of at least ``min_gap_s``, each with the ranges every other thread had open
    during it."""
    compute = sorted((a, b) for a, b, t, _ in rows if t == "gpu-compute")
    gaps, end = [], compute[0][1] if compute else 0.0
    for a, b in compute[1:]:
        if a - end >= min_gap_s:
            over: dict[str, list[str]] = defaultdict(list)
            for s, e, t, name in rows:
                if s < a and e > end and not t.startswith("gpu-"):
                    over[t].append(name.removeprefix("megatrain."))
            gaps.append(
                {
                    "start_s": end,
                    "dur_s": a - end,
                    "threads": {
                        t: ", ".join(_compress(["megatrain." + n for n in names]))
                        for t, names in sorted(over.items())
                    },
                }
            )
        end = max(end, b)
    return gaps


def _command_line(argv: list[str], args) -> str:
    """The command's arguments as recorded with its results: the output and trace paths (this
    machine's) as OUT and TRACE."""
    places = {args.out: "OUT", **({args.trace: "TRACE"} if args.trace else {})}
    return " ".join(places.get(a, a) for a in argv)


def _timeline_run(engine, step, batches, args) -> int:
    from megatrain_ds.streaming.timing import start_timeline, take_timeline

    start_timeline()
    t0 = __import__("time").perf_counter()
    # the last one closes the device spans of the one before (StepTimer)
    for ids in batches[: args.steps + 1]:
        step(ids)
    rows = [(a - t0, b - t0, t, n) for a, b, t, n in take_timeline()]
    last = max((b for a, b, t, _ in rows if t == "gpu-compute"), default=0.0)
    rows = [r for r in rows if r[0] <= last]  # the closing step's host ranges have no device spans
    with open(os.path.join(args.out, "timeline.csv"), "w") as f:
        f.write("start_ms,dur_ms,thread,name\n")
        for a, b, t, n in sorted(rows):
            f.write(f"{a * 1e3:.3f},{(b - a) * 1e3:.3f},{t},{n}\n")
    gaps = timeline_gaps(rows, args.min_gap_ms / 1e3)
    busy = sum(b - a for a, b, t, _ in rows if t == "gpu-compute")
    lines = [
        f"timeline: {args.steps} steps, {last * 1e3:.0f} ms to the last kernel span, compute "
        f"{busy * 1e3:.0f} ms, "
        f"gaps >= {args.min_gap_ms} ms: {sum(g['dur_s'] for g in gaps) * 1e3:.0f} ms",
        "",
        "| at (ms) | gap (ms) | what each host thread was doing |",
        "|---|---|---|",
    ]
    for g in gaps:
        what = "; ".join(f"{t}: {n}" for t, n in g["threads"].items())
        lines.append(f"| {g['start_s'] * 1e3:.1f} | {g['dur_s'] * 1e3:.2f} | {what} |")
    breakdown = engine.timer.format(engine.last_step_breakdown())
    text = f"last step: {breakdown}\n\n" + "\n".join(lines)
    with open(os.path.join(args.out, "gaps.md"), "w") as f:
        f.write(f"{_command_line(sys.argv[1:], args)}\n\n{text}\n")
    print(text)
    engine.destroy()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--megatrain-options", default="{}")
    p.add_argument("--min-gap-ms", type=float, default=1.0)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--trace", default=None, help="where the Chrome trace goes (default OUT/trace.json; large)"
    )
    p.add_argument(
        "--ranges",
        action="store_true",
        help="also write OUT/ranges.csv: every megatrain.* host range and compute-stream gap "
        "(start_ms, "
        "dur_ms, thread, name), a timeline small enough to bring back from a device",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="no torch.profiler: record megatrain_ds's own timeline (every thread's ranges, the "
        "host "
        "optimizer's included, and the device spans on the host clock) to OUT/timeline.csv, and "
        "list "
        "the compute stream's gaps with what each thread was doing; much less overhead",
    )
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
    ds_config = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_clipping": args.clip,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "wall_clock_breakdown": True,
        "megatrain": json.loads(args.megatrain_options),
    }
    engine, *_ = megatrain_ds.initialize(model=model, config=ds_config)
    batches = make_batches(config.vocab_size, mb, args.seq, args.warmup + args.steps + 1, 0)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    for ids in batches[: args.warmup]:
        step(ids)
    if args.timeline:
        return _timeline_run(engine, step, batches[args.warmup :], args)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for ids in batches[args.warmup : args.warmup + args.steps]:
            step(ids)
        torch.cuda.synchronize()
    step(batches[-1])  # closes the breakdown of the last profiled step
    path = args.trace or os.path.join(args.out, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gaps, totals = compute_gaps(events, args.min_gap_ms * 1e3)
    table = gaps_table(gaps, totals)
    if args.ranges:
        write_ranges(events, gaps, totals.get("t0_us", 0.0), os.path.join(args.out, "ranges.csv"))
    breakdown = engine.timer.format(engine.last_step_breakdown())
    with open(os.path.join(args.out, "gaps.md"), "w") as f:
        f.write(
            f"{_command_line(sys.argv[1:] if argv is None else argv, args)}\n\nlast step: "
            f"{breakdown}\n\n{table}\n"
        )
    print(f"last step: {breakdown}\n{table}")
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
