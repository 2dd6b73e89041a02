"""Head-to-head: megatrain_ds vs DeepSpeed ZeRO-3 CPU offload vs the whole model on the GPU, one command.

    python -m benchmarks.h2h --model qwen2.5-3b --tokens-per-step 16384 --out runs/3b
    python -m benchmarks.h2h --model qwen2.5-3b --best-batch --out runs/3b-best
    python -m benchmarks.h2h --model qwen2.5-14b --depth-sweep 28,56,84 --systems megatrain,zero3 --out runs/sweep
    python -m benchmarks.h2h --model tiny --device cpu --systems megatrain,resident --seq 64 \
        --tokens-per-step 256 --out runs/h2h-smoke    # CPU smoke test

Fair peers (ANCHORS.md "Fair comparison rules"): every system trains with AdamW lr 1e-5, weight decay 0.01,
betas (0.9, 0.999), eps 1e-8, the same --clip, warm-up and measured steps; ``--liger`` gives all of them (or none)
liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy (ZeRO-3 and whole-on-GPU as HF Trainer's
use_liger_kernel applies them); ``--gpu-optimizer-fraction F`` keeps the same share of optimizer state on the GPU
for megatrain and ZeRO-3 (offload_optimizer.ratio = 1 - F). Each run records its settings under "settings", and
results.md shows one settings line per run.

Each system runs in its own process (``benchmarks.run_system``), one after another, on the same model shape and
data. Before a run, host memory is checked against what the system needs (bytes/param below) and the run is
skipped with the numbers when it does not fit; a device OOM is recorded as "oom", not a crash. Writes
``results.json`` (per run: tokens_per_s, tflops, peak_gpu_bytes, peak_host_rss_bytes, host_bytes_per_param,
breakdown where the system has one; plus the hardware), ``results.md`` (tables) and ``results.png`` (plot).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

from tqdm import tqdm

from benchmarks import report
from benchmarks.common import PROGRESS_TAG
from benchmarks.shapes import SHAPES, make_config

# Peak host bytes per parameter each system needs (measured: 3B on the H200 box, benchmarks/results/):
# model build (fp32, 4 B) + state. megatrain 17.3, zero3 25.9, resident builds on the GPU.
HOST_BYTES_PER_PARAM = {"megatrain": 18.0, "zero3": 27.0, "resident": 1.0}


def hardware() -> dict:
    info = {"cpu_cores": os.cpu_count(), "platform": platform.platform(), "host_mem_bytes": _meminfo("MemTotal")}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,pcie.link.gen.current,"
                              "pcie.link.width.current", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        info["gpu"] = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _n_params(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def run_one(system: str, args, layers: int | None, tokens: int, path: str) -> dict:
    """One system in its own process; returns its result dict (or a 'skipped' record)."""
    config = make_config(args.model, layers=layers)
    need = HOST_BYTES_PER_PARAM[system] * _n_params(config)
    have = _meminfo("MemAvailable")
    if have and need > have:
        return {"system": system, "model": args.model, "layers": config.num_hidden_layers, "tokens_per_step": tokens,
                "status": "skipped", "error": f"needs ~{need / 2**30:.0f} GiB host memory, {have / 2**30:.0f} GiB free"}
    cmd = [sys.executable, "-m", "benchmarks.run_system", "--system", system, "--model", args.model,
           "--tokens-per-step", str(tokens), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--device", args.device, "--json", path, "--progress",
           "--liger", args.liger, "--gpu-optimizer-fraction", repr(args.gpu_optimizer_fraction)]
    if args.host_only:
        cmd.append("--host-only")
    if layers:
        cmd += ["--layers", str(layers)]
    tail = _run_with_progress(cmd, f"{system} L={config.num_hidden_layers} T={tokens}")
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    else:
        result = {"system": system, "status": "error", "error": "".join(tail)[-2000:]}
    result["name"] = os.path.splitext(os.path.basename(path))[0]
    return result


def _run_with_progress(cmd: list[str], desc: str) -> list[str]:
    """Run one system's process; its per-step lines drive a progress bar (the first step includes the model
    build and warm-up). Returns the last lines of its other output (stdout and stderr) for error reports."""
    from collections import deque

    tail: deque[str] = deque(maxlen=200)
    bar = tqdm(desc=desc, unit="step", leave=True, bar_format="{desc}: {n_fmt}/{total_fmt} steps "
               "[{elapsed}{postfix}]")
    bar.set_postfix_str("building the model")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        if PROGRESS_TAG in line:  # anywhere: a child's partial stderr line (no newline yet) may precede it
            head, _, rest = line.partition(PROGRESS_TAG)
            if head.strip():
                tail.append(head + "\n")
            done, total, seconds = rest.split()[:3]
            bar.total = int(total)
            bar.n = int(done)
            bar.set_postfix_str(f"last step {float(seconds):.2f} s", refresh=False)
            bar.refresh()
        else:
            tail.append(line)
    proc.wait()
    bar.close()
    return list(tail)


def best_batch(system: str, args, layers: int | None, out: str, on_probe=lambda res: None) -> dict:
    """Double the tokens per step from ``--min-tokens`` (default one sequence) until the system runs out of
    memory or passes ``--max-tokens``; every probe goes to ``on_probe``; the fastest gets ``best_batch: True``."""
    best, tokens = None, max(args.seq, args.min_tokens // args.seq * args.seq)
    while tokens <= args.max_tokens:
        res = run_one(system, args, layers, tokens, os.path.join(out, f"{system}_best_{tokens}.json"))
        tqdm.write(report_line(res))
        on_probe(res)
        if res.get("status") != "ok":
            break
        if best is None or res["tokens_per_s"] > best["tokens_per_s"]:
            best = res
        tokens *= 2
    if best is not None:
        best["best_batch"] = True
    return best or res


def best_vs_best_table(best: list[dict]) -> str:
    """Each system at its fastest batch, with ratios against ZeRO-3's and the whole-on-GPU run's best."""
    peer = {r["system"]: r["tokens_per_s"] for r in best}
    out = ["| system (L) | best tokens/step | tokens/s | TFLOPS | vs ZeRO-3 best | vs whole-on-GPU best | peak GPU GB |",
           "|---|---|---|---|---|---|---|"]
    for r in sorted(best, key=lambda r: -r["tokens_per_s"]):
        ratio = lambda s: f"{r['tokens_per_s'] / peer[s]:.2f}×" if peer.get(s) else "–"  # noqa: E731
        out.append(f"| {r['system']} ({r['layers']}) | {r['tokens_per_step']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['tflops']:.1f} | {ratio('zero3')} | {ratio('resident')} | {r['peak_gpu_bytes'] / 1e9:.1f} |")
    return "\n".join(out)


def report_line(res: dict) -> str:
    if res.get("status") != "ok":
        return f"[{res.get('system')}] tokens/step={res.get('tokens_per_step')} {str(res.get('status')).upper()}: " \
               f"{str(res.get('error', '')).strip().splitlines()[-1:] if res.get('error') else ''}"
    return (f"[{res['system']}] L={res['layers']} tokens/step={res['tokens_per_step']} "
            f"{res['tokens_per_s']:,.0f} tokens/s {res['tflops']:.1f} TFLOPS "
            f"peak GPU {res['peak_gpu_bytes'] / 1e9:.1f} GB host {res['peak_host_rss_bytes'] / 1e9:.1f} GB")


def plot(results: list[dict], path: str, depth_sweep: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    systems = sorted({r["system"] for r in ok})
    if depth_sweep:
        for system in systems:
            rows = sorted((r for r in ok if r["system"] == system), key=lambda r: r["layers"])
            ax.plot([r["layers"] for r in rows], [r["tflops"] for r in rows], marker="o", label=system)
        ax.set_xlabel("decoder layers")
    else:
        ax.bar(systems, [max(r["tflops"] for r in ok if r["system"] == s) for s in systems])
        ax.set_xlabel("system")
    ax.set_ylabel("model TFLOPS")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{ok[0]['model'] if ok else ''}: throughput" if ok else "no successful run")
    if depth_sweep and ok:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="megatrain,zero3,resident")
    p.add_argument("--model", default="qwen2.5-3b", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--best-batch", action="store_true", help="search each system's fastest batch that fits")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="start of the --best-batch search (default: one sequence); it doubles from there")
    p.add_argument("--max-tokens", type=int, default=262144, help="upper end of the --best-batch search")
    p.add_argument("--depth-sweep", default=None, help="comma-separated layer counts, e.g. 28,56,84,120,180")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--megatrain-options", default=None, metavar="JSON",
                   help='extra keys for megatrain_ds\'s "megatrain" config block, e.g. \'{"gpu_optimizer_layers": "auto"}\'')
    p.add_argument("--clip", type=float, default=1.0,
                   help="gradient_clipping for every system (ANCHORS: 1.0); a large value never clips")
    p.add_argument("--liger", default="auto", choices=["auto", "on", "off"],
                   help="liger-kernel (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy) for every system; auto: on "
                        "when running on CUDA with liger_kernel importable")
    p.add_argument("--gpu-optimizer-fraction", type=float, default=0.0, metavar="F",
                   help="share of the optimizer state on the GPU for megatrain and ZeRO-3 alike "
                        "(offload_optimizer.ratio = 1 - F); 0: all on the host, or megatrain's engine default")
    p.add_argument("--host-only", action="store_true",
                   help="megatrain: all optimizer state on the host (gpu_optimizer_layers 0), whatever the "
                        "engine's default")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not 0.0 <= args.gpu_optimizer_fraction <= 1.0:
        p.error("--gpu-optimizer-fraction must be in [0, 1]")
    if args.host_only and args.gpu_optimizer_fraction > 0:
        p.error("--host-only and --gpu-optimizer-fraction > 0 contradict each other")
    if args.liger == "on" and args.device != "cuda":
        p.error("--liger on: liger-kernel runs on CUDA only")
    os.environ["H2H_CLIP"] = repr(args.clip)  # read by benchmarks.systems / megatrain_system in each child
    if args.megatrain_options is not None:
        try:
            options = json.loads(args.megatrain_options)
        except json.JSONDecodeError as exc:
            p.error(f"--megatrain-options is not JSON: {exc}")
        if not isinstance(options, dict):
            p.error("--megatrain-options must be a JSON object")
        os.environ["MEGATRAIN_OPTIONS"] = json.dumps(options)  # read by benchmarks.megatrain_system
    os.makedirs(args.out, exist_ok=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(HOST_BYTES_PER_PARAM)
    if unknown:
        p.error(f"unknown system(s) {sorted(unknown)}; choose from {sorted(HOST_BYTES_PER_PARAM)}")
    depths = [int(d) for d in args.depth_sweep.split(",")] if args.depth_sweep else [args.layers]
    results = []
    results_path = os.path.join(args.out, "results.json")
    recorded = [os.path.basename(a) if a == args.out else a for a in (sys.argv[1:] if argv is None else argv)]

    def write_results() -> None:  # after every run: a harness killed mid-way keeps what it measured
        with open(results_path + ".tmp", "w") as f:
            json.dump({"hardware": info, "argv": recorded, "results": results}, f, indent=2, default=str)
        os.replace(results_path + ".tmp", results_path)

    info = hardware()
    for layers in depths:
        for system in systems:
            if args.best_batch:  # every probe is recorded; the fastest is marked best_batch
                best_batch(system, args, layers, args.out, on_probe=lambda res: (results.append(res), write_results()))
                write_results()
            else:
                tag = f"{system}_L{layers or 'default'}_{args.tokens_per_step}"
                res = run_one(system, args, layers, args.tokens_per_step, os.path.join(args.out, tag + ".json"))
                tqdm.write(report_line(res))
                results.append(res)
                write_results()
    ok = [r for r in results if r.get("status") == "ok"]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report.throughput_table(ok) + "\n\n" + report.breakdown_table(ok) + "\n")
        if args.best_batch:
            f.write("\n" + best_vs_best_table([r for r in ok if r.get("best_batch")]) + "\n")
        f.write("\nSettings:\n\n" + report.settings_lines(results) + "\n")
        for r in results:
            if r.get("status") != "ok":
                f.write(f"\n- {report_line(r)}")
    plot(results, os.path.join(args.out, "results.png"), depth_sweep=bool(args.depth_sweep))
    print(f"wrote {args.out}/results.json, results.md, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
