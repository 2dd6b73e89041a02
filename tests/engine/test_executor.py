"""The executor's schedule: prefetch order, slot reuse, two H2D per layer per step at most, D2H per
layer.

The schedule is recorded by the executor itself (``megatrain.trace``); the CPU stand-in streams and
the CUDA streams run the same executor code, so the same expected trace holds on both (this file
runs on the GPU box as well, where the engine uses real streams).
"""

import inspect

import pytest
import torch

import megatrain_ds
from megatrain_ds.streaming.streams import CpuStreams, CudaStreams
from tests.models import tiny_hf

LAYERS = 4
# the streaming schedule itself: every layer recomputed, all optimizer state on the host (the "auto"
# placements after the first step on CUDA would change what these tests look at; test_keep.py covers
# kept layers)
HOST = {"keep_activations": 0, "gpu_optimizer_layers": 0}


def _engine(num_slots=2, ga=1, layers=LAYERS):
    model = tiny_hf("llama", layers=layers)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "megatrain": {"num_slots": num_slots, "trace": True, **HOST},
    }
    engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
    return engine


def _train_step(engine, seed=0):
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def _expected_trace(layers: int, num_slots: int) -> list[tuple]:
    """Forward: load 0, then before computing i load i+1. Backward: the last ``num_slots`` layers
    are still resident; before computing i, load i-1 if it is not. Each backward compute is followed
    by its D2H."""
    trace, slot_of = [], {}
    trace.append(("h2d", 0, 0))
    slot_of[0] = 0
    for i in range(layers):
        if i + 1 < layers:
            slot_of[i + 1] = (i + 1) % num_slots
            trace.append(("h2d", i + 1, slot_of[i + 1]))
        trace.append(("fwd", i, slot_of[i]))
    resident = set(range(max(0, layers - num_slots), layers))
    for i in reversed(range(layers)):
        if i - 1 >= 0 and i - 1 not in resident:
            slot_of[i - 1] = _lru_slot(slot_of, i, layers, num_slots, resident)
            resident.add(i - 1)
            trace.append(("h2d", i - 1, slot_of[i - 1]))
        trace.append(("bwd", i, slot_of[i]))
        trace.append(("d2h", i, None))
    return trace


def _lru_slot(slot_of, current, layers, num_slots, resident):
    # Slots in use by layers > current are finished in backward; the one used longest ago is that of
    # the highest layer still mapped (it was last touched in forward, before the others).
    candidates = [(l, s) for l, s in slot_of.items() if l > current and s != slot_of[current]]
    layer, slot = max(candidates)
    del slot_of[layer]
    resident.discard(layer)
    return slot


@pytest.mark.parametrize("num_slots", [2, 3])
def test_schedule_prefetches_and_reuses_slots(num_slots):
    engine = _engine(num_slots=num_slots)
    _train_step(engine)
    assert engine.executor.trace == _expected_trace(LAYERS, num_slots)
    h2d = [op for op in engine.executor.trace if op[0] == "h2d"]
    # < 2 per layer: the last layers are reused in backward
    assert len(h2d) == 2 * LAYERS - num_slots
    engine.destroy()


def test_second_step_reloads_updated_weights_in_forward_order():
    engine = _engine()
    _train_step(engine, 0)
    engine.executor.trace.clear()
    _train_step(engine, 1)
    loads = [layer for op, layer, _ in engine.executor.trace if op == "h2d"]
    # every layer was updated by step 1, so slots holding stale versions are not reused in forward
    assert loads[:LAYERS] == list(range(LAYERS))
    engine.destroy()


def test_gradient_accumulation_loads_each_micro_batch():
    engine = _engine(ga=2)
    _train_step(engine, 0)
    n_first = sum(op == "h2d" for op, _, _ in engine.executor.trace)
    _train_step(engine, 1)
    n_both = sum(op == "h2d" for op, _, _ in engine.executor.trace)
    assert n_first == 2 * LAYERS - 2
    # weights are unchanged inside the window, so the next forward also reuses the two slots that
    # the backward ended with (layers 1 and 0): two fewer loads again
    assert n_both - n_first == 2 * LAYERS - 4
    assert engine.global_steps == 1 and engine.micro_steps == 2
    engine.destroy()


def test_cpu_and_cuda_streams_offer_the_same_interface():
    """The executor only calls these methods, so both stream sets run the identical schedule
    code."""
    methods = lambda cls: {
        n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")
    }
    assert methods(CpuStreams) == methods(CudaStreams)
    engine = _engine()
    expected = CudaStreams if torch.cuda.is_available() else CpuStreams
    assert isinstance(engine.streams, expected)
    engine.destroy()


def test_gpu_memory_does_not_hold_the_model():
    """Device slots hold at most num_slots layers; the layer parameters own no storage of their
    own."""
    engine = _engine(num_slots=2, layers=6)
    for layer in engine.module.model.layers:
        assert all(p.numel() == 0 and p.ds_numel > 0 for p in layer.parameters())
    assert len(engine.executor.slots) == 2
    assert engine.executor.slots[0].buf.numel() == max(l.numel for l in engine.store.layouts)
    engine.destroy()


@pytest.mark.gpu
def test_gpu_peak_memory_flat_in_depth():
    peaks = []
    for layers in (4, 16):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        engine = _engine(layers=layers)
        for s in range(2):
            _train_step(engine, s)
        engine.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        engine.destroy()
        del engine
    # weights: 2 slots either way; only the saved layer inputs (tiny here) grow with depth
    assert peaks[1] < 1.5 * peaks[0], peaks


