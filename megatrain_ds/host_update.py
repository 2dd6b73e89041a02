"""One host update per layer segment, in cache-sized blocks: [Note: blocked host update].

[Note: blocked host update] torch's fused CPU AdamW (``torch._fused_adamw_``) wants the parameter, gradient and
moments in one dtype (fp32 here). Where the layer's state is not all fp32, the update used to be a sequence of
whole-layer passes over host memory: the bf16 gradient converted into an fp32 scratch (write 4 B, read them back),
in bf16-master mode the master copied into an fp32 scratch and back (two more passes), and the compute-dtype wire
copy refreshed from the master afterwards (the master read again). Each extra pass costs DRAM bandwidth, which is
what bounds the update.

Here the same kernel runs on blocks of ``BLOCK_ELEMENTS`` parameters, and each block's conversions happen right
before and after it: the fp32 scratch of a block stays in the CPU's caches, so the layer's state crosses DRAM about
once (gradient in its landing dtype, master, moments, wire copy out). The arithmetic is the same kernel on the same
values, elementwise, so the result is **bit-identical** to the whole-layer passes (tests/test_host_update.py). Where
the state is all fp32 and there is no separate wire copy, the kernel runs once on the whole segment, as before.
"""
from __future__ import annotations

import os

import torch


def _l3_bytes() -> int:
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        size = 0
    return size if size and size > 0 else 32 << 20


# Parameters per block: the two fp32 scratch blocks (gradient, bf16 master) stay in the last-level cache (the block is
# a 16th of it), as large as that allows up to 16 Mi: each block costs ~4 torch calls, each a parallel region over the
# host threads, so small blocks lose to their overhead. Measured on the lent H100 box's CPU (Xeon, 16 cores, 300 MiB
# L3; benchmarks/host_update_bench.py, one 233 M-parameter layer, 15 threads, Gparam/s): bf16 gradient + fp32 master
# + bf16 wire: passes 2.28, blocks of 256K 1.40, 1M 2.43, 4M 2.59, 16M 2.81; bf16-master mode: 1.96, 1.65, 2.61,
# 2.51, 2.72 (run-to-run spread ~10%). Here: 16 Mi; with a 32 MiB L3, 2 Mi.
BLOCK_ELEMENTS = max(1 << 20, min(1 << 24, _l3_bytes() // 16))


def adamw_scalars(hp: dict, coef: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused kernel's step tensor and gradient scale (it divides the gradients by ``1 / coef``). ``torch.full``,
    not ``torch.tensor``: on the GPU a fill kernel, where a tensor from a Python value is a blocking pageable copy."""
    step = torch.full((), float(hp["step"]), dtype=torch.float32, device=device)
    scale = None if coef == 1.0 else torch.full((), 1.0 / coef, dtype=torch.float32, device=device)
    return step, scale


def fused_adam(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, hp: dict, step: torch.Tensor,
               scale: torch.Tensor | None, adam_w_mode: bool) -> None:
    fn = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fn(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params), lr=hp["lr"], beta1=hp["beta1"],
       beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False, maximize=False,
       grad_scale=scale, found_inf=None)


def update_segment(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   a: int, b: int, hp: dict, coef: float, adam_w_mode: bool, wire: torch.Tensor | None,
                   grad_scratch: torch.Tensor, master_scratch: torch.Tensor, block: int = BLOCK_ELEMENTS) -> None:
    """AdamW of elements [a, b) of one layer's flat state (fp32 moments; ``master`` fp32 or bf16, ``grad`` in its
    landing dtype), writing ``wire[a:b]`` (the compute-dtype copy the GPU streams) from the new master when given.
    The scratch buffers hold at least ``block`` fp32 elements."""
    convert_grad = grad.dtype != torch.float32
    low_master = master.dtype != torch.float32
    step, scale = adamw_scalars(hp, coef, master.device)
    if not (convert_grad or low_master or wire is not None):
        fused_adam([master[a:b]], [grad[a:b]], [exp_avg[a:b]], [exp_avg_sq[a:b]], hp, step, scale, adam_w_mode)
        return
    for start in range(a, b, block):
        end = min(start + block, b)
        n = end - start
        g = grad_scratch[:n].copy_(grad[start:end]) if convert_grad else grad[start:end]
        w = master_scratch[:n].copy_(master[start:end]) if low_master else master[start:end]
        fused_adam([w], [g], [exp_avg[start:end]], [exp_avg_sq[start:end]], hp, step, scale, adam_w_mode)
        if low_master:
            master[start:end].copy_(w)  # round to nearest, as the whole-layer copy did
        if wire is not None:  # cast from the master as it now is, as refresh_wire casts it
            wire[start:end].copy_(master[start:end] if low_master else w)
