"""``megatrain-ds plan`` for the config a harness run uses
(benchmarks.megatrain_system.megatrain_ds_config with the same megatrain options), written as JSON
next to that run's result so the two can be compared:

    python -m benchmarks.plan_check --model qwen2.5-3b --seq 524288 --tokens-per-step 524288 \
        --megatrain-options '{"offload_activations": false, "tiled_mlp": "auto"}' --out plan.json

Prints the plan's table. Compare ``host_need_bytes`` with the run's ``peak_host_rss_bytes`` and
``gpu_allocated_bytes`` with its ``peak_gpu_bytes`` (the run's first-step peak when no "auto"
placement moves more onto the GPU: ``keep_activations``/``gpu_optimizer_layers`` 0, or one step).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.common import micro_batch_for


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--megatrain-options", default="{}")
    p.add_argument("--ds-config", default="{}")
    p.add_argument("--liger", default="on", choices=["on", "off"])
    p.add_argument("--host-only", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.environ["MEGATRAIN_OPTIONS"] = args.megatrain_options
    os.environ["MEGATRAIN_DS_CONFIG"] = args.ds_config
    from benchmarks.megatrain_system import megatrain_ds_config
    from megatrain_ds import cli

    cfg = megatrain_ds_config(
        micro_batch_for(max(args.tokens_per_step, args.seq), args.seq),
        "cuda",
        liger=args.liger == "on",
        host_only=args.host_only,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        cli.main(["plan", args.model, "--config", f.name, "--seq", str(args.seq)])
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cli.main(["plan", args.model, "--config", f.name, "--seq", str(args.seq), "--json"])
        with open(args.out, "w") as out:
            out.write(buf.getvalue())
    finally:
        os.remove(f.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
