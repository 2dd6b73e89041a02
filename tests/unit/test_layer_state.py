"""One owner of where each streamed layer's state lives (host/layer_state.py, issue 28):
``where(i)`` answers RAM, NVMe, GPU-held (on CPU the "device" is the CPU) and the reads it offers
equal what ``master_state_dict`` gives; checkpoints, exports, the surface and zero.py ask it instead
of checking the store, the tier or the device state."""

from __future__ import annotations

import ast
import os

import pytest
import torch

import megatrain_ds
from megatrain_ds.host.layer_state import Home, LayerStates
from tests.models import tiny_hf

PACKAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "megatrain_ds"
)


def _engine(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "megatrain": {
            "gpu_optimizer_layers": 1,
            "keep_activations": 0,
            "nvme_layers": 1,
            "nvme_backend": "threads",
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "aio": {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 1},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=3, seed=0), config=cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the state moves off its initial values
        ids = torch.randint(0, 256, (2, 12), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return engine


def test_where_and_reads_match_the_master_state_dict(tmp_path):
    engine = _engine(tmp_path)
    try:
        states = engine.layer_states
        assert isinstance(states, LayerStates) and len(states) == 3
        assert [states.where(i) for i in range(3)] == [Home.GPU, Home.RAM, Home.NVME]
        assert states.owned_layers() == [0, 1, 2] and states.gpu_layers() == range(0, 1)
        engine.synchronize()
        states.refresh_host_masters(range(3))  # the GPU-held layer's master from the device, once
        fresh = {
            (i, slot.name): states.param_master(i, slot.name).clone()
            for i, layout in enumerate(states.layouts)
            for slot in layout.slots
        }
        masters = engine.master_state_dict()  # syncs the GPU-held layer to the host
        for (i, name), value in fresh.items():
            assert torch.equal(value, masters[f"{engine.block_name}.{i}.{name}"].float()), (i, name)
        for i, layout in enumerate(states.layouts):
            flat = states.full_master(i)
            for slot in layout.slots:
                start = slot.offset + (0 if slot.trainable else layout.n_train)
                assert torch.equal(
                    flat[start : start + slot.numel].view(slot.shape),
                    masters[f"{engine.block_name}.{i}.{slot.name}"].float(),
                )
        # moments: the live ones (the device's for layer 0, a copy staged from the swap file for
        # layer 2)
        for i in range(3):
            m, v = states.moments(i)
            assert m.numel() == states.layouts[i].n_train and float(v.abs().sum()) > 0
        assert torch.equal(states.moments(0)[0], engine.layer_states.device_state.moments_of(0)[0])
    finally:
        engine.destroy()


CALLERS = (
    "checkpoints/checkpoint.py",
    "checkpoints/checkpoint_partition.py",
    "checkpoints/checkpoint_folder.py",
    "checkpoints/checkpoint_files.py",
    "checkpoints/export.py",
    "api/surface.py",
    "api/zero.py",
    "api/utils.py",
)


def _nodes(names):
    """(module name, AST node) of every node in the named package modules."""
    for name in names:
        path = os.path.join(PACKAGE, name)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            yield name, node


def test_callers_ask_the_owner():
    """No ``.owns(`` / ``.on_disk(`` call and no ``device_state`` name or attribute in the modules
    that ask ``engine.layer_states``."""
    offenders = []
    for name, node in _nodes(CALLERS):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("owns", "on_disk")
        ):
            offenders.append(f"{name}:{node.lineno} .{node.func.attr}(")
        elif isinstance(node, ast.Attribute) and node.attr == "device_state":
            offenders.append(f"{name}:{node.lineno} .device_state")
        elif isinstance(node, ast.Name) and node.id == "device_state":
            offenders.append(f"{name}:{node.lineno} device_state")
    assert not offenders, offenders


def test_the_one_transition_moves_the_leading_homes_once():
    """``place_on_device`` is the transition RAM -> GPU of the leading layers: ``where`` follows it
    (answers kept per transition, not recomputed per ask), and a second placement is refused, not
    silently replacing the first (the device state's moments would be lost)."""
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=3, seed=0),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "megatrain": {"gpu_optimizer_layers": 0},
        },
    )
    try:
        states = engine.layer_states
        assert (
            states.homes == [Home.RAM] * 3 and states.device_state is None and states.hold is None
        )
        # given, not found
        assert engine.executor.states is states and engine.optimizer.parts.states is states
        states.place_on_device(2, moments_from_host=True)
        assert [states.where(i) for i in range(3)] == [Home.GPU, Home.GPU, Home.RAM]
        assert states.on_gpu(1) and not states.on_gpu(2) and states.gpu_layers() == range(0, 2)
        with pytest.raises(AssertionError, match="once"):
            states.place_on_device(1)
        assert states.gpu_layers() == range(0, 2)  # the first one stands
    finally:
        engine.destroy()


STREAMING_CORE = (
    "streaming/executor.py",
    "streaming/landing.py",
    "optim/optimizer.py",
    "training/engine_auto.py",
)


def test_the_streaming_core_asks_the_owner():
    """The executor, its landing and the optimizer read the device state and the gradient hold only
    through the ``LayerStates`` they were given (``states.device_state``, ``states.hold``,
    ``states.on_gpu(i)``): no ``x.device_state`` or ``store.hold`` on anything else, and nobody but
    layer_state.py assigns a device state."""
    offenders = []
    for name, node in _nodes(STREAMING_CORE):
        if isinstance(node, ast.Attribute) and node.attr in ("device_state", "hold"):
            owner = node.value
            owner_name = (
                owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            )
            if owner_name not in ("states", "layer_states") and not (
                name.endswith("engine_auto.py")
                # its own flag
                and owner_name == "self"
            ):
                offenders.append(f"{name}:{node.lineno} {owner_name}.{node.attr}")
    assert not offenders, offenders


def test_nothing_writes_into_the_executor():
    """The executor is given what it needs in its constructor (its LayerStates, trace, inference
    cache, activation offload, the engine's loss.backward() callback): no module of the package but
    executor.py itself assigns an attribute of an object it calls ``executor`` (issue 41: 5 such
    writes, then 4, now none)."""
    names = [
        os.path.relpath(os.path.join(root, f), PACKAGE)
        for root, _, files in os.walk(PACKAGE)
        for f in files
        if f.endswith(".py")
    ]
    names.remove(os.path.join("streaming", "executor.py"))
    offenders = []
    for name, node in _nodes(names):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute):
                owner = target.value
                owner_name = (
                    owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                )
                if owner_name in ("executor", "ex"):
                    offenders.append(f"{name}:{node.lineno} {owner_name}.{target.attr} =")
    assert not offenders, offenders
