"""One host update per layer segment, in cache-sized blocks: [Note: blocked host update].

[Note: blocked host update] torch's fused CPU AdamW (``torch._fused_adamw_``) wants the parameter,
gradient and moments in one dtype (fp32 here). Where the layer's state is not all fp32, the update
used to be a sequence of whole-layer passes over host memory: the bf16 gradient converted into an
fp32 scratch (write 4 B, read them back), in bf16-master mode the master copied into an fp32 scratch
and back (two more passes), and the compute-dtype wire copy refreshed from the master afterwards
(the master read again). Each extra pass costs DRAM bandwidth, which is what bounds the update.

Here the same kernel runs on blocks of ``BLOCK_ELEMENTS`` parameters, and each block's conversions
happen right before and after it: the fp32 scratch of a block stays in the CPU's caches, so the
layer's state crosses DRAM about once (gradient in its landing dtype, master, moments, wire copy
out). The arithmetic is the same kernel on the same values, elementwise, so the result is
**bit-identical** to the whole-layer passes (tests/unit/test_host_update.py). Where the state is all
fp32 and there is no separate wire copy, the kernel runs once on the whole segment, as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch


def _l3_bytes() -> int:
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        size = 0
    return size if size and size > 0 else 32 << 20


# Parameters per block: the two fp32 scratch blocks (gradient, bf16 master) stay in the last-level
# cache (the block is a 16th of it), as large as that allows up to 16 Mi: each block costs ~4 torch
# calls, each a parallel region over the host threads, so small blocks lose to their overhead
# (benchmarks/host_update_bench.py measures the rate against the block size). With a 300 MiB L3:
# 16 Mi; with a 32 MiB L3, 2 Mi.
BLOCK_ELEMENTS = max(1 << 20, min(1 << 24, _l3_bytes() // 16))


def adamw_scalars(
    hp: dict, coef: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused kernel's step tensor and gradient scale (it divides the gradients by ``1 / coef``).
    ``torch.full``, not ``torch.tensor``: on the GPU a fill kernel, where a tensor from a Python
    value is a blocking pageable copy."""
    step = torch.full((), float(hp["step"]), dtype=torch.float32, device=device)
    scale = None if coef == 1.0 else torch.full((), 1.0 / coef, dtype=torch.float32, device=device)
    return step, scale


def fused_adam(
    params: list,
    grads: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    hp: dict,
    step: torch.Tensor,
    scale: torch.Tensor | None,
    adam_w_mode: bool,
) -> None:
    fn = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fn(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [step] * len(params),
        lr=hp["lr"],
        beta1=hp["beta1"],
        beta2=hp["beta2"],
        weight_decay=hp["weight_decay"],
        eps=hp["eps"],
        amsgrad=False,
        maximize=False,
        grad_scale=scale,
        found_inf=None,
    )