def test_landing_ring_returns_each_slab_exactly_once():
    """GA > 1: gradients land in a ring of 4 pinned slabs; each fold must give back its own slab (a
    slab given back twice, or the whole ring as one slab, lets a D2H overwrite bytes still being
    folded)."""
    engine = _engine(ga=2)
    for s in range(4):
        _train_step(engine, s)
    engine.synchronize()
    ring = engine.store.ring
    slabs = [ring.get_nowait() for _ in range(ring.qsize())]
    assert len(slabs) == 4
    assert all(slab.numel() == engine.store.max_train for slab in slabs)
    assert len({slab.data_ptr() for slab in slabs}) == 4
    engine.destroy()


def test_template_gets_each_layers_own_attributes():
    """Layers sharing a template differ in scalars such as layer_idx (KV-cache slot) and
    sliding_window: the executor sets layer i's values on the template before running layer i."""
    import transformers as tf

    cfg = tf.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        use_sliding_window=True,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    engine, *_ = megatrain_ds.initialize(
        model=tf.Qwen2ForCausalLM(cfg), config={"train_micro_batch_size_per_gpu": 1}
    )
    assert len(engine.executor.templates) == 1
    for i in range(4):
        template = engine.executor._template(i)
        assert template.self_attn.layer_idx == i
        assert template.self_attn.sliding_window == (3 if i % 2 == 0 else None)
    engine.destroy()


@pytest.mark.gpu
def test_gpu_offloaded_activations_cut_peak_memory():
    peaks = []
    for offload in (False, True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = tiny_hf("llama", layers=16)
        cfg = {
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "megatrain": {"offload_activations": offload, **HOST},
        }
        engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
        ids = torch.randint(0, 256, (8, 512))
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        engine.destroy()
    # 16 saved inputs of 8x512x64 fp32 = 16 MiB on the GPU without offload
    assert peaks[1] < peaks[0] - 8 * 2**20, peaks


def _five_step_run(arch: str, layers: int, megatrain: dict, inspect_engine):
    """5 fp32 steps of a tiny model with the given ``megatrain`` block: (losses,
    inspect_engine(engine))."""
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
        "megatrain": {"keep_activations": 0, **megatrain},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf(arch, layers=layers), config=cfg)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        ids = torch.randint(0, 256, (2, 64), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    seen = inspect_engine(engine)
    engine.destroy()
    return losses, seen


@pytest.mark.gpu
def test_gpu_auto_optimizer_state_placement():
    """gpu_optimizer_layers "auto" on a real GPU: a tiny model's whole layer state fits, so after
    the first step every layer's state is on the GPU; the losses stay those of the all-on-host run
    (fp32)."""

    def placed(engine):
        ds = engine.layer_states.device_state
        return None if ds is None else (ds.lo, ds.hi, ds.master.is_cuda)

    host_losses, host_placed = _five_step_run("llama", 4, {"gpu_optimizer_layers": 0}, placed)
    auto_losses, auto_placed = _five_step_run("llama", 4, {"gpu_optimizer_layers": "auto"}, placed)
    assert host_placed is None and auto_placed == (0, 4, True)
    torch.testing.assert_close(
        torch.tensor(auto_losses), torch.tensor(host_losses), rtol=1e-5, atol=0
    )


@pytest.mark.gpu
def test_gpu_liger_kernels_in_the_layers():
    """megatrain.liger_kernels: the layer templates run liger's RMSNorm (and SwiGLU; RoPE patched
    module-wide); 5 fp32 steps give the losses of the model's own kernels to 1e-4."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    def liger_norm(engine):
        return (
            getattr(engine.executor.templates[0].input_layernorm.forward, "__func__", None)
            is LigerRMSNorm.forward
        )

    own_losses, own_liger = _five_step_run("qwen2", 3, {"liger_kernels": False}, liger_norm)
    liger_losses, liger_used = _five_step_run("qwen2", 3, {"liger_kernels": True}, liger_norm)
    assert liger_used and not own_liger
    torch.testing.assert_close(
        torch.tensor(liger_losses), torch.tensor(own_losses), rtol=1e-4, atol=0
    )


@pytest.mark.gpu
def test_gpu_liger_probe_runs_the_kernels_and_a_failure_falls_back_or_refuses(monkeypatch, caplog):
    """initialize runs liger's RoPE, RMSNorm and SwiGLU once on the model's sizes before patching:
    they run here; when one fails (a Triton build error, as seen on an H200), "auto" keeps the
    model's own kernels with a warning naming it, and liger_kernels true refuses with a ConfigError,
    before any step."""
    pytest.importorskip("liger_kernel")
    from megatrain_ds.planning.config import ConfigError
    from megatrain_ds.training import engine_build

    config = tiny_hf("qwen2").config
    rng = torch.cuda.get_rng_state()
    for dtype in (torch.bfloat16, torch.float32):
        assert engine_build.probe_liger_kernels(config, torch.device("cuda"), dtype) is None
    assert torch.equal(torch.cuda.get_rng_state(), rng)  # dropout's RNG is not moved by the probe
    monkeypatch.setattr(
        engine_build,
        "probe_liger_kernels",
        lambda *a: "RoPE (test sizes): RuntimeError: PassManager::run failed",
    )
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "megatrain": {"liger_kernels": "auto"},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("qwen2"), config=cfg)
    assert engine.liger_model_type is None
    assert "liger-kernel fails on this GPU (RoPE (test sizes)" in caplog.text
    ids = torch.randint(0, 256, (2, 8))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    engine.destroy()
    cfg["megatrain"]["liger_kernels"] = True
    with pytest.raises(
        ConfigError, match="liger_kernels is true but liger-kernel fails on this GPU: RoPE"
    ):
        megatrain_ds.initialize(model=tiny_hf("qwen2"), config=cfg)
