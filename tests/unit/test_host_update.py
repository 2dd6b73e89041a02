"""The blocked host update ([Note: blocked host update], megatrain_ds/optim/host_update.py) equals
the whole-layer passes it replaces bit for bit: the bf16 gradient converted whole then torch's fused
AdamW, bf16 masters copied to fp32 and back, the wire copy refreshed afterwards; for AdamW and
Adam-L2, a clip coefficient, a loss scale, bias correction at several steps, block edges inside a
segment and several segments."""

import pytest
import torch

from megatrain_ds.optim.host_update import adamw_scalars, fused_adam, update_segment


def _state(n: int, seed: int, grad_dtype, master_dtype):
    g = torch.Generator().manual_seed(seed)
    master = (torch.randn(n, generator=g) * 0.02).to(master_dtype)
    grad = (torch.randn(n, generator=g) * 1e-3).to(grad_dtype)
    m = torch.randn(n, generator=g) * 1e-4
    v = torch.rand(n, generator=g) * 1e-7
    return master, grad, m, v


def _passes(master, grad, m, v, segments, hps, coef, adam_w_mode, wire):
    """What optimizer._update_layer did before the blocked update: whole-layer passes."""
    g32 = grad.float()
    work = master.float() if master.dtype != torch.float32 else master
    for group, a, b in segments:
        step, scale = adamw_scalars(hps[group], coef, master.device)
        fused_adam(
            [work[a:b]], [g32[a:b]], [m[a:b]], [v[a:b]], hps[group], step, scale, adam_w_mode
        )
    if master.dtype != torch.float32:
        master.copy_(work)
    if wire is not None:
        wire.copy_(master)


@pytest.mark.parametrize(
    "grad_dtype,master_dtype,with_wire",
    [
        (torch.bfloat16, torch.float32, True),  # bf16 landing, bf16 wire (stream_fp32_master false)
        (torch.float32, torch.float32, True),  # fp32 landing, bf16 wire
        (torch.bfloat16, torch.bfloat16, False),  # bf16-master mode (the master is the wire)
        (torch.float32, torch.float32, False),  # the default: one fused call, unchanged
        (torch.float16, torch.float32, True),  # fp16 compute
    ],
)
@pytest.mark.parametrize("adam_w_mode", [True, False])
# no clip; clip; an fp16 loss scale
@pytest.mark.parametrize("coef,step", [(1.0, 1), (0.37, 7), (1 / 1024, 300)])
def test_blocked_equals_whole_layer_passes(
    grad_dtype, master_dtype, with_wire, adam_w_mode, coef, step
):
    n, block = 10_007, 1_000  # blocks end inside segments, segments end inside blocks
    segments = [(0, 0, 4_321), (1, 4_321, n)]
    hps = [
        dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step),
        dict(lr=5e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, step=step),
    ]
    wire_dtype = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
    want = _state(n, 0, grad_dtype, master_dtype)
    got = [t.clone() for t in want]
    want_wire = torch.zeros(n, dtype=wire_dtype) if with_wire else None
    got_wire = torch.zeros(n, dtype=wire_dtype) if with_wire else None
    _passes(*want, segments, hps, coef, adam_w_mode, want_wire)
    scratch_g, scratch_m = torch.empty(block), torch.empty(block)
    for group, a, b in segments:
        update_segment(
            *got, a, b, hps[group], coef, adam_w_mode, got_wire, scratch_g, scratch_m, block=block
        )
    for name, x, y in zip(("master", "grad", "exp_avg", "exp_avg_sq"), got, want):
        assert torch.equal(x, y), name
    if with_wire:
        assert torch.equal(got_wire, want_wire)
    assert not torch.equal(got[0], _state(n, 0, grad_dtype, master_dtype)[0])  # it did update


# --- the native kernel ([Note: native host update]) -----------------------------------------------
from megatrain_ds.optim import host_update  # noqa: E402


