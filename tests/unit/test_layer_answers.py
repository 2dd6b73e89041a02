"""``LayerStates`` answers where a streamed layer's state and gradient live, and performs the
operations on the gradient's way (layer_state.py): the landing and the optimizer ask it instead of
branching on its parts.

Built on a small ``HostLayerStore`` on the CPU: GA 1 (``GradHome.DIRECT``), GA > 1 (``STAGED``), a
layer another rank holds, the NVMe tier, the gradient hold (its device may be the CPU) and GPU-held
layers (the device state accepts a CPU device).
"""

from __future__ import annotations

import ast
import os

import torch
from torch import nn

from megatrain_ds.host.host_state import HostLayerStore
from megatrain_ds.host.layer_state import GradHome, Home, LayerStates
from megatrain_ds.host.nvme import NvmeSettings
from megatrain_ds.model.model_map import build_layout

CPU = torch.device("cpu")
PACKAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "megatrain_ds"
)


def _layouts(n: int = 3):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)) for _ in range(n)]
    group_of = {id(p): 0 for layer in layers for p in layer.parameters()}
    return layers, [build_layout(i, layer, group_of) for i, layer in enumerate(layers)]


def _states(ga: int = 1, owned=None, disk_from=None, nvme=None, hold: bool = False):
    layers, layouts = _layouts()
    store = HostLayerStore(
        layouts,
        torch.bfloat16,
        grad_accum_fp32=ga > 1,
        pin=False,
        owned=owned,
        disk_from=disk_from,
        nvme=nvme,
        nvme_backend="threads",
        hold_device=CPU if hold else None,
    )
    for i, layer in enumerate(layers):
        store.load_layer(i, layer)
    store.finish_loading()
    return LayerStates(store, CPU)


def _n_train(states, i: int) -> int:
    return states.layouts[i].n_train


def test_ga1_lands_directly_in_its_host_home():
    states = _states(ga=1)
    try:
        assert [states.grad_home(i) for i in range(3)] == [GradHome.DIRECT] * 3
        assert [states.where(i) for i in range(3)] == [Home.RAM] * 3
        assert all(
            states.holds(i) and not states.on_gpu(i) and not states.moments_on_disk(i)
            for i in range(3)
        )
        assert not states.has_disk_tier() and states.gpu_layers() is None
        n = _n_train(states, 1)
        home = states.grad(1)
        assert home.dtype == torch.bfloat16 and home.numel() == n
        # the update reads the home itself (nothing lent): the same bytes the landing wrote
        assert states.take_grad(1).data_ptr() == home.data_ptr()
        states.give_grad(1)
        # a second landing of the window: a buffer in the home's dtype, added by the fold
        extra = states.extra_landing(n, pin=False)
        assert extra.dtype == home.dtype and extra.numel() == n
        home.fill_(1.0)
        extra.fill_(2.0)
        summed = states.fold_grad(1, extra, first=False)
        assert torch.equal(summed, torch.full((n,), 3.0, dtype=torch.bfloat16))
    finally:
        states.store.close()


def test_ga_over_1_lands_in_the_ring_and_folds_into_fp32():
    states = _states(ga=2)
    try:
        assert [states.grad_home(i) for i in range(3)] == [GradHome.STAGED] * 3
        n = _n_train(states, 0)
        first, second = states.landing_slab(), states.landing_slab()
        first[:n].copy_(torch.linspace(-1, 1, n))
        second[:n].copy_(torch.linspace(2, 3, n))
        grad = states.fold_grad(0, first[:n], first=True)
        assert grad.dtype == torch.float32 and grad.data_ptr() == states.grad(0).data_ptr()
        grad = states.fold_grad(0, second[:n], first=False)  # bf16 into fp32: through the scratch
        assert torch.equal(grad, first[:n].float() + second[:n].float())
        states.return_slab(first)
        states.return_slab(second)
        assert states.store.ring.qsize() == 4  # every slab back
        assert states.take_grad(0).data_ptr() == grad.data_ptr()
    finally:
        states.store.close()


