"""Kept layers (``megatrain.keep_activations``, executor.py's [Note: kept layers]): the trailing
layers keep their forward's graph instead of recomputing it. Every path of test_paths, rerun with
some layers kept (test_paths_rerun.py), must give the same per-parameter gradients, losses and
weights as plain PyTorch; dropout masks are drawn once; the kept weights are not reloaded for the
backward, and recompute runs only for the other layers.
"""

import copy

import pytest
import torch

import megatrain_ds
from tests.engine import test_paths
from tests.models import tiny_hf


def _counting(engine):
    """Count the executor's recomputes and H2D loads per layer."""
    ex = engine.executor
    counts = {"recompute": [], "load": []}
    recompute, load = ex._recompute, ex._load

    def _recompute(call, hidden, slot):
        counts["recompute"].append(call.index)
        return recompute(call, hidden, slot)

    def _load(i, busy):
        counts["load"].append(i)
        return load(i, busy)

    ex._recompute, ex._load = _recompute, _load
    return counts


def test_kept_layers_skip_recompute_and_reload():
    """4 layers, 2 slots, last 3 kept: one forward + backward recomputes only layer 0 and loads each
    layer once; without keeping, every layer recomputes and layers 0-1 load twice."""
    cfg = {**test_paths._config(), "megatrain": {"keep_activations": 3}}
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    runs = {}
    for keep in (0, 3):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=4),
            config={**cfg, "megatrain": {"keep_activations": keep}},
        )
        assert engine.executor.keep == frozenset(range(4 - keep, 4))
        counts = _counting(engine)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        runs[keep] = (counts, loss.item())
        engine.destroy()
    assert runs[3][0]["recompute"] == [0]
    assert sorted(runs[3][0]["load"]) == [0, 1, 2, 3]
    assert runs[0][0]["recompute"] == [3, 2, 1, 0]
    assert sorted(runs[0][0]["load"]) == [0, 0, 1, 1, 2, 3]
    assert runs[0][1] == runs[3][1]


def test_dropout_masks_drawn_once():
    """GPT-2 with dropout, 2 of 3 layers kept: the same masks as plain PyTorch (one draw per
    forward), so the losses and weights of 4 steps match."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=64,
        vocab_size=256,
        resid_pdrop=0.2,
        embd_pdrop=0.0,
        attn_pdrop=0.2,
    )
    ref = tf.GPT2LMHeadModel(cfg).to(test_paths.DEVICE)
    ours = copy.deepcopy(ref).cpu()
    batches = test_paths._batches(n=4)
    config = {**test_paths._config(), "megatrain": {"keep_activations": 2}}
    opt = torch.optim.AdamW(ref.parameters(), lr=test_paths.LR, weight_decay=0.01, eps=1e-6)
    engine, *_ = megatrain_ds.initialize(model=ours, config=config)
    for seed, ids in enumerate(batches):
        torch.manual_seed(seed)
        want = ref(input_ids=ids.to(test_paths.DEVICE), labels=ids.to(test_paths.DEVICE)).loss
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), test_paths.CLIP)
        opt.step()
        opt.zero_grad()
        torch.manual_seed(seed)
        got = engine(input_ids=ids, labels=ids).loss
        engine.backward(got)
        engine.step()
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), f"loss at step {seed}"
    masters = engine.master_state_dict()
    for name, p in ref.named_parameters():
        test_paths._close(masters[name], p.detach(), f"{name} after 4 steps")
    engine.destroy()


def test_keep_activations_auto_sizes_from_the_measured_graph(monkeypatch):
    """ "auto": after the second step, as many trailing layers as the memory left free holds at
    (largest layer graph + 10%, + the layer's weights) each; the run after the change stays exact
    (test_paths' comparison)."""
    import dataclasses

    from megatrain_ds.engine import MegaTrainEngine
    from megatrain_ds.training.engine_auto import AutoPlacer

    graph = 1000  # bytes per layer graph, as a recompute on CUDA would have measured it
    placement_parts = MegaTrainEngine.placement_parts
    monkeypatch.setattr(
        MegaTrainEngine,
        "placement_parts",
        lambda self: dataclasses.replace(placement_parts(self), graph_bytes=graph),
    )

    def budget(parts):
        per_layer = int(graph * 1.1) + max(l.numel for l in parts.store.layouts) * 4
        return 2 * per_layer + per_layer // 2  # room for 2 layers, not 3

    monkeypatch.setattr(AutoPlacer, "budget_bytes", lambda self, parts: budget(parts))
    test_paths.run_with(monkeypatch, {"keep_activations": "auto", "gpu_optimizer_layers": 0})
    engine = test_paths._compare(
        tiny_hf("llama"), lambda m, ids: m(input_ids=ids, labels=ids).loss, test_paths._batches()
    )
    n = len(engine.store.layouts)
    assert engine.executor.keep == frozenset({n - 2, n - 1})


@pytest.mark.parametrize("key", ["keep_activations", "weight_cache_layers"])
@pytest.mark.parametrize("bad", [-1, "all", True, 1.5])
def test_layer_counts_of_the_executors_memory_reject_bad_values(key, bad):
    with pytest.raises(megatrain_ds.ConfigError, match=f"megatrain.{key}"):
        megatrain_ds.initialize(
            model=tiny_hf("llama"),
            config={**test_paths._config(), "megatrain": {key: bad}},
        )


@pytest.mark.gpu
def test_gpu_keep_activations_auto_keeps_layers_and_matches_recompute():
    """On a real GPU "auto" measures the layer graphs of the first steps and keeps layers after the
    second (a tiny model: all of them); 5 fp32 steps give the losses of the all-recompute run to
    1e-5, and the kept steps run no recompute."""
    runs = {}
    for keep in (0, "auto"):
        torch.manual_seed(0)
        cfg = {
            **test_paths._config(),
            "megatrain": {"keep_activations": keep, "gpu_optimizer_layers": 0},
        }
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=4), config=cfg)
        counts = _counting(engine)
        losses = []
        for ids in test_paths._batches(n=5):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[keep] = (losses, engine.executor.keep, counts["recompute"])
        engine.destroy()
    assert runs[0][1] == frozenset() and len(runs[0][2]) == 5 * 4
    # only the first two steps
    assert runs["auto"][1] == frozenset(range(4)) and runs["auto"][2] == [3, 2, 1, 0] * 2
    torch.testing.assert_close(
        torch.tensor(runs["auto"][0]), torch.tensor(runs[0][0]), rtol=1e-5, atol=0
    )


