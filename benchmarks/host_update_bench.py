"""The host update of one layer, as the engine runs it, by state layout and block size ([Note:
blocked host update]).

    python -m benchmarks.host_update_bench --params 233e6 --blocks 262144,1048576,4194304,16777216
        --repeats 5

For each layout (where the landing gradient and the master live, whether a separate compute-dtype
wire copy is written), the whole-layer passes (what the engine did before host_update.py: convert,
fused AdamW, copy back, refresh) and ``update_segment`` at each block size, on the engine's host
threads (torch's intra-op pool; ``--threads``), in Gparam/s (median of --repeats). The all-fp32 row
with no wire is the one fused call the default (fp32 master streamed, fp32 landing) runs: the
ceiling the blocked layouts approach.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatrain_ds.optim import host_update
from megatrain_ds.optim.host_update import adamw_scalars, fused_adam, update_segment

LAYOUTS = {  # name: (grad dtype, master dtype, wire dtype or None)
    "fp32 grad, fp32 master (torch kernel default)": (torch.float32, torch.float32, None),
    "bf16 grad, fp32 master (native default)": (torch.bfloat16, torch.float32, None),
    "bf16 grad, fp32 master, bf16 wire": (torch.bfloat16, torch.float32, torch.bfloat16),
    "fp32 grad, fp32 master, bf16 wire": (torch.float32, torch.float32, torch.bfloat16),
    "bf16 grad, bf16 master (bf16-master mode)": (torch.bfloat16, torch.bfloat16, None),
}
STATES = {  # --phases --state: name -> (master dtype, moments dtype); the gradient lands in bf16
    "fp32-master": (torch.float32, torch.float32),
    "bf16-master": (torch.bfloat16, torch.float32),
    "bf16-state": (torch.bfloat16, torch.bfloat16),
}
HP = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)


def _tensors(n: int, grad_dtype, master_dtype, wire_dtype):
    master = (torch.randn(n) * 0.02).to(master_dtype)
    grad = (torch.randn(n) * 1e-3).to(grad_dtype)
    m, v = torch.randn(n) * 1e-4, torch.rand(n) * 1e-7
    wire = torch.empty(n, dtype=wire_dtype) if wire_dtype is not None else None
    return master, grad, m, v, wire


def _passes(master, grad, m, v, wire, scratch_g, scratch_m, coef):
    n = master.numel()
    g = scratch_g[:n].copy_(grad) if grad.dtype != torch.float32 else grad
    w = scratch_m[:n].copy_(master) if master.dtype != torch.float32 else master
    step, scale = adamw_scalars(HP, coef, master.device)
    fused_adam([w], [g], [m], [v], HP, step, scale, True)
    if master.dtype != torch.float32:
        master.copy_(w)
    if wire is not None:
        wire.copy_(master)


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--params", type=float, default=233e6, help="one layer's trainable parameters (7B: 233e6)"
    )
    p.add_argument("--blocks", default="262144,1048576,4194304,16777216")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    p.add_argument("--coef", type=float, default=0.37, help="clip coefficient (1.0: none)")
    p.add_argument(
        "--native-threads",
        default=None,
        metavar="N,N,...",
        help="only: the native kernel's Gparam/s at each thread count (bf16 grad, fp32 master, no "
        "wire)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="only: the whole native update against its two passes ([Note: deferred moments] in "
        "host_update.py), bf16 grad, by --state and --native-threads (default: torch's threads)",
    )
    p.add_argument(
        "--state",
        default="fp32-master",
        metavar="NAME,NAME,...",
        help="with --phases: the layouts, of "
        + ", ".join(STATES)
        + " (bf16-state: bf16 masters and "
        "bf16 moments, [Note: compact moments])",
    )
    p.add_argument(
        "--engine-buffers",
        action="store_true",
        help="with --phases: the state in the engine's host buffers (host_memory.host_buffer: "
        "huge-page "
        "mappings, the master page-locked) instead of torch's allocator",
    )
    p.add_argument(
        "--h2d-load",
        action="store_true",
        help="with --phases, CUDA: also time each pass while a side stream copies 1 GiB of pinned "
        "host "
        "memory to the GPU over and over (the forward's H2D of the masters during the update)",
    )
    p.add_argument(
        "--tail-forms",
        action="store_true",
        help="only: which fusion of torch's scalar tail loop this torch build has "
        "(csrc/host_adam.c's "
        "tail forms; the engine does those elements with torch's own kernel)",
    )
    args = p.parse_args(argv)
    if args.tail_forms:
        return _tail_forms()
    if args.phases:
        counts = (
            [int(t) for t in args.native_threads.split(",")]
            if args.native_threads
            else [torch.get_num_threads()]
        )
        return _phases(int(args.params), counts, args)
    if args.native_threads:
        return _native_threads(
            int(args.params), [int(t) for t in args.native_threads.split(",")], args
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    blocks = [int(b) for b in args.blocks.split(",")]
    scratch_g, scratch_m = torch.empty(n), torch.empty(n)
    print(
        f"host update of {n / 1e6:.0f} M params, {torch.get_num_threads()} threads, coef "
        f"{args.coef}: Gparam/s"
    )
    native = host_update.native_library() is not None
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        "native kernel: " + ("built" if native else f"not built ({host_update.native_error()})")
    )
    if native:
        print(
            "native vs torch's fused kernel, one step on the same values (1M + 13 elements): "
            + _exactness()
        )
    print(
        f"{'layout':<46}{'passes':>9}"
        + "".join(f"{'blk ' + str(b >> 10) + 'K':>11}" for b in blocks)
        + (f"{'native':>9}" if native else "")
    )
    for name, dtypes in LAYOUTS.items():
        t = _tensors(n, *dtypes)
        row = [_median_s(lambda: _passes(*t, scratch_g, scratch_m, args.coef), args.repeats)]
        for b in blocks:
            row.append(
                _median_s(
                    lambda: update_segment(
                        t[0],
                        t[1],
                        t[2],
                        t[3],
                        0,
                        n,
                        HP,
                        args.coef,
                        True,
                        t[4],
                        scratch_g,
                        scratch_m,
                        block=b,
                    ),
                    args.repeats,
                )
            )
        if native:
            row.append(
                _median_s(
                    lambda: host_update.native_adam(
                        t[0], t[1], t[2], t[3], HP, args.coef, True, wire=t[4]
                    ),
                    args.repeats,
                )
            )
        print(
            f"{name:<46}"
            + "".join(
                f"{n / s / 1e9:>{9 if k in (0, len(blocks) + 1) else 11}.2f}"
                for k, s in enumerate(row)
            ),
            flush=True,
        )
    _rollback(n, args, native)
    return 0


def _rollback(n: int, args, native: bool) -> None:
    """A speculative step undone (clipping fired after the layer was stepped):
    speculation.adamw_undo in float64 chunks plus the wire refresh, against the native undo ([Note:
    native rollback]), bf16 gradient + bf16 wire."""
    from megatrain_ds.optim.speculation import adamw_undo

    master, grad, m, v, wire = _tensors(n, torch.bfloat16, torch.float32, torch.bfloat16)
    scratch = torch.empty(n)
    row = {
        "adamw_undo + refresh": _median_s(
            lambda: (
                adamw_undo(master, scratch.copy_(grad), m, v, HP, args.coef, True),
                wire.copy_(master),
            ),
            args.repeats,
        )
    }
    if native:
        row["native undo"] = _median_s(
            lambda: host_update.native_adam_undo(
                master, grad, m, v, HP, args.coef, True, wire=wire
            ),
            args.repeats,
        )
    print(
        "rollback of one step, Gparam/s: "
        + ", ".join(f"{k} {n / s / 1e9:.2f}" for k, s in row.items())
    )


def _phases(n: int, counts: list[int], args) -> int:
    """Gparam/s of the whole update and of its weights and moments passes (the forward waits only
    for the first), for each ``--state`` layout."""
    for name in args.state.split(","):
        if name not in STATES:
            raise SystemExit(f"--state: unknown layout {name!r} (known: {', '.join(STATES)})")
        master_dtype, moments_dtype = STATES[name]
        master, grad, m, v, _ = _tensors(n, torch.bfloat16, master_dtype, None)
        t = (master, grad, m.to(moments_dtype), v.to(moments_dtype))
        where, regions = "torch's allocator", []
        if args.engine_buffers:
            from megatrain_ds.host.host_memory import host_buffer

            t = tuple(
                host_buffer(n, x.dtype, pin=k == 0, regions=regions).copy_(x)
                for k, x in enumerate(t)
            )
            where = "the engine's host buffers (master pinned)"
        loads = [False, True] if args.h2d_load and torch.cuda.is_available() else [False]
        print(
            f"native host update, {n / 1e6:.0f} M params, {name} (bf16 grad, {master_dtype} "
            "master, "
            f"{moments_dtype} moments), coef {args.coef}, {where}: Gparam/s (whole | weights pass "
            "| moments pass | "
            "both passes)"
        )
        for load in loads:
            stop = _h2d_load() if load else None
            for k in counts:
                s = [
                    _median_s(
                        lambda t=t, k=k, ph=ph: host_update.native_adam(
                            t[0], t[1], t[2], t[3], HP, args.coef, True, threads=k, phase=ph
                        ),
                        args.repeats,
                    )
                    for ph in (
                        host_update.PHASE_WHOLE,
                        host_update.PHASE_WEIGHTS,
                        host_update.PHASE_MOMENTS,
                    )
                ]
                print(
                    f"  {k:3d} threads{' + H2D load' if load else ''}: {n / s[0] / 1e9:.2f} | "
                    f"{n / s[1] / 1e9:.2f} | "
                    f"{n / s[2] / 1e9:.2f} | {n / (s[1] + s[2]) / 1e9:.2f}",
                    flush=True,
                )
            if stop is not None:
                print(f"  (H2D load: {stop():.1f} GB/s while it ran)")
        # unpinned before the next layout's buffers (a new mapping may reuse a registered address:
        # CUDA error 712)
        from megatrain_ds.host.host_memory import release_all

        del t
        release_all(regions)
    return 0


def _h2d_load():
    """Start copying 1 GiB of pinned host memory to the GPU in a loop on a side stream; returns
    stop() -> GB/s."""
    import threading
    import time

    src = torch.ones(1 << 28, dtype=torch.float32).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    stream, done, copied = torch.cuda.Stream(), threading.Event(), [0, time.perf_counter()]

    def loop():
        with torch.cuda.stream(stream):
            while not done.is_set():
                dst.copy_(src, non_blocking=True)
                stream.synchronize()
                copied[0] += src.numel() * 4

    th = threading.Thread(target=loop, daemon=True)
    th.start()

    def stop() -> float:
        done.set()
        th.join()
        return copied[0] / (time.perf_counter() - copied[1]) / 1e9

    return stop


def _native_threads(n: int, counts: list[int], args) -> int:
    """The default layout's update at each thread count: what megatrain.host_threads should be on
    this box."""
    t = _tensors(n, torch.bfloat16, torch.float32, None)
    print(
        f"native host update, {n / 1e6:.0f} M params, bf16 grad + fp32 master, coef {args.coef}: "
        "Gparam/s by threads"
    )
    for k in counts:
        s = _median_s(
            lambda: host_update.native_adam(t[0], t[1], t[2], t[3], HP, args.coef, True, threads=k),
            args.repeats,
        )
        print(f"  {k:3d} threads: {n / s / 1e9:.2f}", flush=True)
    return 0


def _tail_forms() -> int:
    """Elements differing from torch's kernel, for each tail_form (csrc/host_adam.c's tail_update):
    the one with 0 is this build's; none may be (AVX-512 builds), which is why the engine does them
    with torch's kernel."""
    cap = torch.backends.cpu.get_cpu_capability()
    print(
        f"torch {torch.__version__}, CPU capability {cap}: elements differing from torch's fused "
        "kernel by tail_form"
    )
    for form in range(16):
        if form & 3 == 3:
            continue
        print(f"  tail_form {form:2d}: {_exactness(form)}", flush=True)
    return 0


def _exactness(tail_form: int | None = None) -> str:
    """Elements differing from torch._fused_adamw_/_fused_adam_ (master, exp_avg, exp_avg_sq), over
    AdamW and Adam-L2, with and without a gradient scale, fp32/bf16/fp16 gradients."""
    differing, total = 0, 0
    n = (1 << 20) + 13
    for adam_w in (True, False):
        for coef in (1.0, 0.37):
            for gdt in (torch.float32, torch.bfloat16, torch.float16):
                torch.manual_seed(0)
                master, grad, m, v, _ = _tensors(n, gdt, torch.float32, None)
                want = [master.clone(), m.clone(), v.clone()]
                step, scale = adamw_scalars(HP, coef, master.device)
                fused_adam(
                    [want[0]], [grad.float().clone()], [want[1]], [want[2]], HP, step, scale, adam_w
                )
                host_update.native_adam(master, grad, m, v, HP, coef, adam_w, tail_form=tail_form)
                differing += sum(int((x != y).sum()) for x, y in zip((master, m, v), want))
                total += 3 * n
    return f"{differing} of {total} differ" + (" (bit-identical)" if differing == 0 else "")


if __name__ == "__main__":
    raise SystemExit(main())
