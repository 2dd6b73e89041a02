"""Markdown tables from a folder of ``benchmarks.run_system`` result JSONs.

    python -m benchmarks.report benchmarks/results/2026-11-22_h200_qwen2.5-3b
    python -m benchmarks.report DIR --depth-plot depth.png --tokens 16384   # also TFLOPS vs layers

Rows are grouped by tokens per step and depth; each row's ratios are against the ``zero3`` and
``resident`` rows of the same tokens per step and number of layers. A folder with data-parallel runs
(h2h ``--gpus N``) gets benchmarks.multi_gpu's tables instead: grouped by GPUs too, tokens/s summed
over ranks, TFLOPS per GPU, host memory summed over the ranks, and megatrain's N-GPU / 1-GPU
scaling. Units: tokens/s, TFLOPS (ANCHORS formula), GB = 1e9 bytes. Below the tables, one line per
run with its recorded settings (kernels, loss, precision, optimizer, clip, steps, checkpointing,
optimizer offload, megatrain options).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from benchmarks import multi_gpu


def load(folder: str) -> list[dict]:
    """Every run in ``folder``: run_system JSONs (one run each) and h2h ``results.json`` files (a
    list of runs, possibly renamed, e.g. ``16k_zero3.json``); a run is named after its file, or
    after its h2h tag."""
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        # a config; one rank's part
        if path.endswith(".ds_config.json") or re.search(r"\.rank\d+\.json$", path):
            continue
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        stem = os.path.splitext(os.path.basename(path))[0]
        if isinstance(data.get("results"), list):  # an h2h results file
            for row in data["results"]:
                row.setdefault("name", stem)
                row.setdefault("tokens_per_step", 0)
                row["file"] = stem
                rows.append(row)
            continue
        data["name"] = data["file"] = stem
        rows.append(data)
    # the same run name from two files (e.g. one configuration with and without a knob): name them
    # by file too
    names = [r["name"] for r in rows]
    for row in rows:
        if names.count(row["name"]) > 1:
            row["name"] = f"{row['file']}: {row['name']}"
    return rows


def _ratio(row: dict, peer: dict | None) -> str:
    if not peer or not peer.get("tokens_per_s") or row.get("status") != "ok":
        return "–"
    return f"{row['tokens_per_s'] / peer['tokens_per_s']:.2f}×"


def throughput_table(rows: list[dict]) -> str:
    """One row per run, grouped by (tokens/step, layers); ratios against that group's zero3/resident
    row."""
    out = [
        "| run | layers | tokens/step | s/step | tokens/s | TFLOPS | vs ZeRO-3 | vs whole-on-GPU | "
        "peak GPU GB "
        "| peak host RSS GB | host B/param |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = sorted({(r["tokens_per_step"], r.get("layers") or 0) for r in rows})
    for tokens, layers in groups:
        group = [
            r for r in rows if (r["tokens_per_step"], r.get("layers") or 0) == (tokens, layers)
        ]
        zero3 = next((r for r in group if r["system"] == "zero3" and r.get("status") == "ok"), None)
        resident = next(
            (r for r in group if r["system"] == "resident" and r.get("status") == "ok"), None
        )
        for r in sorted(group, key=lambda r: -(r.get("tokens_per_s") or 0)):
            if r.get("status") != "ok":
                out.append(
                    f"| {r['name']} | {layers} | {tokens} | {r.get('status')} | | | | | | | |"
                )
                continue
            out.append(
                f"| {r['name']} | {layers} | {tokens} | {r['median_step_s']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | "
                f"{r['tflops']:.1f} | {_ratio(r, zero3)} | {_ratio(r, resident)} | "
                f"{r['peak_gpu_bytes'] / 1e9:.1f} | {r['peak_host_rss_bytes'] / 1e9:.1f} | "
                f"{r['host_bytes_per_param']:.1f} |"
            )
    return "\n".join(out)


# the breakdown's columns (megatrain_ds's StepTimer keys), in both the table and h2h's line
BREAKDOWN_KEYS = (
    "step_s",
    "compute_s",
    "h2d_s",
    "d2h_s",
    "cpu_optimizer_s",
    "wait_for_optimizer_s",
    "gpu_idle_s",
)


def breakdown_table(rows: list[dict]) -> str:
    keys = BREAKDOWN_KEYS
    out = [
        "| run | " + " | ".join(k.replace("_s", " (s)") for k in keys) + " | GPU idle % |",
        "|---|" + "---|" * (len(keys) + 1),
    ]
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        cells = " | ".join(f"{b[k]:.3f}" if b.get(k) is not None else "n/a" for k in keys)
        idle = (
            f"{100 * b['gpu_idle_s'] / b['step_s']:.0f}%"
            if b.get("gpu_idle_s") is not None
            else "n/a (CPU)"
        )
        out.append(f"| {r['name']} | {cells} | {idle} |")
    return "\n".join(out)


def count(n) -> str:
    """A parameter count, short: 72.71 B, 210.5 M, 5,120."""
    if not isinstance(n, (int, float)):
        return "–"
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{int(n):,}"


def memory_table(rows: list[dict]) -> str:
    """Parameters and host memory per run (LoRA: per parameter of the frozen base), with each run's
    build and initialize times and, for a process killed before it wrote its result, the peak RSS
    the driver saw."""
    out = [
        "| run | status | trainable | base params | peak host RSS GB | host B/base param | engine "
        "host state GB "
        "| engine B/base param | build s | initialize s | last phase |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "–"

    for r in rows:
        s = r.get("settings") or {}
        state = r.get("engine_host_state_bytes")
        phases = r.get("phases") or []
        last = r.get("last_phase") or (phases[-1]["phase"] if phases else "–")
        out.append(
            f"| {r.get('name', r.get('system'))} | {r.get('status')} | "
            f"{count(r.get('trainable_params'))} | {count(r.get('base_params'))} | "
            f"{num((r.get('peak_host_rss_bytes') or 0) / 1e9, '.1f')} | "
            f"{num(r.get('host_bytes_per_base_param'), '.2f')} | "
            f"{num(state / 1e9 if state else None, '.1f')} | "
            f"{num(r.get('engine_host_bytes_per_base_param'), '.2f')} | "
            f"{num(s.get('build_s'), '.1f')} | {num(s.get('initialize_s'), '.1f')} | {last} |"
        )
    return "\n".join(out)


def settings_line(row: dict) -> str:
    """One compact line of a run's recorded "settings" ("no settings recorded" for older result
    files)."""
    s = row.get("settings")
    name = f"{row.get('name', row.get('system'))} ({row.get('system')})"
    if not s:
        return f"- {name}: no settings recorded"
    kernels = (
        ("liger " + "+".join(k for k in s["kernels"] if k != "fused_linear_cross_entropy"))
        if s.get("kernels")
        else "model's own"
    )
    betas = ", ".join(f"{b:g}" for b in s["betas"])
    parts = [
        s["precision"],
        f"{s['optimizer']} lr {s['lr']:g} wd {s['weight_decay']:g} betas ({betas}) eps "
        f"{s['eps']:g}",
        f"clip {s['clip']:g}",
        f"warmup {s['warmup']} + {s['steps']} steps",
        f"{s['micro_batch']} × {s['seq']} tokens",
        f"kernels: {kernels}",
        f"loss: {s['loss_kernel']}",
        f"checkpointing: {s['gradient_checkpointing']}",
    ]
    if s.get("lora"):
        lora = s["lora"]
        targets = lora["targets"] if isinstance(lora["targets"], str) else ",".join(lora["targets"])
        parts.append(
            f"LoRA r {lora['r']} alpha {lora['alpha']} dropout {lora['dropout']:g} on {targets} "
            f"(adapters {lora.get('adapter_dtype')})"
        )
    if s.get("init"):
        parts.append(f"init: {s['init']}")
    ratio = s.get("offload_optimizer_ratio")
    if ratio is None:
        parts.append("optimizer state on the GPU")
    else:
        where = f"offload_optimizer.ratio {ratio:g}"
        if s.get("gpu_optimizer_share") is not None:
            where += f" (GPU share {s['gpu_optimizer_share']:.2f})"
        parts.append(where)
    if row.get("system") == "megatrain":
        layers = f"gpu_optimizer_layers {s.get('gpu_optimizer_layers')}"
        if "gpu_optimizer_layers_used" in s:
            layers += f" (used {s['gpu_optimizer_layers_used']})"
        parts.append(layers)
        if s.get("megatrain_options"):
            parts.append("options " + json.dumps(s["megatrain_options"], sort_keys=True))
    if s.get("ranks"):  # data parallel (h2h --gpus N): rank 0's settings, and how the ranks ran
        parts.append(
            f"{s['ranks']} ranks: {s.get('data_parallel')}; rank 0 on cpus {s.get('rank_cpus')}, "
            f"OMP_NUM_THREADS {s.get('omp_num_threads')}"
        )
    return f"- {name}: " + " · ".join(parts)


def settings_lines(rows: list[dict]) -> str:
    return "\n".join(settings_line(r) for r in rows)


def best_vs_best_table(best: list[dict]) -> str:
    """Each system at its fastest batch, with ratios against ZeRO-3's and the whole-on-GPU run's
    best."""
    peer = {r["system"]: r["tokens_per_s"] for r in best}
    out = [
        "| system (L) | best tokens/step | tokens/s | TFLOPS | vs ZeRO-3 best | vs whole-on-GPU "
        "best | peak GPU GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(best, key=lambda r: -r["tokens_per_s"]):
        ratio = lambda s: (  # noqa: E731
            f"{r['tokens_per_s'] / peer[s]:.2f}×" if peer.get(s) else "–"
        )
        out.append(
            f"| {r['system']} ({r['layers']}) | {r['tokens_per_step']} | {r['tokens_per_s']:,.0f} "
            "| "
            f"{r['tflops']:.1f} | {ratio('zero3')} | {ratio('resident')} | "
            f"{r['peak_gpu_bytes'] / 1e9:.1f} |"
        )
    return "\n".join(out)


def report_line(res: dict) -> str:
    if int(res.get("gpus", 1)) > 1:
        return multi_gpu.report_line(res)
    if res.get("status") != "ok":
        seen = (
            f" (peak host RSS {res['peak_host_rss_bytes'] / 1e9:.1f} GB, last phase: "
            f"{res['last_phase']})"
            if "last_phase" in res
            else ""
        )
        return (
            f"[{res.get('system')}] tokens/step={res.get('tokens_per_step')} "
            f"{str(res.get('status')).upper()}"
            f"{seen}: "
            f"{str(res.get('error', '')).strip().splitlines()[-1:] if res.get('error') else ''}"
        )
    line = (
        f"[{res['system']}] L={res['layers']} tokens/step={res['tokens_per_step']} "
        f"{res['tokens_per_s']:,.0f} tokens/s {res['tflops']:.1f} TFLOPS "
        f"peak GPU {res['peak_gpu_bytes'] / 1e9:.1f} GB host {res['peak_host_rss_bytes'] / 1e9:.1f}"
        " GB"
    )
    huge = (res.get("phases") or [{}])[-1].get("anon_huge_bytes")
    if huge is not None:  # (common.report_phase: the process's memory in transparent huge pages)
        line += f" ({huge / 1e9:.1f} in huge pages)"
    settings = res.get("settings") or {}
    if settings.get("build_s") is not None:
        line += f" build {settings['build_s']:.1f} s"
        if settings.get("initialize_s") is not None:
            line += f" + initialize {settings['initialize_s']:.1f} s"
    if settings.get("lora"):
        line += (
            f" | LoRA r{settings['lora']['r']}: trainable {count(res['trainable_params'])}, "
            "base "
            f"{count(res['base_params'])}, host {res['host_bytes_per_base_param']:.2f} "
            "B/base param"
        )
        if res.get("engine_host_bytes_per_base_param") is not None:
            line += f" (engine state {res['engine_host_bytes_per_base_param']:.2f})"
    return line


def breakdown_line(res: dict) -> str:
    """The median step's time breakdown of a run that has one (megatrain_ds), one line; ""
    otherwise."""
    b = res.get("breakdown") or {}
    phases = (res.get("settings") or {}).get("warmup_phases_s")
    if res.get("status") == "ok" and not b and phases:  # Gemini: its last warm-up step, by phase
        parts = ", ".join(f"{k} {v:.3f}" for k, v in phases[-1].items())
        return f"    [{res['system']}] last warm-up step by phase (s, synchronised): {parts}"
    if res.get("status") != "ok" or not b:
        return ""
    keys = BREAKDOWN_KEYS
    if b.get("recompute_s"):  # the part of compute that re-ran forwards (after compute)
        at = keys.index("compute_s") + 1
        keys = keys[:at] + ("recompute_s",) + keys[at:]
    # the moments passes under the step, and the landings' waits for them
    if b.get("cpu_deferred_moments_s"):
        keys += ("cpu_deferred_moments_s", "wait_for_moments_s")
    parts = [f"{k[:-2]} {b[k]:.3f}" for k in keys if isinstance(b.get(k), (int, float))]
    idle, rate = stall(b)
    return (
        f"    [{res['system']}] breakdown (s, median step): "
        + ", ".join(parts)
        + (f", GPU idle {idle}" if idle else "")
        + (f", host update {rate} Gparam/s" if rate else "")
    )


def stall(b: dict | None) -> tuple[str, str]:
    """(the GPU's idle share of the step, the host update's Gparam/s) of a step breakdown,
    formatted; "" for what it lacks (no breakdown, no GPU idle time off CUDA, no host update)."""
    b = b or {}
    idle = (
        f"{b['gpu_idle_s'] / b['step_s']:.0%}"
        if b.get("gpu_idle_s") is not None and b.get("step_s")
        else ""
    )
    rate = f"{b['cpu_optimizer_gparam_s']:.2f}" if b.get("cpu_optimizer_gparam_s") else ""
    return idle, rate


def plot(results: list[dict], path: str, depth_sweep: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    # data parallel: one series per system and GPU count
    dp = any(int(r.get("gpus", 1)) > 1 for r in ok)
    name = multi_gpu.label if dp else (lambda r: r["system"])
    systems = sorted({name(r) for r in ok})
    if depth_sweep:
        for system in systems:
            rows = sorted((r for r in ok if name(r) == system), key=lambda r: r["layers"])
            ax.plot(
                [r["layers"] for r in rows], [r["tflops"] for r in rows], marker="o", label=system
            )
        ax.set_xlabel("decoder layers")
    else:
        ax.bar(systems, [max(r["tflops"] for r in ok if name(r) == s) for s in systems])
        ax.set_xlabel("system")
    ax.set_ylabel("model TFLOPS per GPU" if dp else "model TFLOPS")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{ok[0]['model'] if ok else ''}: throughput" if ok else "no successful run")
    if depth_sweep and ok:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("folder")
    p.add_argument(
        "--depth-plot",
        metavar="PNG",
        help="also plot TFLOPS vs layers per system (h2h's depth plot)",
    )
    p.add_argument(
        "--tokens", type=int, default=16384, help="the tokens/step of the runs in the depth plot"
    )
    args = p.parse_args(argv)
    rows = load(args.folder)
    if any(int(r.get("gpus", 1)) > 1 for r in rows):  # h2h --gpus N runs: the data-parallel tables
        from benchmarks import multi_gpu

        print(multi_gpu.throughput_table(rows))
        print()
        print(multi_gpu.scaling_lines(rows))
        print()
        print(multi_gpu.breakdown_table([r for r in rows if r.get("status") == "ok"]))
    else:
        print(throughput_table(rows))
        print()
        print(breakdown_table(rows))
        if any("base_params" in r or "last_phase" in r for r in rows):
            print()
            print(memory_table(rows))
    print()
    print(settings_lines(rows))
    if args.depth_plot:
        plot(
            [r for r in rows if r["tokens_per_step"] == args.tokens],
            args.depth_plot,
            depth_sweep=True,
        )
        print(f"wrote {args.depth_plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
