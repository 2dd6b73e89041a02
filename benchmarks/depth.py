"""The depth figure: model TFLOPS against decoder layers at a fixed width, every system, on one GPU
box.

    python -m benchmarks.depth --systems megatrain-host,megatrain --depths 28,56,84,120,180 \
        --deadline-s 540 --out runs/depth_a                       # one device call's share
    python -m benchmarks.depth --plot runs/depth_a runs/depth_b --out runs/depth
                                                # depth.png + depth.md, no GPU

Width: Qwen2.5-1.5B (hidden 1536, inter 8960, 12 heads, 2 KV heads, vocab 151936, tied), depth from
``--layers`` of the ``qwen2.5-1.5b`` shape; 16 x 1024 tokens/step, clip 1.0, bf16, liger for every
system, 3 warm-up + 3 measured steps (median; megatrain_ds's recompute check compares, and so
does not skip ``down_proj`` in, the first 3 steps: with 2, one measured step in three was a
checked one). Systems (each run is its own process, benchmarks.h2h.run_one, with the harness's
host pre-check and OOM records): ``megatrain-host``
(megatrain_ds --host-only), ``megatrain`` (engine defaults), ``zero3``, ``fsdp``
(benchmarks/fsdp_system.py), ``gemini`` (benchmarks/gemini_system.py), ``gemini-fp16`` (Gemini
with ``GEMINI_PRECISION=fp16``: its fastest host update, in another dtype than the others', so
outside the fair rules and labelled so).

A system that does not finish a depth (OOM on the GPU or the host, a host pre-check that says it
will not fit, "did not run", the call's time or ``--run-cap-s`` running out) is recorded as a
marked point and not run deeper. ``--deadline-s`` bounds the whole call: each run gets the time
left (less a margin for writing results) and is stopped at it; a run its system's last finished
run (scaled by depth) predicts would not finish in that time is not started, and runs never
started are listed under "not_run" with why. ``--order depth`` runs every system at one depth
before the next (peers that compete for the same call's time reach equal depths); ``--order
system`` one system's depths in a row. Writes ``OUT/depth.json`` after every run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from types import SimpleNamespace

from benchmarks.report import stall

MODEL = "qwen2.5-1.5b"
SYSTEM_ARGS = {  # depth.py's name -> (h2h system, host_only)
    "megatrain-host": ("megatrain", True),
    "megatrain": ("megatrain", False),
    "zero3": ("zero3", False),
    "fsdp": ("fsdp", False),
    "gemini": ("gemini", False),
    "gemini-fp16": ("gemini", False),
}
# what a depth system sets in its run's environment: Gemini fp16 gives HybridAdam its compiled host
# kernel (bf16 gradients take its unfused torch path: gemini_system.PRECISIONS); another dtype than
# the other systems', so outside the fair rules, and labelled so
SYSTEM_ENV = {"gemini-fp16": {"GEMINI_PRECISION": "fp16"}}
LABELS = {
    "megatrain-host": "megatrain_ds host-only",
    "megatrain": "megatrain_ds defaults",
    "zero3": "DeepSpeed ZeRO-3 offload",
    "fsdp": "FSDP2 CPU offload",
    "gemini": "ColossalAI Gemini",
    "gemini-fp16": "ColossalAI Gemini fp16 (not the others' dtype)",
}
MARGIN_S = 25  # left at the end of a call for the last run's teardown and the results


@contextlib.contextmanager
def run_env(env: dict):
    """``env`` set in this process's environment (which a run's child inherits) while the block
    runs; what was there before is restored."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_args(name: str, a: argparse.Namespace, timeout_s: float) -> SimpleNamespace:
    """The h2h arguments one run of system ``name`` takes (benchmarks.h2h.run_one reads these)."""
    _, host_only = SYSTEM_ARGS[name]
    return SimpleNamespace(
        model=a.model,
        seq=a.seq,
        steps=a.steps,
        warmup=a.warmup,
        device=a.device,
        liger=a.liger,
        gpu_optimizer_fraction=0.0,
        host_only=host_only,
        closing_step=a.closing_step,
        init="auto",
        gpu_memory_limit=None,
        lora=0,
        lora_targets="default",
        host_mem_gib=a.host_mem_gib,
        gpus=1,
        ds_config=None,
        zero3_ds_config=None,
        run_timeout_s=timeout_s,
    )


