"""megatrain_ds vs plain PyTorch, fp32 on CPU: 20 optimizer steps, same init, same data.

Reference: the unmodified model, ``torch.optim.AdamW``, ``clip_grad_norm_`` over all parameters,
loss / GA per micro-batch. Losses, grad norms and final parameters must agree to 1e-5 relative.
"""

import copy
import sys

import pytest
import torch

import megatrain_ds
from tests.models import PlainLM, tiny_hf

STEPS = 20
# The engine picks CUDA when present; the reference runs on the same device, so on the GPU box this
# suite checks the real three-stream path and on CPU the stand-in path, against the same numbers.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LR, WD, CLIP, EPS = 1e-3, 0.01, 1.0, 1e-6
# EPS: with Adam's default 1e-8, parameters whose true gradient is ~0 (e.g. attention key biases:
# softmax is shift-invariant) get lr-sized updates of random sign from rounding noise, in any two
# implementations. 1e-6 damps that noise in both runs alike; a wrong gradient still moves every loss
# and weight.


def _plain_ds_config(ga: int, clip: float = CLIP) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.95], "eps": EPS},
        },
        "gradient_clipping": clip,
    }


def _ds_config(ga: int, clip: float = CLIP) -> dict:
    return _plain_ds_config(ga, clip)


def _batches(vocab: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 12), generator=g) for _ in range(n)]


def _loss(model, ids, hf: bool):
    if hf:
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids)
    ids = ids.to(logits.device)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def _reference(model, batches, ga: int, hf: bool, clip: float = CLIP):
    model.to(DEVICE)
    batches = [b.to(DEVICE) for b in batches]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=EPS)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ga):
            loss = _loss(model, batches[step * ga + micro], hf)
            (loss / ga).backward()
            losses.append(loss.item())
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
        )
        opt.step()
        opt.zero_grad()
    return losses, norms


def _megatrain(model, batches, ga: int, hf: bool, clip: float = CLIP):
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = megatrain_ds.initialize(
        model=model, model_parameters=params, config=_ds_config(ga, clip)
    )
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ga):
            ids = batches[step * ga + micro]
            loss = engine(input_ids=ids, labels=ids).loss if hf else _loss(engine, ids, hf)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    state = engine.master_state_dict()
    return losses, norms, state, engine


def _assert_close(name, got, want, rtol=1e-5):
    got, want = (
        torch.as_tensor(got, dtype=torch.float64),
        torch.as_tensor(want, dtype=torch.float64),
    )
    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    assert err < rtol, f"{name}: relative error {err:.3g} >= {rtol}"


def _compare(make, ga: int, hf: bool = True, freeze=None, clip: float = CLIP):
    ref_model = make()
    if freeze:
        freeze(ref_model)
    our_model = copy.deepcopy(ref_model)
    names = [n for n, _ in ref_model.named_parameters()]
    batches = _batches(ref_model.config.vocab_size if hf else 64, STEPS * ga)
    ref_losses, ref_norms = _reference(ref_model, batches, ga, hf, clip)
    losses, norms, state, engine = _megatrain(our_model, batches, ga, hf, clip)
    _assert_close("losses", losses, ref_losses)
    _assert_close("grad norms", norms, ref_norms)
    trainable = {n for n, p in ref_model.named_parameters() if p.requires_grad}
    ref_params = {n: p.detach().cpu() for n, p in ref_model.named_parameters()}
    _assert_close(
        "all params",
        torch.cat([state[n].flatten() for n in names]),
        torch.cat([ref_params[n].flatten() for n in names]),
    )
    for name in names:
        # Attention key biases have a mathematically zero gradient (softmax is shift-invariant), so
        # their updates are rounding noise amplified by Adam in both runs: checked 10x looser.
        rtol = 1e-4 if "k_proj.bias" in name else 1e-5
        _assert_close(f"param {name}", state[name], ref_params[name], rtol)
    # the run must have moved the weights, or equality would prove nothing
    init = dict(make().named_parameters())
    moved = sum(float((state[n] - init[n].detach()).norm()) for n in trainable)
    assert moved > 1e-2
    engine.destroy()
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("ga", [1, 4])
def test_matches_pytorch(arch, tied, ga):
    _compare(lambda: tiny_hf(arch, tied=tied), ga)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_more_hf_architectures(arch):
    _compare(lambda: tiny_hf(arch, tied=False), ga=2)


