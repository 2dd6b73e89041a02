"""What the recompute check (megatrain_ds/model/recompute_check.py) costs per step, on its own: the
device work of ``RecomputeCheck.compare`` for every layer of a model shape at a batch, plus the one
``read`` at the step, timed with CUDA events (median of repeats), against the step time the caller
gives.

    python -m benchmarks.recompute_check_cost --model qwen2.5-3b --tokens 16384 [--step-s 1.3]
        [--repeats 20]

Prints one line per shape: layers, bytes read per compare, ms per step for the compares and for the
read, and the share of the given step time. The full-step measurement (check on vs off, same box) is
benchmarks/run_3b.sh check.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.shapes import SHAPES
from megatrain_ds.streaming.layer_call import LayerCall
from megatrain_ds.model.recompute_check import RecomputeCheck, _CallCheck


def time_check(
    layers: int, tokens: int, hidden: int, dtype=torch.bfloat16, repeats: int = 20
) -> tuple[float, float]:
    """(ms of the compares of one step, ms of the read), medians."""
    device = torch.device("cuda")
    out = torch.randn(tokens, hidden, device=device, dtype=dtype)
    ref = out.clone()
    check = RecomputeCheck(True, "auto", dtype, "bench", input_from_next=False)
    compare_ms, read_ms = [], []
    for _ in range(repeats + 2):
        calls = []
        for i in range(layers):
            call = LayerCall(i, (), {})
            call.check = _CallCheck({})
            call.check.expect = [ref]
            calls.append(call)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            check.compare(call, [out])
        end.record()
        end.synchronize()
        t0 = time.perf_counter()
        check.read()
        read_ms.append((time.perf_counter() - t0) * 1e3)
        compare_ms.append(start.elapsed_time(end))
    return statistics.median(compare_ms[2:]), statistics.median(read_ms[2:])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen2.5-3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument(
        "--step-s", type=float, default=None, help="the measured step time, for the share"
    )
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    # (hidden, layers, intermediate, heads, kv heads, vocab, tied)
    hidden, layers = SHAPES[args.model][:2]
    compare, read = time_check(layers, args.tokens, hidden, repeats=args.repeats)
    share = (
        f", {100 * (compare + read) / 1e3 / args.step_s:.2f}% of a {args.step_s:.3f} s step"
        if args.step_s
        else ""
    )
    print(
        f"[recompute check] {args.model} L={layers} tokens={args.tokens} "
        f"({torch.cuda.get_device_name()}): "
        f"compares {compare:.2f} ms/step ({layers} x {3 * args.tokens * hidden * 2 / 2**20:.0f} "
        "MiB read), "
        f"read {read:.2f} ms{share}",
        flush=True,
    )


if __name__ == "__main__":
    main()