def plan_runs(systems: list[str], depths: list[int], order: str) -> list[tuple[str, int]]:
    if order == "depth":
        return [(s, d) for d in depths for s in systems]
    return [(s, d) for s in systems for d in depths]


def predicted_wall(last: tuple[int, float] | None, layers: int) -> float | None:
    """Seconds a run at ``layers`` should take, from the same system's last finished run
    ``(layers, wall s)``, scaled by depth (its build, initialize and steps grow with the layers;
    the import and start-up that do not make this an over-estimate); None without one."""
    if last is None:
        return None
    return last[1] * layers / last[0]


def refused(name: str, a: argparse.Namespace, layers: int) -> bool:
    """Whether the harness's host pre-check (bytes/param x params against MemAvailable) refuses
    system ``name`` at ``layers``: run_one then records it as skipped without starting it."""
    from benchmarks import h2h
    from benchmarks.shapes import make_config

    system, _ = SYSTEM_ARGS[name]
    config = make_config(a.model, layers=layers)
    return h2h.host_precheck(system, run_args(name, a, 0), config, a.tokens_per_step, 1) is not None


def sweep(a: argparse.Namespace) -> int:
    from benchmarks import h2h

    os.environ["H2H_CLIP"] = repr(a.clip)
    os.makedirs(a.out, exist_ok=True)
    start = time.monotonic()
    stopped: dict[str, str] = {}  # system -> why its deeper depths are not run
    results, not_run = [], []
    info = h2h.hardware()

    def write() -> None:
        path = os.path.join(a.out, "depth.json")
        with open(path + ".tmp", "w") as f:
            json.dump(
                {
                    "hardware": info,
                    "argv": sys.argv[1:],
                    "model": a.model,
                    "tokens_per_step": a.tokens_per_step,
                    "results": results,
                    "not_run": not_run,
                },
                f,
                indent=2,
                default=str,
            )
        os.replace(path + ".tmp", path)

    walls: dict[str, tuple[int, float]] = {}  # system -> (layers, wall s) of its last finished run
    for name, layers in plan_runs(a.systems, a.depths, a.order):
        left = a.deadline_s - (time.monotonic() - start) - MARGIN_S
        if name in stopped:
            not_run.append({"system": name, "layers": layers, "why": stopped[name]})
            continue
        if left < 30:
            not_run.append({"system": name, "layers": layers, "why": "the call's time ran out"})
            continue
        timeout = min(left, a.run_cap_s) if a.run_cap_s else left
        want = predicted_wall(walls.get(name), layers)
        if want is not None and want > timeout and not refused(name, a, layers):
            # it would be stopped part-way: its time goes to the systems after it (2026-11-29:
            # three runs cut by the call's end cost ~170 s). One the host pre-check refuses is
            # run_one's quick "skipped" record below, which says why better than the time would
            not_run.append(
                {
                    "system": name,
                    "layers": layers,
                    "why": f"the call's time: predicted {want:.0f} s, {timeout:.0f} s left",
                }
            )
            continue
        system, _ = SYSTEM_ARGS[name]
        path = os.path.join(a.out, f"{name}_L{layers}.json")
        began = time.monotonic()
        with run_env(SYSTEM_ENV.get(name, {})):
            res = h2h.run_one(system, run_args(name, a, timeout), layers, a.tokens_per_step, path)
        res["run_wall_s"] = round(time.monotonic() - began, 1)
        if res.get("status") == "ok":
            walls[name] = (layers, res["run_wall_s"])
        res["depth_system"] = name
        print(h2h.report_line(res), flush=True)
        results.append(res)
        if res.get("status") != "ok":
            stopped[name] = f"L={layers}: {res.get('status')}"
        write()
    write()
    print(
        f"wrote {a.out}/depth.json ({len(results)} runs, {len(not_run)} not run) in "
        f"{time.monotonic() - start:.0f} s"
    )
    return 0