def test_a_layer_another_rank_holds_lands_nothing_here():
    states = _states(ga=1, owned=[True, False, True])
    try:
        assert [states.grad_home(i) for i in range(3)] == [
            GradHome.DIRECT,
            GradHome.OTHER_RANK,
            GradHome.DIRECT,
        ]
        assert states.where(1) is Home.OTHER_RANK and not states.holds(1)
        assert states.owned_layers() == [0, 2]
    finally:
        states.store.close()


def test_nvme_layers_keep_their_gradient_in_ram(tmp_path):
    states = _states(ga=1, disk_from=1, nvme=NvmeSettings(nvme_path=str(tmp_path)))
    try:
        assert states.has_disk_tier()
        assert [states.where(i) for i in range(3)] == [Home.RAM, Home.NVME, Home.NVME]
        assert [states.moments_on_disk(i) for i in range(3)] == [False, True, True]
        assert not states.master_on_disk(1)  # the moments only (offload_param stays off)
        # the moments are on disk, the gradient lands in RAM as any GA 1 layer's
        assert [states.grad_home(i) for i in range(3)] == [GradHome.DIRECT] * 3
        assert states.take_grad(2).data_ptr() == states.store.grad_of(2).data_ptr()
    finally:
        states.store.close()


def test_the_gradient_hold_lends_a_slab_per_update():
    states = _states(ga=1, hold=True)
    try:
        assert [states.grad_home(i) for i in range(3)] == [GradHome.HOLD] * 3
        hold = states.hold
        for i in range(3):
            states.grad(i).copy_(torch.full((_n_train(states, i),), float(i + 1)))
        states.expect_grad_takes([0, 1, 2], None)
        for i in range(3):
            slab = states.take_grad(i)
            assert slab.data_ptr() != states.grad(i).data_ptr()  # a host slab, not the held buffer
            assert torch.equal(slab, states.grad(i))
            states.give_grad(i)
        assert hold.slabs.qsize() == hold.SLABS and not hold.pending  # every slab back
    finally:
        states.store.close()


def test_gpu_held_layers_accumulate_on_the_device_and_the_answer_follows_the_transition():
    states = _states(ga=2)
    try:
        assert states.grad_home(0) is GradHome.STAGED
        states.place_on_device(2)  # the device state accepts the CPU: the same answers as on a GPU
        assert [states.grad_home(i) for i in range(3)] == [
            GradHome.DEVICE,
            GradHome.DEVICE,
            GradHome.STAGED,
        ]
        assert [states.on_gpu(i) for i in range(3)] == [True, True, False]
        ds = states.device_state
        master, grad, m, v = states.device_update_state(1)
        assert master.data_ptr() == ds.master_of(1).data_ptr() == states.device_master(1).data_ptr()
        assert grad.data_ptr() == ds.grad_of(1).data_ptr() == states.grad(1).data_ptr()
        assert (m.data_ptr(), v.data_ptr()) == tuple(t.data_ptr() for t in ds.moments_of(1))
        assert torch.equal(states.device_master(0), states.master(0))
    finally:
        states.store.close()


STREAMING_CORE = ("streaming/executor.py", "streaming/landing.py", "optim/optimizer.py")
PARTS = ("device_state", "hold", "owned", "on_disk", "grad_direct", "ring", "scratch", "tier")


def test_the_landing_and_the_optimizer_ask_instead_of_reading_the_parts():
    """No read of the layer states' or the store's parts (device state, gradient hold, ownership
    list, NVMe check, GA 1 flag, landing ring) in the executor, its landing or the optimizer: they
    ask ``LayerStates``."""
    offenders = []
    for name in STREAMING_CORE:
        with open(os.path.join(PACKAGE, name), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in PARTS:
                owner = node.value
                owner_name = (
                    owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                )
                if owner_name in ("states", "layer_states", "store"):
                    offenders.append(f"{name}:{node.lineno} {owner_name}.{node.attr}")
    assert not offenders, offenders
