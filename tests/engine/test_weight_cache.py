"""The weight cache (``megatrain.weight_cache_layers``, executor.py's [Note: weight cache]): some
layers keep their weights in a buffer of their own from their forward to their backward, so their
recompute reads them there instead of loading them again. Every path of test_paths, rerun with the
cache on (test_paths_rerun.py), must give the same per-parameter gradients, losses and weights as
plain PyTorch; a cached layer loads once a step; the plan counts its buffers."""

import pytest
import torch

import megatrain_ds
from megatrain_ds.planning import plan
from tests.engine import test_paths
from tests.engine.test_keep import _counting
from tests.models import tiny_hf


def _step_counts(megatrain: dict, layers: int = 6, steps: int = 2):
    """Each step's recomputes and loads, the losses and the final weights of a ``layers``-layer
    llama trained ``steps`` steps with ``megatrain``'s settings."""
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=layers),
        config={**test_paths._config(), "megatrain": megatrain},
    )
    try:
        per_step, losses, counts = [], [], _counting(engine)
        for _ in range(steps):
            seen = {k: len(v) for k, v in counts.items()}
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            per_step.append({k: v[seen[k] :] for k, v in counts.items()})
            losses.append(loss.item())
        engine.synchronize()
        cached = engine.executor.cached
        weights = [engine.store.master_of(i).clone() for i in range(layers)]
    finally:
        engine.destroy()
    return per_step, losses, weights, cached


def test_cached_layers_load_once_a_step_and_train_the_same():
    """6 layers, 2 slots, 2 cached: the trailing non-kept layers less the last 2 (still in the
    rotating slots when the backward starts), so layers 3 and 2. Each step loads every layer for
    the forward and reloads only 1 and 0 for the backward (without the cache: 3, 2, 1 and 0); every
    layer is still recomputed; the losses and the weights after two steps are bit-identical."""
    base = _step_counts({"weight_cache_layers": 0, "keep_activations": 0})
    held = _step_counts({"weight_cache_layers": 2, "keep_activations": 0})
    assert held[3] == frozenset({2, 3}) and base[3] == frozenset()
    for counts in held[0]:  # both steps: the second reloads the updated weights into the buffers
        assert sorted(counts["load"]) == [0, 0, 1, 1, 2, 3, 4, 5], counts
        assert counts["recompute"] == [5, 4, 3, 2, 1, 0]
    for counts in base[0]:
        assert sorted(counts["load"]) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 5], counts
    assert held[1] == base[1]
    assert all(torch.equal(a, b) for a, b in zip(held[2], base[2]))


def test_the_cache_takes_layers_below_the_kept_ones():
    """6 layers, the last 2 kept: the cache takes 1 and 0 (2 and 3 are in the rotating slots when
    the backward reaches them), so no layer loads twice."""
    held = _step_counts({"weight_cache_layers": 5, "keep_activations": 2}, steps=1)
    assert held[3] == frozenset({0, 1})
    assert sorted(held[0][0]["load"]) == [0, 1, 2, 3, 4, 5]
    assert held[0][0]["recompute"] == [3, 2, 1, 0]


def test_an_explicit_count_is_chosen_again_when_the_kept_layers_change():
    """An explicit count is placed at initialize, before "auto" keeps layers or moves their state
    at the second step: when the kept layers change, the same count is chosen again below them (6
    layers, 2 slots, 2 cached: {2, 3}; then the last 2 kept: {0, 1}, no buffer left on a layer
    the backward finds in the rotating slots); when layers' state moves to the GPU, the cache
    leaves them."""
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=6),
        config={
            **test_paths._config(),
            "megatrain": {"weight_cache_layers": 2, "keep_activations": 0},
        },
    )
    ex = engine.executor
    try:
        assert ex.cached == frozenset({2, 3}) and set(ex.cache_slots) == {2, 3}
        ex.set_keep(2)
        assert ex.cached == frozenset({0, 1}) and set(ex.cache_slots) == {0, 1}
        engine.move_layer_state_to_device(1)  # layer 0's state, as "auto" would on CUDA
        ex.set_weight_cache(None)
        assert ex.cached == frozenset({1}) and set(ex.cache_slots) == {1}
        ex.set_keep(0)
        assert ex.cached == frozenset({2, 3})
    finally:
        engine.destroy()