# ----------------------------------------------------------------------------------------------
# plot
def load(
    folders: list[str], supersede: tuple[str, ...] = ()
) -> tuple[list[dict], list[dict], list[tuple[str, dict]]]:
    """The runs of ``folders`` in order; a later folder's run of a (system, depth) replaces an
    earlier one's (a point run again in a later call), and a system in ``supersede`` is taken only
    from the last folder that ran it (its earlier rows had a cause since fixed). Also the sources:
    (folder, its hardware) for each folder, and each run's ``source`` (1-based index into them), so
    a figure merged across leases says which machine each point came from."""
    runs, not_run, sources = {}, [], []
    for folder in folders:
        with open(os.path.join(folder, "depth.json")) as f:
            data = json.load(f)
        sources.append((folder, data.get("hardware", {})))
        fresh = {r.get("depth_system") for r in data["results"]} & set(supersede)
        runs = {k: v for k, v in runs.items() if k[0] not in fresh}
        for r in data["results"]:
            runs[(r.get("depth_system"), r["layers"])] = {**r, "source": len(sources)}
        not_run += data.get("not_run", [])
    results = list(runs.values())
    ran = set(runs)
    not_run = [
        n for n in not_run if (n.get("depth_system", n.get("system")), n.get("layers")) not in ran
    ]
    return results, not_run, sources


def sources_md(sources: list[tuple[str, dict]]) -> str:
    """The merged figure's machines: one line for one folder, a numbered list (the table's "from"
    column) for several."""

    def box(hw: dict) -> str:
        gpu = (hw.get("gpu") or "no GPU").splitlines()
        parts = [x.strip() for x in gpu[0].split(",")]
        if len(parts) == 4:  # nvidia-smi's name, memory.total, pcie gen, pcie width (h2h.hardware)
            gpu[0] = f"{parts[0]} ({parts[1]}, PCIe gen{parts[2]} x{parts[3]})"
        mem = hw.get("host_mem_bytes") or 0
        return f"{len(gpu)} × {gpu[0]}, {hw.get('cpu_cores')} CPU cores, {mem / 2**30:.0f} GiB host"

    if len(sources) == 1:
        return f"Hardware: {box(sources[0][1])}"
    return "Sources (the table's \"from\"):\n\n" + "\n".join(
        f"{i}. `{folder}`: {box(hw)}" for i, (folder, hw) in enumerate(sources, 1)
    )


def recomputed(r: dict) -> tuple[int, bool] | None:
    """(decoder layers whose forward the run's steps recompute, whether the recompute skips the
    MLP's output projection) from its recorded settings; None where they do not say. The peers
    checkpoint every decoder layer (``recomputes_every_layer``; in older records, their
    ``gradient_checkpointing`` text), megatrain_ds
    every layer but its kept ones (``kept_layers``), its skip named in ``recompute_skips``."""
    s, layers = r.get("settings") or {}, r.get("layers")
    if not layers:
        return None
    if "kept_layers" in s:
        return layers - int(s["kept_layers"]), bool(s.get("recompute_skips"))
    if s.get("recomputes_every_layer"):
        return layers, False
    # runs recorded before 2026-11-30 say it only in their gradient_checkpointing text
    if "per decoder layer" in str(s.get("gradient_checkpointing", "")):
        return layers, False
    return None


def gpu_tflops(r: dict) -> float | None:
    """TFLOPS with the recomputed forwards counted (``recompute_flops_per_token``): what the GPU
    ran, beside the model TFLOPS of the ANCHORS formula; None where the recompute is not known. A
    lower bound for a megatrain_ds run whose measured steps include a checked one (fewer warm-up
    steps than its recompute check's: that step recomputes ``down_proj`` too)."""
    from benchmarks.shapes import make_config, recompute_flops_per_token

    rec = recomputed(r)
    if rec is None or not r.get("tokens_per_s") or not r.get("flops_per_token"):
        return None
    config = make_config(r.get("model") or MODEL, layers=r["layers"])
    extra = recompute_flops_per_token(config, int(r.get("seq") or 1024), *rec)
    return (r["flops_per_token"] + extra) * r["tokens_per_s"] / 1e12