def test_frozen_parameters_are_not_updated_and_get_no_state():
    def freeze(model):
        for name, p in model.named_parameters():
            if "mlp" in name or "embed" in name:
                p.requires_grad_(False)

    engine = _compare(lambda: tiny_hf("llama", tied=False), ga=2, freeze=freeze)
    trainable = (
        sum(p.numel() for p in engine.module.parameters() if p.requires_grad and p.numel() > 0)
        + engine.store.n_train
    )
    assert engine.store.exp_avg.numel() == engine.store.n_train
    assert engine.store.n_train < engine.store.n_full  # mlp weights have no optimizer state
    assert trainable > 0
    embed = engine.module.get_input_embeddings().weight
    k = next(k for k, p in enumerate(engine.resident.params) if p is embed)
    assert engine.resident.exp_avg[k] is None


@pytest.mark.parametrize("ga", [1, 3])
def test_optimizer_state_on_device_matches_pytorch(ga, monkeypatch):
    """offload_optimizer.ratio < 1: the first layers' optimizer state lives on the device (the GPU
    on the GPU box; the same code runs on CPU), and the result is still plain PyTorch's."""
    monkeypatch.setattr(sys.modules[__name__], "_ds_config", _with_ratio)
    engine = _compare(lambda: tiny_hf("qwen2", tied=False, layers=4), ga=ga)
    assert engine.layer_states.device_state is not None and (
        engine.layer_states.device_state.lo,
        engine.layer_states.device_state.hi,
    ) == (0, 2)


@pytest.mark.parametrize("ga", [1, 2])
def test_auto_optimizer_state_placement_after_the_first_step_matches_pytorch(ga, monkeypatch):
    """gpu_optimizer_layers "auto": after the second step the resident parameters' state, then the
    leading layers whose state fits the memory the step left free move to the device, moments and
    all (here the free memory is set to what the resident state and 2 of 4 layers take; the same
    code runs on CPU); the run stays plain PyTorch's."""
    from megatrain_ds.host.device_state import DeviceOptimizerState
    from megatrain_ds.training.engine_auto import AutoPlacer

    placed = []

    steps = []  # the engine calls after_step after each of its first steps
    after_step = AutoPlacer.after_step
    monkeypatch.setattr(
        AutoPlacer, "after_step", lambda self, parts: (steps.append(1), after_step(self, parts))
    )

    def budget(parts):
        placed.append(len(steps))  # asked once, after the second step
        return parts.resident.device_bytes() + DeviceOptimizerState.nbytes(parts.store, 2) + 1

    monkeypatch.setattr(AutoPlacer, "budget_bytes", lambda self, parts: budget(parts))
    monkeypatch.setattr(sys.modules[__name__], "_ds_config", _with_auto)
    engine = _compare(lambda: tiny_hf("qwen2", tied=False, layers=4), ga=ga)
    assert placed == [2]
    assert (engine.layer_states.device_state.lo, engine.layer_states.device_state.hi) == (0, 2)
    assert engine.resident.on_device  # the embedding's state went first
    assert engine.executor.keep == frozenset()  # nothing measured on CPU: no layer kept


def _with_auto(ga, clip=CLIP):
    cfg = _plain_ds_config(ga, clip)
    # the budget is for state only
    cfg["megatrain"] = {"gpu_optimizer_layers": "auto", "keep_activations": 0}
    return cfg


def _with_ratio(ga, clip=CLIP):
    cfg = _plain_ds_config(ga, clip)
    cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    return cfg


