"""The recompute skips the MLP's output projection (megatrain_ds/model/recompute_skip.py): where it
is installed, that it trains bit-identical to the full recompute, and where it stays off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megatrain_ds
from megatrain_ds.model import recompute_skip as rs
from tests.engine import test_paths
from tests.models import tiny_hf, token_batches, train_lm

STEPS = 5  # the recompute check compares the first 3 ("auto"): the skip runs from the 4th


def _train(model, skip, dtype: str = "fp32", hook=None, **megatrain):
    cfg = {
        **test_paths._config(),
        "megatrain": {"skip_recompute_down_proj": skip, "keep_activations": 0, **megatrain},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
    if hook is not None:
        hook(model)
    before = rs.skipped_calls[0]
    losses = train_lm(engine, token_batches(STEPS, shape=(2, 16)))
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    installed = list(engine.executor.recompute_skips)
    engine.destroy()
    return losses, params, rs.skipped_calls[0] - before, installed


@pytest.mark.parametrize(
    "arch,dtype", [("qwen2", "fp32"), ("llama", "fp32"), ("qwen3", "fp32"), ("qwen2", "bf16")]
)
def test_the_skip_trains_bit_identical_to_the_full_recompute(arch, dtype):
    """Every recomputed layer of the steps after the check skips its down_proj matmul, and the
    losses and the final parameters equal the full recompute's bit for bit."""
    on = _train(tiny_hf(arch), "auto", dtype)
    off = _train(tiny_hf(arch), False, dtype)
    assert on[3] == ["0:mlp.down_proj"] and off[3] == []
    assert on[2] == 3 * (STEPS - 3) and off[2] == 0  # 3 layers, each step after the checked ones
    assert on[0] == off[0]
    for name, value in on[1].items():
        assert torch.equal(value, off[1][name]), name


def test_with_the_mlp_tiled_the_skip_trains_as_the_full_recompute():
    """tiled_mlp wraps the MLP's forward after the skip is installed: a tiled call runs its chunks
    inside its own Function (no grad there: no skip), and the training equals the full recompute's
    bit for bit."""
    on = _train(tiny_hf("qwen2"), "auto", tiled_mlp=8)  # 32 rows a call: 4 chunks
    off = _train(tiny_hf("qwen2"), False, tiled_mlp=8)
    assert on[3] == ["0:mlp.down_proj"] and on[0] == off[0]
    assert all(torch.equal(v, off[1][k]) for k, v in on[1].items())


def test_the_skip_is_installed_only_where_the_layer_source_allows_it():
    """Llama, Qwen2/3, Mistral end their layer in ``residual + self.mlp(...)`` with an MLP that
    returns ``self.down_proj(...)``; Gemma 2 and OLMo 2 normalize the MLP's output first, GPT-2 has
    no down_proj, a LoRA down_proj is not a plain nn.Linear: no skip there."""
    import transformers as tf

    for arch in ("llama", "qwen2", "qwen3", "mistral"):
        layer = tiny_hf(arch).model.layers[0]
        assert rs.install([layer], "auto") == ["0:mlp.down_proj"], arch
        assert rs.install([layer], "auto") == []  # installed once
    # a norm on the MLP's output before the residual add
    for model_cls, config_cls, extra in (
        (tf.Gemma2ForCausalLM, tf.Gemma2Config, {"head_dim": 16}),
        (tf.Olmo2ForCausalLM, tf.Olmo2Config, {"pad_token_id": 0, "bos_token_id": 1}),
    ):
        config = config_cls(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            **extra,
        )
        if extra.get("bos_token_id") is not None:
            config.eos_token_id = 1
        assert rs.install([model_cls(config).model.layers[0]], "auto") == [], model_cls.__name__
    assert rs.install([tiny_hf("gpt2").transformer.h[0]], "auto") == []
    assert rs.install([tiny_hf("llama").model.layers[0]], False) == []
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_hf("llama"), LoraConfig(r=2, target_modules=["down_proj"]))
    assert rs.install([lora.base_model.model.model.layers[0]], "auto") == []