def table(results: list[dict], not_run: list[dict]) -> str:
    """The runs as a markdown table; with runs from several folders (``load``), a "from" column."""
    many = len({r.get("source") for r in results}) > 1
    src = (lambda r: f" {r.get('source', '')} |") if many else (lambda r: "")

    def hw(r: dict) -> str:
        value = gpu_tflops(r)
        return "" if value is None else f"{value:.1f}"

    out = [
        "| system | layers | params | status | s/step | tokens/s | TFLOPS | TFLOPS with the "
        "recompute | peak GPU GB | peak host RSS GB | GPU idle | host Gparam/s |"
        + (" from |" if many else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if many else ""),
    ]
    for r in sorted(results, key=lambda r: (r["depth_system"], r.get("layers") or 0)):
        label = LABELS.get(r["depth_system"], r["depth_system"])
        if r.get("status") == "ok":
            out.append(
                f"| {label} | {r['layers']} | {r['n_params'] / 1e9:.2f} B | ok | "
                f"{r['median_step_s']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {hw(r)} | "
                f"{r['peak_gpu_bytes'] / 1e9:.1f} | "
                f"{r['peak_host_rss_bytes'] / 1e9:.1f} | {' | '.join(stall(r.get('breakdown')))} |"
                + src(r)
            )
        else:
            why = str(r.get("error") or "").strip().splitlines()[-1:] or [""]
            if str(r.get("status", "")).startswith("timed out") and r.get("last_phase"):
                # stopped by a cap: where it was says more than the stderr's last line (often a
                # teardown warning printed by the interrupt)
                why = [f"stopped in the phase after: {r['last_phase']}"]
            out.append(
                f"| {label} | {r.get('layers')} | | **{r.get('status')}** | | | | | | "
                f"{(r.get('peak_host_rss_bytes') or 0) / 1e9:.1f} | | |" + src(r)
            )
            out.append(f"|  | | | {why[0][:160]} | | | | | | | | |" + (" |" if many else ""))
    for n in not_run:
        out.append(
            f"| {LABELS.get(n['system'], n['system'])} | {n['layers']} | | not run: {n['why']} | | "
            "| | | | | | |" + (" |" if many else "")
        )
    return "\n".join(out)


def stops(results: list[dict], not_run: list[dict]) -> dict[str, tuple[int, str]]:
    """Where each system stopped, as the figure marks it: {system: (layers, label)} for the
    shallowest depth it has no TFLOPS at, from a failed, skipped or timed-out run or a ``not_run``
    point; the label "OOM" for a device out-of-memory, "host" for the host pre-check's refusal,
    else the status's first words ("timed out", "not run")."""
    seen: dict[str, list[tuple[int, str]]] = {}
    ran = {(r["depth_system"], r["layers"]) for r in results if r.get("status") == "ok"}
    for r in results:
        status = str(r.get("status"))
        if status != "ok":  # a skipped run's error says why (the host pre-check's numbers)
            text = f"{status} {r.get('error') or ''}" if status == "skipped" else status
            seen.setdefault(r["depth_system"], []).append((r["layers"], text))
    for n in not_run:
        if (n.get("system"), n["layers"]) not in ran:
            seen.setdefault(n["system"], []).append((n["layers"], f"not run: {n.get('why', '')}"))
    out = {}
    for name, points in seen.items():
        layers, status = min(points)
        low = status.lower()
        label = (
            "OOM"
            if "oom" in low or "out of memory" in low
            else "host"
            if "host memory" in low
            else status.split(" (")[0].split(":")[0]
        )
        out[name] = (layers, label)
    return out


