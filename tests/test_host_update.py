"""The blocked host update ([Note: blocked host update], megatrain_ds/host_update.py) equals the whole-layer
passes it replaces bit for bit: the bf16 gradient converted whole then torch's fused AdamW, bf16 masters copied to
fp32 and back, the wire copy refreshed afterwards; for AdamW and Adam-L2, a clip coefficient, a loss scale, bias
correction at several steps, block edges inside a segment and several segments."""
import pytest
import torch

from megatrain_ds.host_update import adamw_scalars, fused_adam, update_segment


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
    for (group, a, b) in segments:
        step, scale = adamw_scalars(hps[group], coef, master.device)
        fused_adam([work[a:b]], [g32[a:b]], [m[a:b]], [v[a:b]], hps[group], step, scale, adam_w_mode)
    if master.dtype != torch.float32:
        master.copy_(work)
    if wire is not None:
        wire.copy_(master)


@pytest.mark.parametrize("grad_dtype,master_dtype,with_wire", [
    (torch.bfloat16, torch.float32, True),  # bf16 landing, bf16 wire (stream_fp32_master false)
    (torch.float32, torch.float32, True),  # fp32 landing, bf16 wire
    (torch.bfloat16, torch.bfloat16, False),  # bf16-master mode (the master is the wire)
    (torch.float32, torch.float32, False),  # the default: one fused call, unchanged
    (torch.float16, torch.float32, True),  # fp16 compute
])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("coef,step", [(1.0, 1), (0.37, 7), (1 / 1024, 300)])  # no clip; clip; an fp16 loss scale
def test_blocked_equals_whole_layer_passes(grad_dtype, master_dtype, with_wire, adam_w_mode, coef, step):
    n, block = 10_007, 1_000  # blocks end inside segments, segments end inside blocks
    segments = [(0, 0, 4_321), (1, 4_321, n)]
    hps = [dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step),
           dict(lr=5e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, step=step)]
    wire_dtype = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
    want = _state(n, 0, grad_dtype, master_dtype)
    got = [t.clone() for t in want]
    want_wire = torch.zeros(n, dtype=wire_dtype) if with_wire else None
    got_wire = torch.zeros(n, dtype=wire_dtype) if with_wire else None
    _passes(*want, segments, hps, coef, adam_w_mode, want_wire)
    scratch_g, scratch_m = torch.empty(block), torch.empty(block)
    for group, a, b in segments:
        update_segment(*got, a, b, hps[group], coef, adam_w_mode, got_wire, scratch_g, scratch_m, block=block)
    for name, x, y in zip(("master", "grad", "exp_avg", "exp_avg_sq"), got, want):
        assert torch.equal(x, y), name
    if with_wire:
        assert torch.equal(got_wire, want_wire)
    assert not torch.equal(got[0], _state(n, 0, grad_dtype, master_dtype)[0])  # it did update