def test_out_of_memory_after_auto_placement_names_the_keys(monkeypatch):
    """A device OOM in a later, larger step after "auto" used the free memory says which keys give
    it back."""
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=test_paths._config())
    # as after_step records it
    engine.auto_placer.placed = "3 of 3 layers kept without recompute (1.0 GiB)"

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine, "_forward_fused_loss", oom)
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(torch.OutOfMemoryError, match="megatrain.keep_activations") as err:
        engine(input_ids=ids, labels=ids)
    assert "Tried to allocate 2.00 GiB" in str(err.value) and "3 of 3 layers kept" in str(err.value)
    engine.destroy()


@pytest.mark.parametrize(
    "exposure,extra_states,expect_state,expect_keep",
    [
        (0.10, 0, 2, {3}),  # the cap: ceil(1.5 * 0.10 / 0.1) = 2 layers' state, a kept layer after
        (0.15, 0, 3, set()),  # the margin: 3 (ceil(0.15 / 0.1) would have been 2 and a kept layer)
        (0.10, 1, 3, {3}),  # what the kept layer leaves goes to a third layer's state
        (0.01, 0, None, {2, 3}),  # hidden: kept layers first
    ],
)
def test_auto_places_optimizer_state_first_when_the_host_update_was_exposed(
    monkeypatch, exposure, extra_states, expect_state, expect_keep
):
    """engine_auto's [Note: auto placement order]: with the second step's forward held by the host
    update (0.1 s a layer) the step is host-bound: leading layers' state first, as many as the
    exposure pays for with the margin (EXPOSURE_MARGIN), then kept layers, then further layers'
    state in what they left; held 0.01 s (hidden), kept layers first. The budget holds the resident
    state, two layers' state, a kept layer and ``extra_states`` more layers' state. (The engine's
    ``AutoPlacer`` calls ``_place`` after its second step with what it measured; here the
    measurements are given.)"""
    from megatrain_ds.host.device_state import DeviceOptimizerState
    from megatrain_ds.training.engine_auto import AutoPlacer
    from megatrain_ds.training.engine_auto import (
        _keep_bytes_per_layer,
        _place,
        host_update_exposure,
    )

    cfg = {
        **test_paths._config(),
        "megatrain": {"keep_activations": "auto", "gpu_optimizer_layers": "auto"},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=4), config=cfg)
    store = engine.store
    state = DeviceOptimizerState.nbytes(store, 1)
    assert DeviceOptimizerState.nbytes(store, 3) == 3 * state  # the layers are alike
    # a kept layer takes about a layer's state (and its weights)
    engine.executor.graph_bytes = int(state / 1.1)
    keep = _keep_bytes_per_layer(engine.placement_parts())
    assert state < keep < 2 * state
    budget = engine.resident.device_bytes() + (2 + extra_states) * state + keep + 1
    monkeypatch.setattr(AutoPlacer, "budget_bytes", lambda self, parts: budget)
    params = [lay.n_train for lay in store.layouts]
    delta = {
        "wait_for_optimizer_s": exposure,
        "optimizer_s": 0.1 * sum(params) / max(params),
        "updated_params": float(sum(params)),
    }
    assert abs(host_update_exposure(1.0, delta, params)[1] - 0.1) < 1e-9
    placed = _place(engine.placement_parts(), True, True, budget, 1.0, delta)
    ds = engine.layer_states.device_state
    n_state = 0 if ds is None else ds.hi
    assert engine.resident.on_device
    assert engine.executor.keep == frozenset(expect_keep), placed
    if expect_state is not None:
        assert n_state == expect_state and "optimizer state first" in placed, placed
    else:  # the kept layers take what they can of the budget first (a kept layer holds its weights)
        assert n_state < 2 and "optimizer state first" not in placed, placed
    ids = test_paths._batches(n=1)[0]  # and it trains on
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    engine.destroy()


