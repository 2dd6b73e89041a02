"""ModelState (host/model_state.py) without an engine: every parameter's home answers the same
questions whatever the kind (a layer in RAM, a GPU-held layer, a layer another rank holds, a
resident parameter), and ``read_master`` gives back what ``write_master`` wrote."""

from __future__ import annotations

import types

import pytest
import torch

from megatrain_ds.api.zero import mark_partitioned
from megatrain_ds.host.host_state import HostLayerStore
from megatrain_ds.host.layer_state import Home, LayerStates
from megatrain_ds.host.model_state import LayerParamHome, ModelState, ResidentParamHome
from megatrain_ds.host.resident_state import ResidentState
from megatrain_ds.model.model_map import build_layout
from tests.models import PlainLM

OWNER_VALUE = 7.0  # what "rank 1" sends for the layer it holds


class FakeRanks:
    """Two data-parallel ranks seen from rank 0: layer 2 is rank 1's, everything else rank 0's."""

    active, rank, cpu_group = True, 0, None

    def owner(self, i: int) -> int:
        return 1 if i == 2 else 0

    def resident_owner(self, k: int) -> int:
        return 0


def _broadcast(tensor, src, group=None):
    """torch.distributed.broadcast on rank 0 of two: rank 0's own tensor stays, rank 1's value
    arrives."""
    if src != 0:
        tensor.fill_(OWNER_VALUE)


@pytest.fixture
def built(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "broadcast", _broadcast)
    model = PlainLM(vocab=16, width=8, depth=3)
    group_of = {id(p): 0 for p in model.parameters()}
    layouts = [build_layout(i, block, group_of) for i, block in enumerate(model.blocks)]
    store = HostLayerStore(layouts, torch.float32, False, pin=False, owned=[True, True, False])
    for i, block in enumerate(model.blocks):
        store.load_layer(i, block)
    store.finish_loading()
    layers = LayerStates(store, torch.device("cpu"))
    layers.place_on_device(1)  # layer 0's state "GPU-held" (the device is the CPU here)
    resident_params = [model.embed.weight, model.head.weight, model.head.bias]
    resident = ResidentState(
        resident_params, group_of, torch.device("cpu"), torch.float32, pin=False, dp=FakeRanks()
    )
    written = []
    state = ModelState(
        layers,
        resident,
        FakeRanks(),
        torch.device("cpu"),
        "blocks",
        module=model,
        on_layer_written=written.append,
    )
    state.mark_params(model.blocks, mark_partitioned)
    return types.SimpleNamespace(model=model, state=state, layers=layers, written=written)


CASES = [  # (case, parameter, home class, where, held here, owner rank, description)
    (
        "layer in RAM",
        lambda m: m.blocks[1].fc1.weight,
        LayerParamHome,
        Home.RAM,
        True,
        0,
        "layer 1's fc1.weight",
    ),
    (
        "GPU-held layer",
        lambda m: m.blocks[0].fc2.weight,
        LayerParamHome,
        Home.GPU,
        True,
        0,
        "layer 0's fc2.weight",
    ),
    (
        "another rank's layer",
        lambda m: m.blocks[2].norm.weight,
        LayerParamHome,
        Home.OTHER_RANK,
        False,
        1,
        "layer 2's norm.weight",
    ),
    (
        "resident parameter",
        lambda m: m.embed.weight,
        ResidentParamHome,
        None,
        True,
        0,
        "resident parameter 0 (shape (16, 8))",
    ),
]


@pytest.mark.parametrize("case,get,kind,where,held,owner,text", CASES, ids=[c[0] for c in CASES])
def test_every_home_answers_the_same_questions(built, case, get, kind, where, held, owner, text):
    param = get(built.model)
    home = built.state.home_of(param)
    assert type(home) is kind and home is param.megatrain_home
    if where is not None:
        assert built.layers.where(home.index) is where
    assert home.held_here() is held and home.owner_rank() == owner and home.trained()
    assert home.describe() == text and home.shape == tuple(param.ds_shape)
    value = torch.randn(home.shape)
    built.state.write_master(home, value)
    got = built.state.read_master(home)
    assert got.dtype == torch.float32 and tuple(got.shape) == home.shape
    if held:  # this rank's state: what was written
        assert torch.equal(got.cpu(), value)
        moment = home.moment("exp_avg")
        assert tuple(moment.shape) == home.shape
    else:  # another rank's: its owner's value comes over (the broadcast), nothing is written here
        assert torch.equal(got, torch.full(home.shape, OWNER_VALUE))
    if kind is LayerParamHome:  # the layer's slots are stale after the write, held here or not
        assert built.written[-1] == home.index


def test_a_gpu_held_write_reaches_the_device_master(built):
    param = built.model.blocks[0].fc1.weight
    value = torch.randn(param.ds_shape)
    built.state.home_of(param).write_master(value)
    assert torch.equal(built.layers.device_param(0, "fc1.weight"), value)


def test_a_checkpoint_listing_finds_the_same_home(built):
    state = built.state
    for (i, name), home in state.layer_homes.items():
        layout = state.layers.layouts[i]
        start = home.slot.offset + (0 if home.slot.trainable else layout.n_train)
        assert state.home_at(i, start) is home
    home = state.home_at(None, 1)
    assert home is built.model.head.weight.megatrain_home
    value = torch.randn(home.shape)
    home.write_master(value)
    assert torch.equal(home.checkpoint_flat("master"), value.reshape(-1))


def test_a_parameter_of_another_model_state_is_refused(built):
    with pytest.raises(ValueError, match="not trained by this megatrain_ds engine"):
        built.state.home_of(torch.nn.Parameter(torch.zeros(2)))
    built.state.unmark(built.model.parameters())
    assert not any(hasattr(p, "megatrain_home") for p in built.model.parameters())
