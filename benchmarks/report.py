"""Markdown tables from a folder of ``benchmarks.run_system`` result JSONs.

    python -m benchmarks.report benchmarks/results/2026-11-22_h200_qwen2.5-3b

Rows are grouped by tokens per step; each row's ratios are against the ``zero3`` and ``resident`` rows
of the same tokens per step (same device run). Units: tokens/s, TFLOPS (ANCHORS formula), GB = 1e9 bytes.
"""
from __future__ import annotations

import glob
import json
import os
import sys


def load(folder: str) -> list[dict]:
    """Every run in ``folder``: run_system JSONs (one run each) and h2h ``results.json`` files (a list of runs,
    possibly renamed, e.g. ``16k_zero3.json``); a run is named after its file, or after its h2h tag."""
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        if path.endswith(".ds_config.json"):
            continue
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        stem = os.path.splitext(os.path.basename(path))[0]
        if isinstance(data.get("results"), list):  # an h2h results file
            for row in data["results"]:
                row.setdefault("name", stem)
                row.setdefault("tokens_per_step", 0)
                rows.append(row)
            continue
        data["name"] = stem
        rows.append(data)
    return rows


def _ratio(row: dict, peer: dict | None) -> str:
    if not peer or not peer.get("tokens_per_s") or row.get("status") != "ok":
        return "–"
    return f"{row['tokens_per_s'] / peer['tokens_per_s']:.2f}×"


def throughput_table(rows: list[dict]) -> str:
    out = ["| run | tokens/step | s/step | tokens/s | TFLOPS | vs ZeRO-3 | vs whole-on-GPU | peak GPU GB "
           "| peak host RSS GB | host B/param |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for tokens in sorted({r["tokens_per_step"] for r in rows}):
        group = [r for r in rows if r["tokens_per_step"] == tokens]
        zero3 = next((r for r in group if r["system"] == "zero3"), None)
        resident = next((r for r in group if r["system"] == "resident"), None)
        for r in sorted(group, key=lambda r: -r.get("tokens_per_s", 0)):
            if r.get("status") != "ok":
                out.append(f"| {r['name']} | {tokens} | {r.get('status')} | | | | | | | |")
                continue
            out.append(
                f"| {r['name']} | {tokens} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                f"{r['tflops']:.1f} | {_ratio(r, zero3)} | {_ratio(r, resident)} | "
                f"{r['peak_gpu_bytes'] / 1e9:.1f} | {r['peak_host_rss_bytes'] / 1e9:.1f} | "
                f"{r['host_bytes_per_param']:.1f} |")
    return "\n".join(out)


def breakdown_table(rows: list[dict]) -> str:
    keys = ["step_s", "compute_s", "h2d_s", "d2h_s", "cpu_optimizer_s", "wait_for_optimizer_s", "gpu_idle_s"]
    out = ["| run | " + " | ".join(k.replace("_s", " (s)") for k in keys) + " | GPU idle % |",
           "|---|" + "---|" * (len(keys) + 1)]
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        cells = " | ".join(f"{b[k]:.3f}" if b.get(k) is not None else "n/a" for k in keys)
        idle = f"{100 * b['gpu_idle_s'] / b['step_s']:.0f}%" if b.get("gpu_idle_s") is not None else "n/a (CPU)"
        out.append(f"| {r['name']} | {cells} | {idle} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    rows = load(argv[0])
    print(throughput_table(rows))
    print()
    print(breakdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