def test_a_hook_on_the_mlp_keeps_that_layers_recompute_whole():
    """A forward hook on one layer's down_proj (a user's, or an output capture) sees real outputs:
    that layer's recompute runs the matmul, the others still skip, and training is unchanged."""
    seen = []

    def hook(model):
        down = model.model.layers[1].mlp.down_proj
        down.register_forward_hook(lambda m, i, o: seen.append(float(o.detach().abs().sum())))

    on = _train(tiny_hf("qwen2"), "auto", hook=hook)
    assert on[2] == 2 * (STEPS - 3)  # layers 0 and 2
    assert seen and min(seen) > 0  # every call the hook saw had the real output
    off = _train(tiny_hf("qwen2"), False)
    assert on[0] == off[0]


def test_a_global_hook_or_a_torch_without_its_registry_keeps_the_recompute_whole(monkeypatch):
    """A hook on every module (``register_module_forward_hook``) sees real outputs too; a torch
    whose global hook registries are gone (private names) cannot say, so nothing is skipped."""
    from torch.nn.modules import module as torch_module

    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(1) if isinstance(m, nn.Linear) else None
    )
    try:
        hooked = _train(tiny_hf("qwen2"), "auto")
    finally:
        handle.remove()
    assert hooked[2] == 0 and seen
    # a torch that renamed them (deleting torch's own would break every module call)
    assert all(hasattr(torch_module, name) for name in rs.GLOBAL_HOOK_REGISTRIES)
    monkeypatch.setattr(rs, "GLOBAL_HOOK_REGISTRIES", ("_global_forward_hooks_renamed",))
    assert _train(tiny_hf("qwen2"), "auto")[2] == 0
    monkeypatch.undo()
    assert _train(tiny_hf("qwen2"), "auto")[2] == 3 * (STEPS - 3)  # the skip itself still works


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_grad_only_linear_backward_is_linears_own(dtype, bias):
    """_GradOnlyLinear's gradients equal F.linear's bit for bit (3-D input, with and without a
    bias) and its value is a zero placeholder of the output's shape."""
    _grad_only_against_linear(torch.device("cpu"), dtype, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_the_grad_only_linear_backward_is_linears_own(dtype):
    _grad_only_against_linear(torch.device("cuda"), dtype, False)


def _grad_only_against_linear(device, dtype, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 96, generator=g).to(device, dtype)
    lin = nn.Linear(96, 48, bias=bias).to(device, dtype)
    grad = torch.randn(2, 24, 48, generator=g).to(device, dtype)
    ref = [t.detach().clone().requires_grad_() for t in (x, lin.weight)]
    refs = ref + ([lin.bias.detach().clone().requires_grad_()] if bias else [])
    F.linear(*refs).backward(grad)
    got = [t.detach().clone().requires_grad_() for t in refs]
    out = rs._GradOnlyLinear.apply(got[0], got[1], got[2] if bias else None)
    assert out.shape == (2, 24, 48) and not out.any()
    out.backward(grad)
    for r, o in zip(refs, got):
        assert torch.equal(r.grad, o.grad)


@pytest.mark.parametrize("bad", [True, "on", 1])
def test_skip_recompute_down_proj_rejects_bad_values(bad):
    with pytest.raises(megatrain_ds.ConfigError, match="megatrain.skip_recompute_down_proj"):
        megatrain_ds.initialize(
            model=tiny_hf("llama"),
            config={**test_paths._config(), "megatrain": {"skip_recompute_down_proj": bad}},
        )


def test_under_autocast_the_skip_casts_as_linear_does():
    """Under torch.autocast the skipped linear takes F.linear's casts (outside the Function, so
    autograd takes them back): fp32 input and weight, bf16 compute, the same gradients."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(32, 16, bias=False)
    x = torch.randn(2, 8, 32, generator=g)
    grad = torch.randn(2, 8, 16, generator=g).bfloat16()
    runs = []
    for skip in (False, True):
        xi = x.clone().requires_grad_()
        lin.weight.grad = None
        fwd = rs.SkipInRecompute(nn.Module(), lin, lin.forward)
        with torch.autocast("cpu", dtype=torch.bfloat16), rs.recomputing(skip):
            out = fwd(xi)
        assert out.dtype == torch.bfloat16 and bool(out.any()) is not skip
        out.backward(grad)
        runs.append((xi.grad, lin.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