def test_layers_with_different_attention_windows():
    """Alternating sliding-window / full-attention layers share one template; each layer gets its
    own mask (transformers passes it per layer call) and its own scalar attributes (checked in
    test_executor)."""
    import transformers as tf

    def make():
        torch.manual_seed(0)
        cfg = tf.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
        return tf.Qwen2ForCausalLM(cfg)

    engine = _compare(make, ga=1)
    assert len(engine.executor.templates) == 1  # same structure: one template, per-layer attributes


def test_activations_in_host_memory(monkeypatch):
    """megatrain.offload_activations: the layer inputs round-trip through host memory, same
    numbers."""

    def with_offload(ga, clip=CLIP):
        cfg = _plain_ds_config(ga, clip)
        cfg["megatrain"] = {"offload_activations": True}
        return cfg

    monkeypatch.setattr(sys.modules[__name__], "_ds_config", with_offload)
    engine = _compare(lambda: tiny_hf("llama", tied=True), ga=2)
    acts = engine.executor.activations
    assert acts is not None
    assert not acts.on_host and not acts.on_device
    # one host buffer of exactly one input's size per layer, made in the first forward and reused by
    # every later micro-batch (no power-of-two rounding, no new buffer per step)
    sizes = {buf.numel() for (buf, _), _ in acts.pool}
    assert len(acts.pool) == len(engine.executor.layouts) and len(sizes) == 1
    assert acts.nbytes == len(engine.executor.layouts) * sizes.pop()


def test_host_activation_buffers_follow_varying_lengths():
    """Batches of varying length reuse the host buffers that fit (the smallest); a longer one than
    any before releases the free buffers it outgrew instead of piling up one set per length;
    contents round-trip."""
    from megatrain_ds.streaming.activations import HostActivations
    from megatrain_ds.streaming.streams import make_streams

    acts = HostActivations(make_streams(torch.device("cpu")), torch.device("cpu"))

    def step(tokens, layers=3):
        xs = [torch.randn(2, tokens, 8, dtype=torch.bfloat16) for _ in range(layers)]
        for k, x in enumerate(xs):
            acts.save(k, x)
        for k in reversed(range(layers)):
            acts.prefetch(k)
            assert torch.equal(acts.load(k), xs[k])
        return 2 * 8 * 2  # bytes per token

    per = step(16)
    assert acts.nbytes == 3 * 16 * per and len(acts.pool) == 3
    step(10)  # shorter: the same buffers, nothing new
    assert acts.nbytes == 3 * 16 * per
    step(24)  # longer than every free buffer: those are released, three of the new size made
    assert acts.nbytes == 3 * 24 * per and {b.numel() for (b, _), _ in acts.pool} == {24 * per}
    for tokens in (5, 24, 12, 20):
        step(tokens)
    assert acts.nbytes == 3 * 24 * per and len(acts.pool) == 3


def test_no_clipping():
    _compare(lambda: tiny_hf("qwen2", tied=True), ga=1, clip=0.0)


def test_plain_module_with_block_list():
    _compare(lambda: PlainLM(), ga=2, hf=False)


def test_model_without_block_list_is_rejected_with_reason():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(megatrain_ds.UnsupportedModelError, match="no nn.ModuleList"):
        megatrain_ds.initialize(model=model, config=_ds_config(1))


def test_the_comparison_catches_a_wrong_layer_gradient(monkeypatch):
    """A 10% error in one layer's gradient must fail the comparison above."""
    from megatrain_ds.streaming.executor import StreamedLayers

    fold = StreamedLayers._fold

    def wrong_fold(self, i, dest, first, final):  # noqa: ANN001 - same signature as _fold
        if i == 1:
            self.store.grad_of(i).mul_(1.1) if self.store.grad_direct else dest.mul_(1.1)
        return fold(self, i, dest, first, final)

    monkeypatch.setattr(StreamedLayers, "_fold", wrong_fold)
    with pytest.raises(AssertionError, match="relative error"):
        _compare(lambda: tiny_hf("llama", tied=True), ga=1)
