"""``megatrain-ds plan`` against a harness result already recorded: the plan is made for the
result's own model shape, sequence length and DeepSpeed config (its ``ds_config``), on this machine
(run it on the kind of box the result came from: whether liger-kernel and flash attention apply
changes the GPU prediction), and printed next to the result's measured peaks.

    python -m benchmarks.plan_vs_result benchmarks/results/<dir>/16k_megatrain.json [...]
        [--json OUT]

Compared: the plan's host need with the run's peak RSS and its engine host state with the run's
``engine_host_state_bytes``; its GPU prediction (``torch.cuda.max_memory_allocated`` of a step) with
the run's ``peak_gpu_bytes``. The result may come from an older engine than the plan: say so when
quoting the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile


def compare(path: str) -> dict:
    from megatrain_ds import cli

    with open(path) as f:
        data = json.load(f)
    run = next(
        r for r in data["results"] if r.get("system") == "megatrain" and r.get("status") == "ok"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(run["ds_config"], f)
    try:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cli.main(
                [
                    "plan",
                    run["model"],
                    "--config",
                    f.name,
                    "--seq",
                    str(run["seq"]),
                    "--layers",
                    str(run["layers"]),
                    "--json",
                ]
            )
    finally:
        os.remove(f.name)
    plan = json.loads(buf.getvalue())
    row = {
        "result": path,
        "model": run["model"],
        "tokens_per_step": run["tokens_per_step"],
        "plan_host_need_bytes": plan["host_need_bytes"],
        "measured_peak_host_rss_bytes": run["peak_host_rss_bytes"],
        "plan_host_state_bytes": plan["host_state_bytes"],
        "measured_engine_host_state_bytes": run.get("engine_host_state_bytes"),
        "plan_gpu_allocated_bytes": plan["gpu_allocated_bytes"],
        "measured_peak_gpu_bytes": run["peak_gpu_bytes"],
        "plan_gpu_phase": plan.get("gpu_phase"),
        "plan_gpu_parts": plan.get("gpu_parts"),
    }
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "results", nargs="+", help="harness result JSON files (benchmarks.h2h's per-system output)"
    )
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = [compare(path) for path in args.results]
    gib = 2**30

    def ratio(pred, meas):
        return "-" if not pred or not meas else f"{(pred - meas) / meas * 100:+.1f}%"

    print(
        f"{'result':<28}{'tokens':>8}{'host plan':>11}{'host RSS':>10}{'':>8}{'state plan':>11}"
        f"{'state':>9}{'':>8}"
        f"{'GPU plan':>10}{'GPU peak':>10}{'':>8}"
    )
    for r in rows:
        name = os.path.basename(r["result"])[:27]
        hs = r["measured_engine_host_state_bytes"]
        print(
            f"{name:<28}{r['tokens_per_step']:>8}{r['plan_host_need_bytes'] / gib:>11.2f}"
            f"{r['measured_peak_host_rss_bytes'] / gib:>10.2f}"
            f"{ratio(r['plan_host_need_bytes'], r['measured_peak_host_rss_bytes']):>8}"
            f"{r['plan_host_state_bytes'] / gib:>11.2f}{(hs or 0) / gib:>9.2f}"
            f"{ratio(r['plan_host_state_bytes'], hs):>8}"
            f"{(r['plan_gpu_allocated_bytes'] or 0) / gib:>10.2f}"
            f"{r['measured_peak_gpu_bytes'] / gib:>10.2f}"
            f"{ratio(r['plan_gpu_allocated_bytes'], r['measured_peak_gpu_bytes']):>8}"
        )
    print("(GiB; ratio = (plan - measured) / measured)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