def plot(results: list[dict], path: str, not_run: list[dict] = ()) -> None:
    """TFLOPS against depth, a line per system; where a system stopped (a failed, skipped or
    timed-out run, or a point ``not_run`` names) an x on the axis with the reason beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    stopped = stops(results, list(not_run))
    deepest = max([r["layers"] for r in results] + [n["layers"] for n in not_run])
    top_gpu: list[float] = []
    for name in [n for n in SYSTEM_ARGS if any(r["depth_system"] == n for r in results)]:
        rows = sorted((r for r in results if r["depth_system"] == name), key=lambda r: r["layers"])
        ok = [r for r in rows if r.get("status") == "ok"]
        (line,) = ax.plot(
            [r["layers"] for r in ok], [r["tflops"] for r in ok], marker="o", label=LABELS[name]
        )
        gpu = [gpu_tflops(r) for r in ok]
        if name.startswith("megatrain") and ok and None not in gpu:
            # what its GPU ran, the recomputed forwards counted (the peers recompute every layer:
            # their dashed line would sit a third above theirs)
            ax.plot(
                [r["layers"] for r in ok],
                gpu,
                linestyle="--",
                marker=".",
                color=line.get_color(),
                label=f"{LABELS[name]}, recompute counted",
            )
            top_gpu.append(max(gpu))
        if name in stopped:  # the first place it stopped: an x on the axis, why beside it
            layers, label = stopped[name]
            ax.plot([layers], [0], marker="x", markersize=10, color=line.get_color())
            right = layers >= deepest  # at the figure's right edge: the text to its left
            ax.annotate(
                f"{LABELS[name]}: {label}",
                (layers, 0),
                textcoords="offset points",
                xytext=(-4 if right else 4, 6 + 10 * list(SYSTEM_ARGS).index(name)),
                ha="right" if right else "left",
                fontsize=7,
                color=line.get_color(),
            )
    ax.set_xlabel("decoder layers (hidden 1536, Qwen2.5-1.5B width)")
    ax.set_ylabel("model TFLOPS (ANCHORS formula)")
    top = max([r["tflops"] for r in results if r.get("status") == "ok"] + top_gpu + [10.0])
    ax.set_ylim(-5, 1.25 * top)
    ax.set_title("TFLOPS vs depth at a fixed width (x: OOM, did not run or timed out)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--systems",
        default="megatrain-host,megatrain,zero3,fsdp,gemini",
        help=f"comma-separated, from {', '.join(SYSTEM_ARGS)}",
    )
    p.add_argument(
        "--depths", default="28,56,84,120,180", help="comma-separated decoder-layer counts"
    )
    p.add_argument("--order", default="depth", choices=["depth", "system"])
    p.add_argument("--deadline-s", type=float, default=540.0, help="seconds for the whole call")
    p.add_argument("--run-cap-s", type=float, default=None, help="seconds one run may take at most")
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--liger", default="auto", choices=["auto", "on", "off"])
    p.add_argument(
        "--closing-step",
        default="tiny",
        choices=["full", "tiny"],
        help="megatrain: what closes the last step's breakdown (tiny: no extra full step)",
    )
    p.add_argument("--host-mem-gib", type=float, default=None)
    p.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the driver"
    )
    p.add_argument(
        "--model", default=MODEL, help="the shape whose depth is swept (a smoke run: tiny)"
    )
    p.add_argument(
        "--plot",
        nargs="+",
        default=None,
        metavar="DIR",
        help="no runs: merge these folders' depth.json into OUT/depth.png and OUT/depth.md",
    )
    p.add_argument(
        "--supersede",
        default="",
        metavar="SYSTEMS",
        help="with --plot: comma-separated systems taken only from the last folder that ran them",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.plot:
        results, not_run, sources = load(a.plot, tuple(filter(None, a.supersede.split(","))))
        os.makedirs(a.out, exist_ok=True)
        plot(results, os.path.join(a.out, "depth.png"), not_run)
        with open(os.path.join(a.out, "depth.md"), "w") as f:
            f.write(f"{sources_md(sources)}\n\n{table(results, not_run)}\n")
        print(table(results, not_run))
        return 0
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = set(a.systems) - set(SYSTEM_ARGS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEM_ARGS)}")
    a.depths = [int(d) for d in a.depths.split(",")]
    return sweep(a)


if __name__ == "__main__":
    sys.exit(main())