def test_the_plan_counts_the_cached_layers_buffers():
    """The plan's GPU part for an explicit count: the bytes of the buffers the engine makes."""
    cfg = {**test_paths._config(), "megatrain": {"weight_cache_layers": 2, "keep_activations": 0}}
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=6), config=cfg)
    made = sum(s.buf.numel() * s.buf.element_size() for s in engine.executor.cache_slots.values())
    engine.destroy()
    pred = plan.plan_model(
        tiny_hf("llama", layers=6),
        plan.load_train_config(cfg),
        seq=10,
        device="cuda",
        gpu_memory=2**30,
    )
    assert made > 0 and pred.gpu_parts["weight-cached layers' buffers"] == made


def test_auto_holds_weights_in_what_the_kept_layers_left(monkeypatch):
    """ "auto" after the second step: the kept layers first, then as many layers' weights as the
    rest holds (a budget for one kept layer and two and a half layers' weights: one kept, two
    cached); the training after it stays exact (test_paths' comparison against plain PyTorch)."""
    import dataclasses

    from megatrain_ds.engine import MegaTrainEngine
    from megatrain_ds.training.engine_auto import AutoPlacer

    placement_parts = MegaTrainEngine.placement_parts

    def with_graph(self):  # a layer graph 10 layers' weights large, as CUDA would have measured
        parts = placement_parts(self)
        per_layer = max(lay.numel for lay in parts.store.layouts) * parts.weight_itemsize
        return dataclasses.replace(parts, graph_bytes=10 * per_layer)

    monkeypatch.setattr(MegaTrainEngine, "placement_parts", with_graph)

    def budget(parts):
        per_layer = max(lay.numel for lay in parts.store.layouts) * parts.weight_itemsize
        kept = int(parts.graph_bytes * 1.1) + per_layer
        return kept + 2 * per_layer + per_layer // 2

    monkeypatch.setattr(AutoPlacer, "budget_bytes", lambda self, parts: budget(parts))
    test_paths.run_with(
        monkeypatch,
        {"keep_activations": "auto", "weight_cache_layers": "auto", "gpu_optimizer_layers": 0},
    )
    engine = test_paths._compare(
        tiny_hf("llama", layers=6),
        lambda m, ids: m(input_ids=ids, labels=ids).loss,
        test_paths._batches(),
    )
    assert engine.executor.keep == frozenset({5})
    assert engine.executor.cached == frozenset({1, 2})
    assert engine.auto_placer.placed.startswith("1 of 6 layers kept"), engine.auto_placer.placed
    assert "2 layers' weights held from forward to backward" in engine.auto_placer.placed


@pytest.mark.gpu
def test_gpu_weight_cache_auto_holds_layers_and_trains_the_same():
    """On a real GPU, on its streams: "auto" (no kept layers) holds every candidate layer's weights
    after the second step (a tiny model: 6 layers, 2 slots, so 4); the next steps load each layer
    once, and 5 fp32 steps give the losses and weights of the run without the cache (to 1e-5, as
    the kept layers' GPU test: cuBLAS is not promised bitwise across runs)."""
    settings = {"keep_activations": 0, "gpu_optimizer_layers": 0}
    base = _step_counts({**settings, "weight_cache_layers": 0}, steps=5)
    held = _step_counts({**settings, "weight_cache_layers": "auto"}, steps=5)
    assert base[3] == frozenset() and held[3] == frozenset({0, 1, 2, 3})
    for counts in held[0][2:]:  # after the placement: 4 and 5 found in the rotating slots
        assert sorted(counts["load"]) == list(range(6)), counts
    torch.testing.assert_close(torch.tensor(held[1]), torch.tensor(base[1]), rtol=1e-5, atol=0)
    for a, b in zip(held[2], base[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
