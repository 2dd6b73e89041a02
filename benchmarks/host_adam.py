"""How fast can this host run AdamW, and is it bound by memory bandwidth or by cores?

    python -m benchmarks.host_adam --gparams 1.0 --threads 8,16,32,64

With every persistent tensor on the host, the CPU AdamW after the last gradient is the step's serial
tail at small batches (14B, 16K tokens/step: 2.7 s of a 6.1 s step on 64 cores). This prints, for
each thread count: torch's fused CPU AdamW (what megatrain_ds runs) and DeepSpeedCPUAdam (when its
op builds) in Gparam/s, the bytes/s that implies (28 bytes/param: read param, grad, m, v; write
param, m, v), and a plain copy's bandwidth (read + write) for comparison (neither counts
write-allocate reads). If AdamW's bytes/s is near the copy's and flat in threads, it is
bandwidth-bound: more cores will not help, fewer bytes (or moving state to the GPU) will. Units:
Gparam/s = 1e9 parameters per second, GB/s = 1e9 bytes per second.

    python -m benchmarks.host_adam --sweep --params 300e6

The placement sweep (the measurement behind megatrain_ds/host/placement.py, docs/placement.md): the
fused AdamW runs on a host worker thread, as in training, for thread counts 1, 2, 4, 8, all-1, all;
each unpinned (torch.set_num_threads only) and pinned (placement.apply_placement: the worker's mask,
which its OpenMP threads inherit; the main thread on the core the plan keeps for it), each with the
main thread idle and busy (a Python loop launching small torch ops, on the GPU when there is one:
its per-iteration latency p50/p99 shows how much the optimizer's threads preempt it). Gparam/s is
the median over --runs steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ADAM_BYTES_PER_PARAM = 28


def _best_time(fn, repeats: int) -> float:
    fn()  # first touch / warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fused_adamw_seconds(n: int, repeats: int) -> float:
    p, g, m, v = (torch.randn(n) * 0.01 for _ in range(4))
    v.abs_()
    step = torch.tensor(1.0)

    def run():
        torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            [step],
            lr=1e-5,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.01,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )

    return _best_time(run, repeats)


def ds_cpu_adam_step(n: int):
    """A DeepSpeedCPUAdam over one n-element parameter, as a zero-argument step; None if its op does
    not build."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.randn(n) * 0.01)
        p.grad = torch.randn(n) * 0.01
        opt = DeepSpeedCPUAdam([p], lr=1e-5, weight_decay=0.01, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - the op may not build here; report and go on
        print(
            f"DeepSpeedCPUAdam unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        )
        return None
    return opt.step


def copy_seconds(n: int, repeats: int) -> float:
    src, dst = torch.randn(n), torch.empty(n)
    return _best_time(lambda: dst.copy_(src), repeats)


def _adam_tensors(n: int):
    p, g, m, v = (torch.randn(n) * 0.01 for _ in range(4))
    v.abs_()
    return p, g, m, v, torch.tensor(1.0)


def _adam_step(t) -> None:
    p, g, m, v, step = t
    torch._fused_adamw_(
        [p],
        [g],
        [m],
        [v],
        [],
        [step],
        lr=1e-5,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.01,
        eps=1e-8,
        amsgrad=False,
        maximize=False,
        grad_scale=None,
        found_inf=None,
    )


def _main_loop(device: torch.device, until) -> list[float]:
    """The main thread's stand-in: launch a tiny op per iteration until ``until()``; per-iteration
    seconds."""
    x = torch.zeros(16, device=device)
    lat = []
    while not until():
        t0 = time.perf_counter()
        x.add_(1.0)
        lat.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def sweep_thread_counts(total: int) -> list[int]:
    return sorted({t for t in (1, 2, 4, 8, total - 1, total) if 1 <= t <= total})


def sweep(
    n: int, runs: int = 5, threads: list[int] | None = None, device: str = "auto"
) -> list[dict]:
    """One row per (threads, pinned, main idle/busy), plus a main-alone baseline row (threads 0)."""
    from megatrain_ds.host import placement as pl

    dev = torch.device(
        "cuda"
        if device == "auto" and torch.cuda.is_available()
        else ("cpu" if device == "auto" else device)
    )
    topo = pl.host_topology()
    total = len(topo["cpus"])
    node = pl.gpu_numa_node(dev.index or 0) if dev.type == "cuda" else None
    main_cores = pl.plan_placement(topo, node, reserve_main=1).main_cores
    tensors = _adam_tensors(n)
    torch.get_num_threads()  # the main thread's own OpenMP count stays as it is (see placement.py)
    rows = []
    deadline = time.perf_counter() + 0.2
    lat = _main_loop(dev, lambda: time.perf_counter() > deadline)
    rows.append(
        dict(
            threads=0,
            pinned=False,
            cores="-",
            main="busy",
            gparams=None,
            p50=_pct(lat, 0.5),
            p99=_pct(lat, 0.99),
            max=max(lat),
        )
    )
    for t in threads or sweep_thread_counts(total):
        for pinned in (False, True):
            # all cores: the worker's mask includes the main thread's core (reserve nothing)
            plan = pl.plan_placement(topo, node, reserve_main=0 if t >= total else 1, threads=t)
            for main in ("idle", "busy"):
                if pinned:
                    init, initargs = pl.apply_placement, (plan,)
                else:
                    init, initargs = torch.set_num_threads, (t,)
                worker = ThreadPoolExecutor(
                    1, thread_name_prefix="adam-sweep", initializer=init, initargs=initargs
                )
                previous = None
                try:
                    if pinned and main_cores:
                        previous = os.sched_getaffinity(0)
                        os.sched_setaffinity(0, main_cores)

                    def job():
                        _adam_step(tensors)  # warm-up: the worker's OpenMP team is created here
                        times = []
                        for _ in range(runs):
                            t0 = time.perf_counter()
                            _adam_step(tensors)
                            times.append(time.perf_counter() - t0)
                        return times

                    fut = worker.submit(job)
                    lat = _main_loop(dev, fut.done) if main == "busy" else []
                    times = fut.result()
                finally:
                    worker.shutdown(wait=True)
                    if previous is not None:
                        os.sched_setaffinity(0, previous)
                rows.append(
                    dict(
                        threads=t,
                        pinned=pinned,
                        cores=_cpulist(plan.cores) if pinned else "any",
                        main=main,
                        gparams=n / statistics.median(times) / 1e9,
                        p50=_pct(lat, 0.5) if lat else None,
                        p99=_pct(lat, 0.99) if lat else None,
                        max=max(lat) if lat else None,
                    )
                )
    return rows


def _cpulist(cores) -> str:
    cores, out, i = sorted(cores), [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(f"{cores[i]}-{cores[j]}" if j > i else f"{cores[i]}")
        i = j + 1
    return ",".join(out)


def print_sweep(rows: list[dict], n: int) -> None:
    def us(x):
        return "–" if x is None else (f"{x * 1e6:.3g}" if x < 1e-3 else f"{x * 1e6:.0f}")

    print(
        "| threads | pinned | worker cores | main thread | fused AdamW Gparam/s (median) | GB/s | "
        "main loop p50 µs | p99 µs | max µs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = "–" if r["gparams"] is None else f"{r['gparams']:.3g}"
        gbs = "–" if r["gparams"] is None else f"{r['gparams'] * ADAM_BYTES_PER_PARAM:.3g}"
        t = "none (main alone)" if r["threads"] == 0 else str(r["threads"])
        print(
            f"| {t} | {'yes' if r['pinned'] else 'no'} | {r['cores']} | {r['main']} | {rate} | "
            f"{gbs} | "
            f"{us(r['p50'])} | {us(r['p99'])} | {us(r['max'])} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gparams", type=float, default=0.5, help="parameters per update, in billions")
    p.add_argument(
        "--threads", default=None, help="comma-separated thread counts (default: all cores)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam (its op JIT-builds once)"
    )
    p.add_argument(
        "--sweep", action="store_true", help="placement sweep: threads x pinned x main idle/busy"
    )
    p.add_argument(
        "--params",
        type=float,
        default=None,
        help="parameters per update (e.g. 300e6; overrides --gparams)",
    )
    p.add_argument(
        "--runs", type=int, default=5, help="--sweep: timed steps per configuration (median)"
    )
    p.add_argument(
        "--main-device",
        default="auto",
        help="--sweep: where the busy main thread launches its ops (auto: cuda when available)",
    )
    args = p.parse_args(argv)
    n = int(args.params) if args.params else int(args.gparams * 1e9)
    if args.sweep:
        from megatrain_ds.host import placement as pl

        topo = pl.host_topology()
        print(
            f"{n / 1e9:.3g} G params, fp32; torch {torch.__version__}; {len(topo['cpus'])} usable "
            "cpus, "
            f"NUMA nodes {{{', '.join(f'{k}: {_cpulist(v)}' for k, v in topo['nodes'].items())}}}, "
            f"SMT {'on' if topo['smt'] else 'off'}"
        )
        threads = [int(t) for t in args.threads.split(",")] if args.threads else None
        print_sweep(sweep(n, runs=args.runs, threads=threads, device=args.main_device), n)
        return 0
    threads = (
        [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    )
    ds_step = None if args.no_deepspeed else ds_cpu_adam_step(n)
    print(f"{n / 1e9:.2f} G params, fp32; torch {torch.__version__}")
    print(
        "| threads | torch fused AdamW Gparam/s | its GB/s (28 B/param) | DeepSpeedCPUAdam "
        "Gparam/s | copy GB/s |"
    )
    print("|---|---|---|---|---|")
    for t in threads:
        torch.set_num_threads(t)  # also the OpenMP thread count DeepSpeed's op uses
        fused = fused_adamw_seconds(n, args.repeats)
        ds_cell = f"{n / _best_time(ds_step, args.repeats) / 1e9:.3g}" if ds_step else "–"
        copy = copy_seconds(n, args.repeats)
        # 3 significant digits: a slow or tiny run still prints a nonzero rate
        print(
            f"| {t} | {n / fused / 1e9:.3g} | {n * ADAM_BYTES_PER_PARAM / fused / 1e9:.3g} | "
            f"{ds_cell} | "
            f"{2 * 4 * n / copy / 1e9:.3g} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