# [Note: deferred moments] With exact clipping, every layer's update waits for the last gradient
# (the norm), and the next forward waits, layer by layer, for those updates: the update's bytes
# after the norm are the step's critical path. The forward needs only the new master (and its wire
# copy), not the new moments. So the update after the norm runs in two passes of the native kernel
# over the same values:
#
#   PHASE_WEIGHTS (the step's update task, forward order): reads the gradient, master and moments,
#       computes the new moments and master exactly as the whole update does, stores the master (and
#       wire copy) only: 2 + 4 + 4 + 4 + 4 = 18 B/param for a bf16 gradient and fp32 state (the
#       whole update: 26);
#   PHASE_MOMENTS (queued after the step's tasks, last layer first, under the next forward and
#       backward): reads the same gradient and moments, computes the new moments again, with the
#       same operations on the same values (so the same bits), and stores them: 2 + 8 + 8 = 18
#       B/param.
#
# 36 B/param in all instead of 26, but only 18 after the norm: the forward waits for about 70% of
# the bytes it waited for. The result is bit-identical to the whole update
# (tests/unit/test_host_update.py, tests/engine/test_deferred_moments.py). The gradient must stay as
# the weights pass read it until the moments pass: the next gradient of layer i is not written
# before that pass of layer i has run (``LayerSchedule.wait_moments``: the D2H into the gradient
# home, the landing thread's fold, each waiting for the pass that was due when its landing was
# queued: ``moments_of``), and everything that reads or replaces the moments (checkpoints, the GPU
# placement, a rollback, the next update) comes after it (engine.synchronize, the AdamW thread's
# FIFO). AdamW only: Adam's L2 term reads the old master, which the weights pass has overwritten
# (native_adam refuses the moments pass there).
#
# A landing may have to wait for its layer's moments pass: the backward reached the layer first
# (the trailing layers, kept without recompute, land quickly, and their passes start only when the
# last weights pass ends). Updating those layers whole instead costs more than the wait (the 7B
# steps in benchmarks/results/2026-11-27_h100_compact_moments, "7bdefer"): so they wait.
#
# Not in a step whose speculation was open (clipping quiet; speculation.py), with
# ``deferred_moments`` "auto": the layers the AdamW thread did not reach during the backward get one
# whole pass after the norm. There the AdamW thread's work, not the norm, bounds the step, and the
# second pass's extra bytes delay the next backward's speculative updates more than the shorter
# wait gains (benchmarks/results/2026-11-27_h100_host_timeline). ``true`` defers there too.
PHASE_WHOLE, PHASE_WEIGHTS, PHASE_MOMENTS = 0, 1, 2

# [Note: compact moments] Opt-in, never the default: DeepSpeed's ``bf16.bf16_optimizer_states`` (it
# requires ``bf16_master_weights_and_grads``, as DeepSpeed does), or
# ``optimizer.params.fp32_optimizer_states: false`` beside bf16 masters (DeepSpeedCPUAdam's moments
# then take the parameters' dtype), keeps the streamed layers' Adam moments in bf16: a bf16 master,
# two bf16 moments and the bf16 gradient are 8 host bytes per trained parameter instead of 12, and
# the update moves 14 B/param instead of 22. The arithmetic is fp32: each moment is read as fp32,
# the update computed as torch's fused kernel computes it (the master from the new moments before
# they are rounded), and the new moments stored rounded to nearest even. So it equals, bit for bit,
# torch's fused AdamW on fp32 copies of the moments followed by a copy back
# (tests/engine/test_compact_moments.py), which is what the torch kernel's blocked path does here.
# The cost is the moments' precision: exp_avg_sq keeps 8 bits of mantissa, so small updates to it
# round away (beta2 0.999 moves it by 0.1% a step, under bf16's 0.4% resolution): the loss curves
# against exact fp32 state are in benchmarks/results/2026-11-27_h100_compact_moments/README.md
# ("Loss"). The resident parameters (embeddings, final norm, LM head) keep fp32 masters and moments,
# as they do in bf16-master mode. Not with the NVMe tier (its swap file holds fp32 moments).


def can_defer(adam_w_mode: bool, hp: dict) -> bool:
    """Whether the moments pass can run after the weights pass: AdamW, or Adam without weight
    decay."""
    return bool(adam_w_mode) or float(hp["weight_decay"]) == 0.0


def update_tensor(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hp: dict,
    coef: float,
    adam_w_mode: bool,
    wire: torch.Tensor | None,
    kernel: str,
) -> None:
    """One whole AdamW step of one tensor (a resident parameter: embedding, final norm, LM head) and
    its wire copy: on the host with ``kernel`` "native", one pass of the C kernel that writes the
    wire in it; otherwise (the torch kernel, or state held on the GPU) torch's fused kernel, then
    the copy. Bit-identical either way."""
    if (
        kernel == "native"
        and master.device.type == "cpu"
        and master.is_contiguous()
        and grad.is_contiguous()
    ):
        native_adam(
            master.view(-1),
            grad.view(-1),
            exp_avg.view(-1),
            exp_avg_sq.view(-1),
            hp,
            coef,
            adam_w_mode,
            None if wire is None else wire.view(-1),
        )
        return
    step, scale = adamw_scalars(hp, coef, master.device)
    fused_adam([master], [grad], [exp_avg], [exp_avg_sq], hp, step, scale, adam_w_mode)
    if wire is not None:
        wire.copy_(master)


