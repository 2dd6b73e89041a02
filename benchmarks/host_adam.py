"""How fast can this host run AdamW, and is it bound by memory bandwidth or by cores?

    python -m benchmarks.host_adam --gparams 1.0 --threads 8,16,32,64

With every persistent tensor on the host, the CPU AdamW after the last gradient is the step's serial tail at
small batches (14B, 16K tokens/step: 2.7 s of a 6.1 s step on 64 cores). This prints, for each thread count:
torch's fused CPU AdamW (what megatrain_ds runs) and DeepSpeedCPUAdam (when its op builds) in Gparam/s, the
bytes/s that implies (28 bytes/param: read param, grad, m, v; write param, m, v), and a plain copy's bandwidth
(read + write) for comparison (neither counts write-allocate reads). If AdamW's bytes/s is near the copy's and flat in threads, it is
bandwidth-bound: more cores will not help, fewer bytes (or moving state to the GPU) will.
Units: Gparam/s = 1e9 parameters per second, GB/s = 1e9 bytes per second.
"""
from __future__ import annotations

import argparse
import time

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
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.01,
                            eps=1e-8, amsgrad=False, maximize=False, grad_scale=None, found_inf=None)

    return _best_time(run, repeats)


def ds_cpu_adam_step(n: int):
    """A DeepSpeedCPUAdam over one n-element parameter, as a zero-argument step; None if its op does not build."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = torch.nn.Parameter(torch.randn(n) * 0.01)
        p.grad = torch.randn(n) * 0.01
        opt = DeepSpeedCPUAdam([p], lr=1e-5, weight_decay=0.01, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - the op may not build here; report and go on
        print(f"DeepSpeedCPUAdam unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return None
    return opt.step


def copy_seconds(n: int, repeats: int) -> float:
    src, dst = torch.randn(n), torch.empty(n)
    return _best_time(lambda: dst.copy_(src), repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gparams", type=float, default=0.5, help="parameters per update, in billions")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: all cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam (its op JIT-builds once)")
    args = p.parse_args(argv)
    n = int(args.gparams * 1e9)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    ds_step = None if args.no_deepspeed else ds_cpu_adam_step(n)
    print(f"{n / 1e9:.2f} G params, fp32; torch {torch.__version__}")
    print("| threads | torch fused AdamW Gparam/s | its GB/s (28 B/param) | DeepSpeedCPUAdam Gparam/s | copy GB/s |")
    print("|---|---|---|---|---|")
    for t in threads:
        torch.set_num_threads(t)  # also the OpenMP thread count DeepSpeed's op uses
        fused = fused_adamw_seconds(n, args.repeats)
        ds_cell = f"{n / _best_time(ds_step, args.repeats) / 1e9:.3g}" if ds_step else "–"
        copy = copy_seconds(n, args.repeats)
        # 3 significant digits: a slow or tiny run still prints a nonzero rate
        print(f"| {t} | {n / fused / 1e9:.3g} | {n * ADAM_BYTES_PER_PARAM / fused / 1e9:.3g} | {ds_cell} | "
              f"{2 * 4 * n / copy / 1e9:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