def _ulps(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest distance in units of the last place between two fp32 (or bf16/fp16, compared in fp32)
    tensors."""
    a, b = x.float().view(torch.int32).long(), y.float().view(torch.int32).long()
    return int((a - b).abs().max()) if a.numel() else 0


def _native_or_skip():
    if host_update.native_library() is None:  # no C compiler: the engine falls back (tested below)
        pytest.skip(f"native host update not built here: {host_update.native_error()}")


# The native kernel equals torch's fused kernel bit for bit under every CPU dispatch (AVX2 and
# AVX-512 alike): the elements torch does in its build-dependent scalar tail loop are done by torch
# itself (host_update._torch_tail).


@pytest.mark.parametrize(
    "grad_dtype,master_dtype,wire_dtype",
    [
        (
            torch.bfloat16,
            torch.float32,
            None,
        ),  # the default: fp32 master streams, bf16 gradients land
        (torch.bfloat16, torch.float32, torch.bfloat16),  # bf16 wire
        (torch.float32, torch.float32, None),  # fp32 landing
        (torch.float32, torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, None),  # bf16-master mode (the master is the wire)
        (torch.float16, torch.float32, torch.float16),  # fp16 compute
    ],
)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("coef,step,wd", [(1.0, 1, 0.01), (0.37, 7, 0.0), (1 / 1024, 300, 0.1)])
def test_native_equals_torch_fused(
    grad_dtype, master_dtype, wire_dtype, adam_w_mode, coef, step, wd
):
    """One step of the native kernel against torch's fused kernel on the same values (the gradient
    converted to fp32, the master to fp32 and back): master, moments and wire equal. Odd length:
    torch's scalar tail too."""
    _native_or_skip()
    n = 40_013
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, step=step)
    master, grad, m, v = _state(n, 1, grad_dtype, master_dtype)
    grad_before = grad.clone()
    want_p, want_m, want_v = master.clone().float(), m.clone(), v.clone()
    st, scale = adamw_scalars(hp, coef, torch.device("cpu"))
    fused_adam([want_p], [grad.float().clone()], [want_m], [want_v], hp, st, scale, adam_w_mode)
    wire = None if wire_dtype is None else torch.zeros(n, dtype=wire_dtype)
    host_update.native_adam(master, grad, m, v, hp, coef, adam_w_mode, wire=wire, threads=3)
    # read, never written (torch's kernel writes the scaled gradient back)
    assert torch.equal(grad, grad_before)
    got = {"master": master.float(), "exp_avg": m, "exp_avg_sq": v}
    want = {"master": want_p.to(master_dtype).float(), "exp_avg": want_m, "exp_avg_sq": want_v}
    for name in got:
        assert torch.equal(got[name], want[name]), (name, _ulps(got[name], want[name]))
    if wire is not None:
        # the wire is the new master, rounded as copy_ rounds
        assert torch.equal(wire, master.to(wire_dtype))
    assert not torch.equal(master, _state(n, 1, grad_dtype, master_dtype)[0])


def test_native_propagates_non_finite_like_torch():
    """A NaN or inf gradient element poisons that element as torch's kernel does (the fp16 skip
    happens before the update; this is what an unskipped bad element does), and the bf16 rounding
    keeps NaN a NaN."""
    _native_or_skip()
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)
    master, grad, m, v = _state(1_003, 2, torch.float32, torch.float32)
    grad[[5, 700]] = torch.tensor([float("nan"), float("inf")])
    want = [master.clone(), m.clone(), v.clone()]
    st, scale = adamw_scalars(hp, 1.0, torch.device("cpu"))
    fused_adam([want[0]], [grad.clone()], [want[1]], [want[2]], hp, st, scale, True)
    wire = torch.zeros(1_003, dtype=torch.bfloat16)
    host_update.native_adam(master, grad, m, v, hp, 1.0, True, wire=wire)
    for x, y in zip((master, m, v), want):
        assert torch.equal(x.isnan(), y.isnan())
        assert torch.equal(x.nan_to_num(), y.nan_to_num())
    assert wire[5].isnan() and wire[700].isnan()


def test_native_refuses_mismatched_state():
    _native_or_skip()
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    master, grad, m, v = _state(100, 3, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="grad has 99 elements"):
        host_update.native_adam(master, grad[:99], m, v, hp, 1.0, True)
    with pytest.raises(ValueError, match="contiguous"):
        host_update.native_adam(master, grad.view(10, 10).t(), m, v, hp, 1.0, True)