def update_segment(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    a: int,
    b: int,
    hp: dict,
    coef: float,
    adam_w_mode: bool,
    wire: torch.Tensor | None,
    grad_scratch: torch.Tensor,
    master_scratch: torch.Tensor,
    block: int = BLOCK_ELEMENTS,
    kernel: str = "torch",
    phase: int = PHASE_WHOLE,
) -> None:
    """AdamW of elements [a, b) of one layer's flat state (moments fp32 or bf16; ``master`` fp32 or
    bf16, ``grad`` in its landing dtype), writing ``wire[a:b]`` (the compute-dtype copy the GPU
    streams) from the new master when given. ``kernel`` "native": one pass of the C kernel ([Note:
    native host update]); "torch": the fused kernel, in blocks where conversions are needed (the
    scratch buffers hold at least ``block`` fp32 elements). ``phase``: one of the native kernel's
    two passes ([Note: deferred moments]); the torch kernel does whole updates only."""
    if kernel == "native":
        native_adam(
            master[a:b],
            grad[a:b],
            exp_avg[a:b],
            exp_avg_sq[a:b],
            hp,
            coef,
            adam_w_mode,
            None if wire is None else wire[a:b],
            phase=phase,
        )
        return
    if phase != PHASE_WHOLE:
        raise ValueError(
            "the deferred moments pass needs the native host kernel (host_kernel: torch does whole "
            "updates only)"
        )
    convert_grad = grad.dtype != torch.float32
    low_master = master.dtype != torch.float32
    low_moments = exp_avg.dtype != torch.float32  # [Note: compact moments]
    step, scale = adamw_scalars(hp, coef, master.device)
    if not (convert_grad or low_master or low_moments or wire is not None):
        fused_adam(
            [master[a:b]],
            [grad[a:b]],
            [exp_avg[a:b]],
            [exp_avg_sq[a:b]],
            hp,
            step,
            scale,
            adam_w_mode,
        )
        return
    for start in range(a, b, block):
        end = min(start + block, b)
        n = end - start
        g = grad_scratch[:n].copy_(grad[start:end]) if convert_grad else grad[start:end]
        w = master_scratch[:n].copy_(master[start:end]) if low_master else master[start:end]
        # bf16 moments: fp32 copies of the block (the fallback's only allocation per block), rounded
        # back after
        m, v = (
            (exp_avg[start:end].float(), exp_avg_sq[start:end].float())
            if low_moments
            else (exp_avg[start:end], exp_avg_sq[start:end])
        )
        fused_adam([w], [g], [m], [v], hp, step, scale, adam_w_mode)
        if low_moments:
            exp_avg[start:end].copy_(m)
            exp_avg_sq[start:end].copy_(v)
        if low_master:
            master[start:end].copy_(w)  # round to nearest, as the whole-layer copy did
        if wire is not None:  # cast from the master as it now is, as refresh_wire casts it
            wire[start:end].copy_(master[start:end] if low_master else w)


