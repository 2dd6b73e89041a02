"""Head-to-head: megatrain_ds vs DeepSpeed ZeRO-3 CPU offload vs the whole model on the GPU, one
command.

    python -m benchmarks.h2h --model qwen2.5-3b --tokens-per-step 16384 --out runs/3b
    python -m benchmarks.h2h --model qwen2.5-3b --best-batch --out runs/3b-best
    python -m benchmarks.h2h --model qwen2.5-14b --depth-sweep 28,56,84 --systems megatrain,zero3
        --out runs/sweep
    python -m benchmarks.h2h --model tiny --device cpu --systems megatrain,resident --seq 64 \
        --tokens-per-step 256 --out runs/h2h-smoke    # CPU smoke test
    python -m benchmarks.h2h --model qwen2.5-3b --gpus 2 --scaling --tokens-per-step 16384
        --out runs/dp
        # data parallel: every system with 2 ranks (torchrun), plus megatrain on 1 GPU for the
        # scaling ratio
    python -m benchmarks.h2h --model qwen2.5-3b --gpus 2 --nodes 2 --systems megatrain
        --out runs/nodes
        # two torchrun "nodes" of one GPU each on this box (--nnodes 2 over localhost; NCCL over
        # sockets between them)
    python -m benchmarks.h2h --model qwen2.5-72b --lora 16 --systems megatrain,zero3
        --out runs/72b-lora
        # LoRA r16 (alpha 32) on q,k,v,o,gate,up,down: frozen bf16 base, only the adapters train
    python -m benchmarks.h2h --model olmoe-1b-7b --systems megatrain,zero3 --liger off
        --out runs/moe
        # mixture of experts, full fine-tuning, router aux loss in the loss

LoRA (``--lora R``, ``--lora-targets``): megatrain and ZeRO-3 wrap the same model with peft
(benchmarks.build); the base is frozen and built in bf16 (megatrain: never upcast; ZeRO-3: under
zero.Init, partitioned as constructed), FLOPs by the LoRA formula of benchmarks.shapes (4 N + 6
N_lora + 6 L h s). Every result records trainable_params, base_params, host_bytes_per_base_param
(peak RSS / base parameters) and, for megatrain, engine_host_bytes_per_base_param (its host state /
base parameters). ``--init`` picks megatrain's model init (benchmarks.build: hf, or fast = layer 0's
values repeated, the default from 14 B parameters: a 72B model builds in seconds, holding one layer
until the engine copies the layers). Each run records its phases (model built, engine initialized,
steps done: seconds and host RSS at each); a system whose process the kernel kills (host out of
memory) is recorded as "killed (host OOM)" with the peak RSS the harness saw and the phases it
reached, and the next system runs.

Data parallel (``--gpus N``, N > 1): every system runs as N processes, one per GPU, launched by
torchrun, each rank on its own micro-batch of ``--tokens-per-step`` tokens (per rank); megatrain_ds,
DeepSpeed ZeRO-3 (N ranks) and the whole-on-GPU bound (DDP over N ranks; ``--resident-mode``).
tokens/s is summed over the ranks (tokens per rank × N / rank 0's step time), TFLOPS are per GPU,
host RSS summed over the ranks' processes, also per parameter; ``--scaling`` adds megatrain on one
GPU and prints N GPUs / 1 GPU. Details: benchmarks/multi_gpu.py. ``--gpus 1`` (the default) is the
one-process harness, unchanged.

Fair peers (ANCHORS.md "Fair comparison rules"): every system trains with AdamW lr 1e-5, weight
decay 0.01, betas (0.9, 0.999), eps 1e-8, the same --clip, warm-up and measured steps; ``--liger``
gives all of them (or none) liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy
(ZeRO-3 and whole-on-GPU as HF Trainer's use_liger_kernel applies them); ``--gpu-optimizer-fraction
F`` keeps the same share of optimizer state on the GPU for megatrain and ZeRO-3
(offload_optimizer.ratio = 1 - F). Each run records its settings under "settings", and results.md
shows one settings line per run.

Each system runs in its own process (``benchmarks.run_system``), one after another, on the same
model shape and data. Before a run, host memory is checked against what the system needs
(bytes/param below) and the run is skipped with the numbers when it does not fit; a device OOM is
recorded as "oom", not a crash. Writes ``results.json`` (per run: tokens_per_s, tflops,
peak_gpu_bytes, peak_host_rss_bytes, host_bytes_per_param, breakdown where the system has one; plus
the hardware), ``results.md`` (tables) and ``results.png`` (plot).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from tqdm import tqdm

from benchmarks import h2h_args, multi_gpu, report
from benchmarks.common import (
    PHASE_TAG,
    PROGRESS_TAG,
    allocator_line,
    free_port,
    peak_host_rss_bytes,
)
from benchmarks.host_check import (
    hardware,
    host_precheck,
    host_snapshot,
    meminfo,
)
from benchmarks.report import best_vs_best_table, breakdown_line, plot, report_line
from benchmarks.shapes import make_config


def run_one(
    system: str, args, layers: int | None, tokens: int, path: str, gpus: int | None = None
) -> dict:
    """One system in its own process (``gpus`` > 1: torchrun with that many ranks, see run_dp);
    returns its result dict (or a 'skipped' record). ``gpus`` defaults to ``args.gpus``."""
    gpus = int(getattr(args, "gpus", 1) if gpus is None else gpus)
    config = make_config(args.model, layers=layers)
    why = host_precheck(system, args, config, tokens, gpus)
    if why is not None:
        skipped = {
            "system": system,
            "model": args.model,
            "layers": config.num_hidden_layers,
            "tokens_per_step": tokens,
            "status": "skipped",
            "error": why,
        }
        if gpus > 1:
            skipped.update(gpus=gpus, name=os.path.splitext(os.path.basename(path))[0])
        return skipped
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run_system",
        "--system",
        system,
        "--model",
        args.model,
        "--tokens-per-step",
        str(tokens),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
        "--json",
        path,
        "--progress",
        "--liger",
        args.liger,
        "--gpu-optimizer-fraction",
        repr(args.gpu_optimizer_fraction),
    ]
    if args.host_only:
        cmd.append("--host-only")
    if getattr(args, "closing_step", "full") != "full" and system == "megatrain":
        cmd += ["--closing-step", args.closing_step]
    if layers:
        cmd += ["--layers", str(layers)]
    if getattr(args, "lora", 0):
        cmd += ["--lora", str(args.lora), "--lora-targets", args.lora_targets]
    if getattr(args, "init", "auto") != "auto":
        cmd += ["--init", args.init]
    if getattr(args, "gpu_memory_limit", None) is not None:
        cmd += ["--gpu-memory-limit", repr(args.gpu_memory_limit)]
    if gpus > 1:
        bind = getattr(args, "bind_cores", "on") == "on"
        return run_dp(
            system,
            cmd[3:],
            config,
            tokens,
            path,
            gpus,
            bind_cores=bind,
            nodes=getattr(args, "nodes", 1),
        )
    # a stale file from an earlier run must not stand in for a process that died
    if os.path.exists(path):
        os.remove(path)
    watch: dict = {}
    # benchmarks.depth: the call's time left
    watch["timeout_s"] = getattr(args, "run_timeout_s", None)
    host_at_start = host_snapshot()
    tail = _run_with_progress(cmd, f"{system} L={config.num_hidden_layers} T={tokens}", watch=watch)
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    else:
        host = max(
            int(args.host_mem_gib * 2**30) if getattr(args, "host_mem_gib", None) else 0,
            meminfo("MemTotal"),
        )
        result = failed_run(system, args.model, config.num_hidden_layers, tokens, tail, watch, host)
    result["name"] = os.path.splitext(os.path.basename(path))[0]
    result["host_at_start"] = host_at_start
    return result


def failed_run(
    system: str,
    model: str,
    layers: int,
    tokens: int,
    tail: list[str],
    watch: dict,
    host_mem_bytes: int,
) -> dict:
    """The record of a system process that ended without writing its result: "interrupted (time
    limit or Ctrl-C)" when the driver was interrupted; "killed (host OOM)" when the kernel killed it
    (SIGKILL) and its OOM-kill counter rose during the run, or (counter unreadable) the process had
    used >= 80% of the host memory; "killed (SIGKILL)" / "killed (signal NAME)" otherwise; else
    "error". Keeps the peak RSS the driver saw, the phases the process reported, the step times it
    printed and the end of its output."""
    rc = watch.get("returncode")
    peak = int(watch.get("peak_rss_bytes") or 0)
    status = "error"
    if watch.get("timed_out"):
        status = f"timed out (stopped after {watch['timeout_s']:.0f} s)"
    elif watch.get("interrupted"):
        status = "interrupted (time limit or Ctrl-C)"
    elif rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        status = f"killed (signal {name})"
        if -rc == signal.SIGKILL:
            kills = watch.get("oom_kills")
            oom = (
                kills > 0
                if kills is not None
                else bool(host_mem_bytes) and peak >= 0.8 * host_mem_bytes
            )
            status = "killed (host OOM)" if oom else "killed (SIGKILL)"
    phases = watch.get("phases") or []
    last = phases[-1]["phase"] if phases else "none (it ended before the model was built)"
    return {
        "system": system,
        "model": model,
        "layers": layers,
        "tokens_per_step": tokens,
        "status": status,
        "returncode": rc,
        "error": "".join(tail)[-2000:],
        "peak_host_rss_bytes": peak,
        "peak_host_rss_bytes_seen_by": "benchmarks.h2h (VmHWM of the process, sampled every 0.5 s)",
        "host_mem_bytes": host_mem_bytes,
        "oom_kills_during_run": watch.get("oom_kills"),
        "last_phase": last,
        "phases": phases,
        # warm-up steps first, as the process printed them
        "step_times_s_seen": watch.get("step_times") or [],
    }


def run_dp(
    system: str,
    run_system_args: list[str],
    config,
    tokens: int,
    path: str,
    gpus: int,
    bind_cores: bool = True,
    nodes: int = 1,
) -> dict:
    """One system as ``gpus`` ranks under torchrun (``nodes`` > 1: that many torchrun launches on
    this box, each standing for a host: multi_gpu.node_launches); the ranks' JSONs (``<path
    stem>.rank<r>.json``) are combined by multi_gpu.aggregate into ``path``. The launch command,
    OMP_NUM_THREADS and the ranks' cores (``bind_cores``: multi_gpu.launch_env) are recorded."""
    for r in range(gpus):  # a stale file from an earlier run must not stand in for a rank that died
        if os.path.exists(multi_gpu.rank_json(path, r)):
            os.remove(multi_gpu.rank_json(path, r))
    cmd = multi_gpu.launch_cmd(sys.executable, gpus, run_system_args)
    env = multi_gpu.launch_env(gpus, bind=bind_cores)
    desc = (
        f"{system} ×{gpus}{f' ({nodes} nodes)' if nodes > 1 else ''} L={config.num_hidden_layers} "
        f"T={tokens}/rank"
    )
    if nodes > 1:
        launches = multi_gpu.node_launches(
            sys.executable, gpus, nodes, run_system_args, free_port(), env
        )
        cmd = launches[0][0]
        tail = _run_nodes(launches, desc, path)
    else:
        tail = _run_with_progress(cmd, desc, env=env)
    per_rank = []
    for r in range(gpus):
        if os.path.exists(multi_gpu.rank_json(path, r)):
            with open(multi_gpu.rank_json(path, r)) as f:
                per_rank.append(json.load(f))
    if per_rank:
        result = multi_gpu.aggregate(per_rank, gpus)
    else:
        result = {
            "system": system,
            "model": config.name_or_path,
            "layers": config.num_hidden_layers,
            "tokens_per_step": tokens,
            "gpus": gpus,
            "status": "error",
            "error": "".join(tail)[-2000:],
        }
    if result.get("status") != "ok" and tail:
        result["launcher_tail"] = "".join(tail)[-2000:]
    result["launch"] = {
        "command": multi_gpu.recorded_cmd(cmd, path),
        "OMP_NUM_THREADS": env["OMP_NUM_THREADS"],
        "H2H_RANK_CPUS": env.get("H2H_RANK_CPUS", "not bound"),
    }
    # (the command is node 0's; node r: --node_rank r, its GPU block, NCCL_HOSTID h2h-node<r>)
    if nodes > 1:
        result["launch"]["nodes"] = nodes
        result["nodes"] = nodes
    result["name"] = os.path.splitext(os.path.basename(path))[0]
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    return result


