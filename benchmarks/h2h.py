"""Head-to-head: megatrain_ds vs DeepSpeed ZeRO-3 CPU offload vs the whole model on the GPU, one command.

    python -m benchmarks.h2h --model qwen2.5-3b --tokens-per-step 16384 --out runs/3b
    python -m benchmarks.h2h --model qwen2.5-3b --best-batch --out runs/3b-best
    python -m benchmarks.h2h --model qwen2.5-14b --depth-sweep 28,56,84 --systems megatrain,zero3 --out runs/sweep
    python -m benchmarks.h2h --model tiny --device cpu --systems megatrain,resident --seq 64 \
        --tokens-per-step 256 --out runs/h2h-smoke    # CPU smoke test
    python -m benchmarks.h2h --model qwen2.5-3b --gpus 2 --scaling --tokens-per-step 16384 --out runs/dp
        # data parallel: every system with 2 ranks (torchrun), plus megatrain on 1 GPU for the scaling ratio

Data parallel (``--gpus N``, N > 1): every system runs as N processes, one per GPU, launched by torchrun, each
rank on its own micro-batch of ``--tokens-per-step`` tokens (per rank); megatrain_ds, DeepSpeed ZeRO-3 (N ranks)
and the whole-on-GPU bound (DDP over N ranks; ``--resident-mode``). tokens/s is summed over the ranks (tokens
per rank × N / rank 0's step time), TFLOPS are per GPU, host RSS summed over the ranks' processes, also per
parameter; ``--scaling`` adds megatrain on one GPU and prints N GPUs / 1 GPU. Details: benchmarks/multi_gpu.py.
``--gpus 1`` (the default) is the one-process harness, unchanged.

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

from benchmarks import multi_gpu, report
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


# Data parallel: host bytes one more process costs beyond the model's state (libraries, CUDA context)
PER_PROCESS_HOST_BYTES = 3 * 2**30


def run_one(system: str, args, layers: int | None, tokens: int, path: str, gpus: int | None = None) -> dict:
    """One system in its own process (``gpus`` > 1: torchrun with that many ranks, see run_dp); returns its
    result dict (or a 'skipped' record). ``gpus`` defaults to ``args.gpus``."""
    gpus = int(getattr(args, "gpus", 1) if gpus is None else gpus)
    config = make_config(args.model, layers=layers)
    # resident builds on each GPU (1 B/param of host per process); the offloading systems partition their state
    need = HOST_BYTES_PER_PARAM[system] * _n_params(config) * (gpus if system == "resident" else 1) \
        + (gpus - 1) * PER_PROCESS_HOST_BYTES
    have = int(args.host_mem_gib * 2**30) if getattr(args, "host_mem_gib", None) else _meminfo("MemAvailable")
    if have and need > have:
        skipped = {"system": system, "model": args.model, "layers": config.num_hidden_layers,
                   "tokens_per_step": tokens, "status": "skipped",
                   "error": f"needs ~{need / 2**30:.0f} GiB host memory, {have / 2**30:.0f} GiB free"}
        if gpus > 1:
            skipped.update(gpus=gpus, name=os.path.splitext(os.path.basename(path))[0])
        return skipped
    cmd = [sys.executable, "-m", "benchmarks.run_system", "--system", system, "--model", args.model,
           "--tokens-per-step", str(tokens), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--device", args.device, "--json", path, "--progress",
           "--liger", args.liger, "--gpu-optimizer-fraction", repr(args.gpu_optimizer_fraction)]
    if args.host_only:
        cmd.append("--host-only")
    if layers:
        cmd += ["--layers", str(layers)]
    if gpus > 1:
        bind = getattr(args, "bind_cores", "on") == "on"
        return run_dp(system, cmd[3:], config, tokens, path, gpus, bind_cores=bind)
    tail = _run_with_progress(cmd, f"{system} L={config.num_hidden_layers} T={tokens}")
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    else:
        result = {"system": system, "status": "error", "error": "".join(tail)[-2000:]}
    result["name"] = os.path.splitext(os.path.basename(path))[0]
    return result


def run_dp(system: str, run_system_args: list[str], config, tokens: int, path: str, gpus: int,
           bind_cores: bool = True) -> dict:
    """One system as ``gpus`` ranks under torchrun; the ranks' JSONs (``<path stem>.rank<r>.json``) are combined
    by multi_gpu.aggregate into ``path``. The launch command, OMP_NUM_THREADS and the ranks' cores
    (``bind_cores``: multi_gpu.launch_env) are recorded."""
    for r in range(gpus):  # a stale file from an earlier run must not stand in for a rank that died
        if os.path.exists(multi_gpu.rank_json(path, r)):
            os.remove(multi_gpu.rank_json(path, r))
    cmd = multi_gpu.launch_cmd(sys.executable, gpus, run_system_args)
    env = multi_gpu.launch_env(gpus, bind=bind_cores)
    tail = _run_with_progress(cmd, f"{system} ×{gpus} L={config.num_hidden_layers} T={tokens}/rank", env=env)
    per_rank = []
    for r in range(gpus):
        if os.path.exists(multi_gpu.rank_json(path, r)):
            with open(multi_gpu.rank_json(path, r)) as f:
                per_rank.append(json.load(f))
    if per_rank:
        result = multi_gpu.aggregate(per_rank, gpus)
    else:
        result = {"system": system, "model": config.name_or_path, "layers": config.num_hidden_layers,
                  "tokens_per_step": tokens, "gpus": gpus, "status": "error", "error": "".join(tail)[-2000:]}
    if result.get("status") != "ok" and tail:
        result["launcher_tail"] = "".join(tail)[-2000:]
    result["launch"] = {"command": multi_gpu.recorded_cmd(cmd, path), "OMP_NUM_THREADS": env["OMP_NUM_THREADS"],
                        "H2H_RANK_CPUS": env.get("H2H_RANK_CPUS", "not bound")}
    result["name"] = os.path.splitext(os.path.basename(path))[0]
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    return result


def run_resident_bound(args, layers: int | None, tokens: int, out: str, gpus: int) -> dict:
    """The whole-on-GPU bound for ``gpus`` GPUs (``--resident-mode``): DDP over the ranks ("ddp"), one GPU's
    tokens/s × N ("single"), or DDP and, if DDP runs out of memory, one GPU × N ("auto")."""
    tag = f"resident_L{layers or 'default'}_{tokens}"
    if args.resident_mode in ("auto", "ddp"):
        res = run_one("resident", args, layers, tokens, os.path.join(out, f"{tag}_g{gpus}.json"), gpus)
        res["resident_mode"] = "ddp"
        if args.resident_mode == "ddp" or res.get("status") not in ("oom",):
            return res
        tqdm.write(multi_gpu.report_line(res))
        reason = f"DDP over {gpus} ranks did not fit ({res.get('status')}); one GPU's run × {gpus}"
    else:
        reason = f"--resident-mode single: one GPU's run × {gpus}"
    single = run_one("resident", args, layers, tokens, os.path.join(out, f"{tag}_g1.json"), 1)
    single["gpus"] = 1
    bound = multi_gpu.bound_from_single(single, gpus, reason)
    bound["name"] = f"{tag}_g1x{gpus}"
    return bound


def _run_with_progress(cmd: list[str], desc: str, env: dict | None = None) -> list[str]:
    """Run one system's process; its per-step lines drive a progress bar (the first step includes the model
    build and warm-up). Returns the last lines of its other output (stdout and stderr) for error reports."""
    from collections import deque

    tail: deque[str] = deque(maxlen=200)
    bar = tqdm(desc=desc, unit="step", leave=True, bar_format="{desc}: {n_fmt}/{total_fmt} steps "
               "[{elapsed}{postfix}]")
    bar.set_postfix_str("building the model")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
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
    if int(res.get("gpus", 1)) > 1:
        return multi_gpu.report_line(res)
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
    dp = any(int(r.get("gpus", 1)) > 1 for r in ok)  # data parallel: one series per system and GPU count
    name = multi_gpu.label if dp else (lambda r: r["system"])
    systems = sorted({name(r) for r in ok})
    if depth_sweep:
        for system in systems:
            rows = sorted((r for r in ok if name(r) == system), key=lambda r: r["layers"])
            ax.plot([r["layers"] for r in rows], [r["tflops"] for r in rows], marker="o", label=system)
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
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="processes (GPUs) per system: N > 1 launches each system as N ranks under torchrun, each "
                        "on its own micro-batch of --tokens-per-step tokens (benchmarks/multi_gpu.py)")
    p.add_argument("--scaling", action="store_true",
                   help="with --gpus N > 1: also run megatrain on one GPU and print N GPUs / 1 GPU")
    p.add_argument("--resident-mode", default="auto", choices=list(multi_gpu.RESIDENT_MODES),
                   help="the whole-on-GPU bound with --gpus N > 1: ddp (DDP over N ranks), single (one GPU's "
                        "tokens/s × N, labelled a bound), auto (DDP; one GPU × N if DDP runs out of memory)")
    p.add_argument("--bind-cores", default="on", choices=["on", "off"],
                   help="with --gpus N > 1: bind each rank of every system to its own 1/N of the physical cores "
                        "(OMP_NUM_THREADS its size); off: no binding, OMP_NUM_THREADS = cpus / N")
    p.add_argument("--host-mem-gib", type=float, default=None, metavar="G",
                   help="host memory to check each system's need against (default: MemAvailable; a VM whose "
                        "memory grows as it is used reads too little there at first)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error("--gpus must be >= 1")
    if args.scaling and args.gpus < 2:
        p.error("--scaling compares N GPUs with one: give --gpus N with N >= 2")
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
    if args.gpus > 1:
        return _main_dp(args, systems, depths, results, write_results)
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


def _main_dp(args, systems: list[str], depths: list, results: list[dict], write_results) -> int:
    """--gpus N > 1: every system with N ranks (the whole-on-GPU bound per --resident-mode), megatrain on one GPU
    first with --scaling; results.md holds the data-parallel tables (multi_gpu), the scaling lines and settings."""
    n = args.gpus

    def record(res: dict) -> None:
        tqdm.write(report_line(res))
        results.append(res)
        write_results()

    def probe(res: dict) -> None:
        results.append(res)
        write_results()

    for layers in depths:
        if args.scaling and "megatrain" in systems and not args.best_batch:
            tag = f"megatrain_L{layers or 'default'}_{args.tokens_per_step}_g1"
            res = run_one("megatrain", args, layers, args.tokens_per_step, os.path.join(args.out, tag + ".json"), 1)
            res["gpus"] = 1
            record(res)
        for system in systems:
            if args.best_batch:
                best_batch(system, args, layers, args.out, on_probe=probe)
                write_results()
            elif system == "resident":
                record(run_resident_bound(args, layers, args.tokens_per_step, args.out, n))
            else:
                tag = f"{system}_L{layers or 'default'}_{args.tokens_per_step}_g{n}"
                record(run_one(system, args, layers, args.tokens_per_step, os.path.join(args.out, tag + ".json")))
    for r in results:
        r["file"] = "results"  # one h2h call: the scaling pair is matched within it
    scaling = multi_gpu.scaling(results)
    lines = multi_gpu.scaling_lines(results)
    if lines:
        tqdm.write(lines)
    ok = [r for r in results if r.get("status") == "ok"]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"Data parallel, {n} GPUs: tokens/s summed over the ranks (tokens per rank × N / rank 0's median "
                "step), TFLOPS per GPU, host RSS summed over the ranks' processes.\n\n")
        f.write(multi_gpu.throughput_table(results) + "\n\n")
        if lines:
            f.write(lines + "\n\n")
        f.write(multi_gpu.breakdown_table(ok) + "\n")
        if args.best_batch:
            f.write("\n" + best_vs_best_table([r for r in ok if r.get("best_batch")]) + "\n")
        f.write("\nSettings:\n\n" + report.settings_lines(results) + "\n")
        f.write("\nLaunch commands:\n\n" + "\n".join(f"- {r['name']}: `{r['launch']['command']}` "
                                                     f"(OMP_NUM_THREADS={r['launch']['OMP_NUM_THREADS']}, "
                                                     f"rank cpus {r['launch']['H2H_RANK_CPUS']})"
                                                     for r in results if r.get("launch")) + "\n")
        for r in results:
            if r.get("status") != "ok":
                f.write(f"\n- {report_line(r)}")
    with open(os.path.join(args.out, "results.json")) as f:
        data = json.load(f)
    data["scaling"] = scaling
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    plot(results, os.path.join(args.out, "results.png"), depth_sweep=bool(args.depth_sweep))
    print(f"wrote {args.out}/results.json, results.md, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