# [Note: native host update] One pass per layer: the C kernel in csrc/host_adam.c reads the gradient
# in its landing dtype (bf16, fp16 or fp32), reads and writes the master (fp32, or bf16 in
# bf16-master mode) and the moments (fp32, or bf16: [Note: compact moments]) once, and writes the
# wire copy (bf16/fp16) in the same pass: no fp32 scratch, no second pass, so the host update moves
# the bytes it must and no more (bf16 gradient + fp32 master + bf16 wire: 2 + 8 + 8 + 8 + 2 = 28
# B/param).
#
# Exactness: its arithmetic is torch's fused CPU kernel's vector loop, operation for operation (the
# lerp form of exp_avg, the same three fused multiply-adds, the scalars formed in double and rounded
# to float), compiled with -ffp-contract=off so that only those fuse. torch does the last ``n mod
# width`` elements of a tensor in a scalar loop that each build's compiler fuses its own way (AVX2
# builds one way, AVX-512 builds another, which no form of csrc/host_adam.c's tail_update matched on
# every element: 4 of 37.7 M differed by up to 4 ulp); those few elements are done by torch's kernel
# itself (``_torch_tail``). So: bit-identical to torch._fused_adamw_/_fused_adam_ on every element
# (AdamW and Adam-L2, with and without a gradient scale, fp32/bf16/fp16 gradients) under every
# dispatch; tests/unit/test_host_update.py holds it to torch bit for bit,
# tests/unit/test_native_update.py to torch AdamW + clip_grad_norm_ over 20 steps. (The C tail forms
# remain for ``host_update_bench --tail-forms``.)
#
# Built at first use with the machine's C compiler (``cc``, or $CC) for this CPU (-march=native),
# cached per source and CPU in $MEGATRAIN_DS_CACHE (default ~/.cache/megatrain_ds); about a second.
# Where it cannot be built (no compiler), ``megatrain.host_kernel`` "auto" falls back to the blocked
# torch path above (exact, slower) and says so once; "native" refuses instead; "torch" never builds
# it.

_SOURCE = Path(__file__).with_name("csrc") / "host_adam.c"
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# the Adam moments: fp32, or bf16 ([Note: compact moments])
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fPIC",
    "-shared",
    "-pthread",
]
_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


class NativeKernelError(RuntimeError):
    """The native host update was required (``megatrain.host_kernel: native``) and could not be
    built or loaded."""


def _cache_dir() -> Path:
    return Path(os.environ.get("MEGATRAIN_DS_CACHE") or Path.home() / ".cache" / "megatrain_ds")


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache shared by two machines
    keeps one build per CPU kind)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "\n".join(lines) or platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join([compiler] + _FLAGS).encode() + _cpu_key().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"host_adam_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: two processes (data-parallel ranks) may build at
    # once
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise OSError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def native_library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built (``native_error()`` says why).
    Thread-safe; built once."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is not None or _lib_error is not None:
            return _lib
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        try:
            if compiler is None:
                raise OSError("no C compiler (cc, gcc or $CC) on PATH")
            lib = ctypes.CDLL(str(_build(compiler)))
            fn = lib.megatrain_adam
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_double,
                ctypes.c_float,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
            ]
            undo = lib.megatrain_adam_undo
            undo.restype = ctypes.c_int
            undo.argtypes = (
                [
                    ctypes.c_int64,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_int,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_int,
                ]
                + [ctypes.c_double] * 7
                + [ctypes.c_int, ctypes.c_int]
            )
            _lib = lib
        except (OSError, subprocess.SubprocessError) as exc:
            _lib_error = str(exc)
        return _lib


def native_error() -> str | None:
    return _lib_error