def test_kernel_setting_without_a_compiler(monkeypatch, tmp_path):
    """No C compiler: "auto" falls back to torch's kernel (said once) and lands fp32 gradients where
    the master streams; "native" refuses, naming the setting and what to do."""
    monkeypatch.setattr(host_update, "_lib", None)
    monkeypatch.setattr(host_update, "_lib_error", None)
    monkeypatch.setattr(host_update, "_said_fallback", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MEGATRAIN_DS_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert host_update.resolve_kernel("auto") == "torch"
    with pytest.raises(host_update.NativeKernelError, match="megatrain.host_kernel=native"):
        host_update.resolve_kernel("native")
    assert host_update.resolve_kernel("torch") == "torch"
    assert host_update.lands_fp32(False, True, "torch") and not host_update.lands_fp32(
        False, True, "native"
    )


def test_native_split_over_threads_equals_one_thread():
    """Ranges split over threads (each at least 64 Ki elements, starting on cache lines) give the
    same bytes as one thread and as torch, tail included."""
    _native_or_skip()
    n = 3 * 65_536 + 77
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=5)
    runs = []
    for threads in (1, 3):
        master, grad, m, v = _state(n, 4, torch.bfloat16, torch.float32)
        wire = torch.zeros(n, dtype=torch.bfloat16)
        host_update.native_adam(master, grad, m, v, hp, 0.5, True, wire=wire, threads=threads)
        runs.append((master, m, v, wire))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    master, grad, m, v = _state(n, 4, torch.bfloat16, torch.float32)
    st, scale = adamw_scalars(hp, 0.5, torch.device("cpu"))
    fused_adam([master], [grad.float()], [m], [v], hp, st, scale, True)
    for got, want in zip(runs[1][:3], (master, m, v)):
        assert torch.equal(got, want)


# --- the native rollback ([Note: native rollback]) ------------------------------------------------
def _undo_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """The native undo against adamw_undo: the same double arithmetic, but torch's vectorized double
    sqrt (Sleef, 0.5001 ulp) is not always correctly rounded where C's is: an fp32 result differs
    where that last double bit survives the rounding, in under 1 element in 1,000 (near-zero
    moments, where the undo cancels), by a few ulp."""
    differ = got != want
    assert int(differ.sum()) <= max(1, got.numel() // 1000), (name, int(differ.sum()))
    assert _ulps(got, want) <= 8, (name, _ulps(got, want))


@pytest.mark.parametrize(
    "grad_dtype,wire_dtype",
    [
        (torch.bfloat16, None),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, None),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("coef,step,wd", [(1.0, 1, 0.01), (0.37, 7, 0.0), (1 / 1024, 300, 0.1)])
def test_native_undo_equals_adamw_undo(grad_dtype, wire_dtype, adam_w_mode, coef, step, wd):
    """A step undone by the C kernel equals speculation.adamw_undo (master, moments; see _undo_close
    for the last bit), over threads, writes the wire from the restored master, clamps exp_avg_sq at
    +0, keeps a NaN where adamw_undo does; the undo lands near the state before the step."""
    from megatrain_ds.optim.speculation import adamw_undo

    _native_or_skip()
    n = 3 * 65_536 + 77
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, step=step)
    master, grad, m, v = _state(n, 5, grad_dtype, torch.float32)
    # first-step moments: the undo's v lands on 0 up to rounding (the clamp's case)
    m[:4096], v[:4096] = 0.0, 0.0
    before = (master.clone(), m.clone(), v.clone())
    host_update.native_adam(master, grad, m, v, hp, coef, adam_w_mode)  # the speculative step
    assert not torch.equal(master, before[0])
    want = [t.clone() for t in (master, m, v)]
    adamw_undo(want[0], grad.float(), want[1], want[2], hp, coef, adam_w_mode)
    wire = None if wire_dtype is None else torch.zeros(n, dtype=wire_dtype)
    host_update.native_adam_undo(master, grad, m, v, hp, coef, adam_w_mode, wire=wire, threads=3)
    for got, exp, name in zip((master, m, v), want, ("master", "exp_avg", "exp_avg_sq")):
        _undo_close(got, exp, name)
    assert (v[:4096] == 0).any() and not torch.signbit(v).any()  # clamped to +0 where it went below
    if wire is not None:
        assert torch.equal(wire, master.to(wire_dtype))
    # a NaN in the gradient stays a NaN in the same places (compared as bits)
    nan_grad = grad.clone()
    nan_grad[7] = float("nan")
    got, want = [t.clone() for t in (master, m, v)], [t.clone() for t in (master, m, v)]
    host_update.native_adam_undo(*got[:1], nan_grad, *got[1:], hp, coef, adam_w_mode, threads=2)
    adamw_undo(want[0], nan_grad.float(), want[1], want[2], hp, coef, adam_w_mode)
    for a, b, name in zip(got, want, ("master", "exp_avg", "exp_avg_sq")):
        assert torch.equal(a.isnan(), b.isnan()), name
        _undo_close(a.nan_to_num(), b.nan_to_num(), name)
    assert got[2][7].isnan()
    # undone: back where it was up to rounding (the step itself moved elements by up to lr = 1e-3)
    assert (master - before[0]).abs().max() < 1e-6
    with pytest.raises(ValueError, match="must be fp32"):
        host_update.native_adam_undo(master.bfloat16(), grad, m, v, hp, coef, adam_w_mode)