def _run_nodes(launches: list[tuple[list[str], dict]], desc: str, path: str) -> list[str]:
    """``h2h --nodes``: nodes 1.. in the background (their output in ``<path stem>.node<r>.log``),
    node 0 with the progress bar; returns node 0's last lines. A node still running 60 s after node
    0 ended is stopped."""
    stem = os.path.splitext(path)[0]
    others = []
    for node, (cmd, env) in enumerate(launches[1:], start=1):
        with open(f"{stem}.node{node}.log", "w") as log:
            others.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        tail = _run_with_progress(launches[0][0], desc, env=launches[0][1])
    finally:
        for proc in others:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return tail


def run_resident_bound(args, layers: int | None, tokens: int, out: str, gpus: int) -> dict:
    """The whole-on-GPU bound for ``gpus`` GPUs (``--resident-mode``): DDP over the ranks ("ddp"),
    one GPU's tokens/s × N ("single"), or DDP and, if DDP runs out of memory, one GPU × N
    ("auto")."""
    tag = f"resident_L{layers or 'default'}_{tokens}"
    if args.resident_mode in ("auto", "ddp"):
        res = run_one(
            "resident", args, layers, tokens, os.path.join(out, f"{tag}_g{gpus}.json"), gpus
        )
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


def _oom_kills() -> int | None:
    """The kernel's count of OOM kills so far (``oom_kill`` of /proc/vmstat; None where
    unreadable)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _sample_peak_rss(proc: subprocess.Popen, watch: dict, period_s: float = 0.5) -> None:
    """Until ``proc`` ends: watch["peak_rss_bytes"] = the largest VmHWM read (what is left when it
    is killed)."""
    while proc.poll() is None:
        watch["peak_rss_bytes"] = max(watch.get("peak_rss_bytes", 0), peak_host_rss_bytes(proc.pid))
        try:
            proc.wait(timeout=period_s)
        except subprocess.TimeoutExpired:
            pass


def _run_with_progress(
    cmd: list[str], desc: str, env: dict | None = None, watch: dict | None = None
) -> list[str]:
    """Run one system's process; its per-step lines drive a progress bar (the first step includes
    the model build and warm-up). Returns the last lines of its other output (stdout and stderr) for
    error reports. ``watch`` (a dict, filled in): returncode, phases (the process's ``@@h2h-phase``
    records), peak_rss_bytes (sampled) and oom_kills (the kernel's OOM kills during the run; None
    where unreadable)."""
    from collections import deque

    watch = {} if watch is None else watch
    watch["phases"] = []
    tail: deque[str] = deque(maxlen=200)
    bar = tqdm(
        desc=desc,
        unit="step",
        leave=True,
        bar_format="{desc}: {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]",
    )
    bar.set_postfix_str("building the model")
    kills_before = _oom_kills()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    )
    timer = None
    if watch.get("timeout_s"):  # SIGINT, then SIGKILL 20 s later if it is still there

        def stop() -> None:
            watch["timed_out"] = True
            proc.send_signal(signal.SIGINT)
            kill = threading.Timer(20, lambda: proc.poll() is None and proc.kill())
            kill.daemon = True
            kill.start()

        timer = threading.Timer(float(watch["timeout_s"]), stop)
        timer.daemon = True
        timer.start()
    sampler = threading.Thread(target=_sample_peak_rss, args=(proc, watch), daemon=True)
    sampler.start()
    assert proc.stdout is not None
    watch["step_times"] = []
    try:
        for line in proc.stdout:
            if PHASE_TAG in line:
                head, _, rest = line.partition(PHASE_TAG)
                if head.strip():
                    tail.append(head + "\n")
                try:
                    phase = json.loads(rest)
                except json.JSONDecodeError:
                    tail.append(line)
                    continue
                watch["phases"].append(phase)
                bar.set_postfix_str(
                    f"{phase['phase']} after {phase['phase_s']:.1f} s, host RSS "
                    f"{phase['rss_bytes'] / 1e9:.1f} GB",
                    refresh=True,
                )
            # anywhere: a child's partial stderr line (no newline yet) may precede it
            elif PROGRESS_TAG in line:
                head, _, rest = line.partition(PROGRESS_TAG)
                if head.strip():
                    tail.append(head + "\n")
                done, total, seconds = rest.split()[:3]
                bar.total = int(total)
                bar.n = int(done)
                watch["step_times"].append(float(seconds))
                bar.set_postfix_str(f"last step {float(seconds):.2f} s", refresh=False)
                bar.refresh()
            else:
                tail.append(line)
    # h2h's time limit (phase_lib's timeout --signal=INT) or Ctrl-C: the child got it too
    except KeyboardInterrupt:
        _interrupted(proc, watch)
    try:
        watch["returncode"] = proc.wait()
    # the same after the child's output ended: its teardown (ZeRO-3 at 7B, holding 191 GB of host
    # memory: 8-19 s after its steps, 2026-11-30), when it may have written its result already
    except KeyboardInterrupt:
        _interrupted(proc, watch)
        watch["returncode"] = proc.wait()
    if timer is not None:
        timer.cancel()
    sampler.join()
    kills_after = _oom_kills()
    watch["oom_kills"] = (
        None if kills_before is None or kills_after is None else kills_after - kills_before
    )
    bar.close()
    return list(tail)


def _interrupted(proc: subprocess.Popen, watch: dict) -> None:
    """The driver was interrupted: the child (same process group) was too; 10 s to exit, then
    killed."""
    watch["interrupted"] = True
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def best_batch(system: str, args, layers: int | None, out: str, on_probe=lambda res: None) -> dict:
    """Double the tokens per step from ``--min-tokens`` (default one sequence) until the system runs
    out of memory or passes ``--max-tokens``; every probe goes to ``on_probe``; the fastest gets
    ``best_batch: True``."""
    best, tokens = None, max(args.seq, args.min_tokens // args.seq * args.seq)
    while tokens <= args.max_tokens:
        res = run_one(
            system, args, layers, tokens, os.path.join(out, f"{system}_best_{tokens}.json")
        )
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


def main(argv: list[str] | None = None) -> int:
    args, systems, depths = h2h_args.parse(argv, __doc__)
    os.makedirs(args.out, exist_ok=True)
    results = []
    results_path = os.path.join(args.out, "results.json")
    recorded = [
        os.path.basename(a) if a == args.out else a
        for a in (sys.argv[1:] if argv is None else argv)
    ]

    def write_results() -> None:  # after every run: a harness killed mid-way keeps what it measured
        with open(results_path + ".tmp", "w") as f:
            json.dump(
                {"hardware": info, "argv": recorded, "results": results}, f, indent=2, default=str
            )
        os.replace(results_path + ".tmp", results_path)

    info = hardware()
    if args.gpus > 1:
        return _main_dp(args, systems, depths, results, write_results)
    for layers in depths:
        for system in systems:
            if args.best_batch:  # every probe is recorded; the fastest is marked best_batch
                best_batch(
                    system,
                    args,
                    layers,
                    args.out,
                    on_probe=lambda res: (results.append(res), write_results()),
                )
                write_results()
            else:
                tag = f"{system}_L{layers or 'default'}_{args.tokens_per_step}"
                res = run_one(
                    system,
                    args,
                    layers,
                    args.tokens_per_step,
                    os.path.join(args.out, tag + ".json"),
                )
                tqdm.write(report_line(res))
                if breakdown_line(res):
                    tqdm.write(breakdown_line(res))
                if allocator_line(res):
                    tqdm.write(allocator_line(res))
                results.append(res)
                write_results()
                # recorded; the rest is not run
                if str(res.get("status")).startswith("interrupted"):
                    tqdm.write(f"interrupted: {results_path} holds the runs so far")
                    return 130
    ok = [r for r in results if r.get("status") == "ok"]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report.throughput_table(ok) + "\n\n" + report.breakdown_table(ok) + "\n")
        if any("base_params" in r or "last_phase" in r for r in results):
            f.write("\n" + report.memory_table(results) + "\n")
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
    """--gpus N > 1: every system with N ranks (the whole-on-GPU bound per --resident-mode),
    megatrain on one GPU first with --scaling; results.md holds the data-parallel tables
    (multi_gpu), the scaling lines and settings."""
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
            res = run_one(
                "megatrain",
                args,
                layers,
                args.tokens_per_step,
                os.path.join(args.out, tag + ".json"),
                1,
            )
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
                record(
                    run_one(
                        system,
                        args,
                        layers,
                        args.tokens_per_step,
                        os.path.join(args.out, tag + ".json"),
                    )
                )
    for r in results:
        r["file"] = "results"  # one h2h call: the scaling pair is matched within it
    scaling = multi_gpu.scaling(results)
    lines = multi_gpu.scaling_lines(results)
    if lines:
        tqdm.write(lines)
    ok = [r for r in results if r.get("status") == "ok"]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(
            f"Data parallel, {n} GPUs: tokens/s summed over the ranks (tokens per rank × N / rank "
            "0's median "
            "step), TFLOPS per GPU, host RSS summed over the ranks' processes.\n\n"
        )
        f.write(multi_gpu.throughput_table(results) + "\n\n")
        if lines:
            f.write(lines + "\n\n")
        f.write(multi_gpu.breakdown_table(ok) + "\n")
        if args.best_batch:
            f.write("\n" + best_vs_best_table([r for r in ok if r.get("best_batch")]) + "\n")
        f.write("\nSettings:\n\n" + report.settings_lines(results) + "\n")
        f.write(
            "\nLaunch commands:\n\n"
            + "\n".join(
                f"- {r['name']}: `{r['launch']['command']}` "
                f"(OMP_NUM_THREADS={r['launch']['OMP_NUM_THREADS']}, "
                f"rank cpus {r['launch']['H2H_RANK_CPUS']})"
                for r in results
                if r.get("launch")
            )
            + "\n"
        )
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