@functools.lru_cache(maxsize=1)
def _torch_width() -> int:
    """Floats per vector in torch's CPU kernels (AVX-512 16, else 8): its fused Adam does the last
    ``n % width`` elements of a tensor in a scalar loop, whose fused multiply-adds each build's
    compiler chooses (AVX2 builds fuse exp_avg_sq as fma(v, beta2, c2*g*g); under AVX-512 none of
    csrc/host_adam.c's tail forms matched every element: ``host_update_bench --tail-forms``). Those
    elements are done by torch itself (``_torch_tail``)."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    return 16 if "AVX512" in cap else 8


def _flat(t: torch.Tensor, name: str) -> int:
    if not t.is_contiguous() or t.device.type != "cpu" or t.dtype not in _DT:
        raise ValueError(
            f"native host update: {name} must be a contiguous CPU fp32/bf16/fp16 tensor, got "
            f"{t.dtype} on {t.device} (contiguous={t.is_contiguous()})"
        )
    return t.data_ptr()


def native_adam(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hp: dict,
    coef: float,
    adam_w_mode: bool,
    wire: torch.Tensor | None = None,
    threads: int | None = None,
    tail_form: int | None = None,
    phase: int = PHASE_WHOLE,
) -> None:
    """One pass of Adam(W) over ``master`` (fp32 or bf16) with ``grad`` (fp32/bf16/fp16) and the
    moments (fp32, or bf16: [Note: compact moments]), writing ``wire`` (bf16/fp16) from the new
    master when given; ``coef``: the clip coefficient over the loss scale (the gradient is divided
    by the fp32 value of ``1 / coef``, as the fused kernel's ``grad_scale``). ``phase``: the whole
    update, or one of its two passes ([Note: deferred moments]): ``PHASE_WEIGHTS`` stores the master
    and wire only, ``PHASE_MOMENTS`` (later, same gradient, hyperparameters and ``coef``) the
    moments only. ``tail_form`` (the bench's): the last ``n % width`` elements by the C kernel's
    tail form instead of torch's."""
    if phase == PHASE_MOMENTS and not can_defer(adam_w_mode, hp):
        raise ValueError(
            "native host update: the moments pass needs AdamW or no weight decay (Adam's L2 term "
            "reads the master the weights pass has already overwritten)"
        )
    lib = native_library()
    if lib is None:
        raise NativeKernelError(f"the native host update is not available: {_lib_error}")
    n = master.numel()
    for t, name in ((grad, "grad"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")) + (
        ((wire, "wire"),) if wire is not None else ()
    ):
        if t.numel() != n:
            raise ValueError(f"native host update: {name} has {t.numel()} elements, the master {n}")
    if exp_avg.dtype not in MOMENT_DTYPES or exp_avg_sq.dtype != exp_avg.dtype:
        raise ValueError(
            "native host update: the Adam moments must be both fp32 or both bf16, got "
            f"{exp_avg.dtype} "
            f"and {exp_avg_sq.dtype}"
        )
    if n == 0:
        return
    scale = 1.0 if coef == 1.0 else float(torch.tensor(1.0 / coef, dtype=torch.float32))
    width = _torch_width()
    # the last n % width elements: torch's own kernel (_torch_tail), unless a C tail form is asked
    # for (the bench)
    body = n - n % width if tail_form is None else n
    if body:
        lib.megatrain_adam(
            body,
            _flat(master, "master"),
            _DT[master.dtype],
            _flat(grad, "grad"),
            _DT[grad.dtype],
            _flat(exp_avg, "exp_avg"),
            _flat(exp_avg_sq, "exp_avg_sq"),
            None if wire is None else _flat(wire, "wire"),
            0 if wire is None else _DT[wire.dtype],
            float(hp["lr"]),
            float(hp["beta1"]),
            float(hp["beta2"]),
            float(hp["weight_decay"]),
            float(hp["eps"]),
            float(hp["step"]),
            scale,
            int(bool(adam_w_mode)),
            int(threads or torch.get_num_threads()),
            n - n % width,
            tail_form or 0,
            int(phase),
            _DT[exp_avg.dtype],
        )
    if body < n:
        _torch_tail(
            master[body:],
            grad[body:],
            exp_avg[body:],
            exp_avg_sq[body:],
            None if wire is None else wire[body:],
            hp,
            coef,
            adam_w_mode,
            phase,
        )


def _torch_tail(
    master, grad, exp_avg, exp_avg_sq, wire, hp: dict, coef: float, adam_w_mode: bool, phase: int
) -> None:
    """The last ``n mod width`` elements (fewer than 16) by torch's fused kernel itself, on fp32
    copies: torch does them in a scalar loop whose fused multiply-adds depend on the compiler that
    built it (AVX-512 builds differ from AVX2 ones), so this is how they come out bit-identical
    under every dispatch. ``phase`` as native_adam's."""
    p = master.to(torch.float32, copy=True)
    # torch's kernel writes the scaled gradient back: never the landed one
    g = grad.to(torch.float32, copy=True)
    keep = phase != PHASE_WEIGHTS  # the weights pass leaves the moments as they were
    m, v = exp_avg.to(torch.float32, copy=True), exp_avg_sq.to(torch.float32, copy=True)
    step, scale = adamw_scalars(hp, coef, master.device)
    fused_adam([p], [g], [m], [v], hp, step, scale, adam_w_mode)
    if keep:  # rounded to nearest with bf16 moments, as the kernel rounds
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if phase != PHASE_MOMENTS:
        master.copy_(p)  # rounded to nearest in bf16-master mode, as the kernel rounds
        if wire is not None:
            wire.copy_(p)


def native_adam_undo(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hp: dict,
    coef: float,
    adam_w_mode: bool,
    wire: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """``speculation.adamw_undo`` in one pass of the C kernel ([Note: native rollback]): the same
    double arithmetic (with a correctly rounded sqrt), on an fp32 ``master`` with ``grad``
    (fp32/bf16/fp16) as the step used it; also writes ``wire`` (bf16/fp16) from the restored master,
    as ``refresh_wire`` would."""
    lib = native_library()
    if lib is None:
        raise NativeKernelError(f"the native host update is not available: {_lib_error}")
    n = master.numel()
    if (
        master.dtype != torch.float32
        or exp_avg.dtype != torch.float32
        or exp_avg_sq.dtype != torch.float32
    ):
        raise ValueError("native rollback: the master and the Adam moments must be fp32")
    for t, name in ((grad, "grad"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")) + (
        ((wire, "wire"),) if wire is not None else ()
    ):
        if t.numel() != n:
            raise ValueError(f"native rollback: {name} has {t.numel()} elements, the master {n}")
    if n == 0:
        return
    lib.megatrain_adam_undo(
        n,
        _flat(master, "master"),
        _flat(grad, "grad"),
        _DT[grad.dtype],
        _flat(exp_avg, "exp_avg"),
        _flat(exp_avg_sq, "exp_avg_sq"),
        None if wire is None else _flat(wire, "wire"),
        0 if wire is None else _DT[wire.dtype],
        float(hp["lr"]),
        float(hp["beta1"]),
        float(hp["beta2"]),
        float(hp["weight_decay"]),
        float(hp["eps"]),
        float(hp["step"]),
        0.0 if coef == 1.0 else 1.0 / coef,
        int(bool(adam_w_mode)),
        int(threads or torch.get_num_threads()),
    )


_said_fallback = False


def resolve_kernel(setting: str = "auto") -> str:
    """``megatrain.host_kernel`` -> "native" or "torch" (building the native kernel now, not in the
    first step). "auto" falls back to "torch" where it cannot be built, and says so once per
    process; "native" refuses."""
    global _said_fallback
    if setting == "torch":
        return "torch"
    if native_library() is not None:
        return "native"
    if setting == "native":
        raise NativeKernelError(
            f"megatrain.host_kernel=native: the native host update could not be built: "
            f"{_lib_error}. Install a C compiler (cc/gcc, or set $CC), or set host_kernel to "
            "\"auto\" or \"torch\" (torch's fused AdamW: exact, slower)"
        )
    if not _said_fallback:
        _said_fallback = True
        warnings.warn(
            f"megatrain_ds: the native host update could not be built ({_lib_error}); using "
            "torch's "
            "fused AdamW in blocks (exact, slower; fp32 gradient landing where the master streams)",
            RuntimeWarning,
            stacklevel=2,
        )
    return "torch"


def lands_fp32(fp32_grad_landing: bool, stream_fp32: bool, kernel: str) -> bool:
    """GA 1: whether gradients land in fp32 (the GPU converts) rather than the compute dtype. Asked,
    explicitly (``fp32_grad_landing``); or where the fp32 master streams and the torch kernel
    updates it (its fused AdamW wants an fp32 gradient; landing it so saves a host pass). The native
    kernel reads bf16 gradients in its one pass: 2 host bytes per parameter and half the D2H bytes
    less. The engine and the planner both ask here."""
    return bool(fp32_grad_landing or (stream_fp32 and kernel == "torch"))