def test_the_placement_says_what_it_left_unplaced_and_why():
    """What "auto" leaves free above the reserve is named with the next unit of each placement,
    larger than it (7B on 24 GiB: a layer's state 3.45 GiB, a kept layer 1.7 GiB): a host-bound
    step's budget holding the resident state, two layers' state, a kept layer and half a layer's
    state more leaves that half, and the line says one more layer's state and kept layer need
    more."""
    from megatrain_ds.host.device_state import DeviceOptimizerState
    from megatrain_ds.planning import fmt_bytes
    from megatrain_ds.training.engine_auto import _keep_bytes_per_layer, _place

    cfg = {
        **test_paths._config(),
        "megatrain": {"keep_activations": "auto", "gpu_optimizer_layers": "auto"},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=4), config=cfg)
    state = DeviceOptimizerState.nbytes(engine.store, 1)
    engine.executor.graph_bytes = int(state / 1.1)
    keep = _keep_bytes_per_layer(engine.placement_parts())
    half = state // 2
    budget = engine.resident.device_bytes() + 2 * state + keep + half
    params = [lay.n_train for lay in engine.store.layouts]
    delta = {
        "wait_for_optimizer_s": 0.10,  # exposed: the cap is 2 layers' state
        "optimizer_s": 0.1 * sum(params) / max(params),
        "updated_params": float(sum(params)),
    }
    placed = _place(engine.placement_parts(), True, True, budget, 1.0, delta)
    assert engine.layer_states.device_state.hi == 2 and engine.executor.keep == frozenset({3})
    assert (
        f"{fmt_bytes(half)} left unplaced (one more layer's optimizer state takes "
        f"{fmt_bytes(state)}, one more kept layer {fmt_bytes(keep)})" in placed
    ), placed
    engine.destroy()


def test_the_placement_line_names_the_allocators_gap_when_it_is_large(monkeypatch):
    """The log line of "auto"'s placement says how far the allocator's reserved peak ran over its
    allocated peak (what the budget went around) from 1 GiB on; nothing under it or off CUDA."""
    import torch

    from megatrain_ds.training import engine_auto

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 16 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 21 * 2**30)
    assert "reserved peak was 5.0 GiB over its allocated peak" in engine_auto._allocator_gap(cuda)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 16.5 * 2**30)
    assert engine_auto._allocator_gap(cuda) == ""
    assert engine_auto._allocator_gap(torch.device("cpu")) == ""
