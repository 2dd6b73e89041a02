"""megatrain.tiled_mlp (tiling.py): the tiled MLP / RMSNorm trains like the untiled model.

Tolerances (fp32, 3 steps of GA 2 with clipping firing every step): losses to 1e-6 relative
(measured: equal to the last bit on the development CPU; a GEMM over fewer rows may take another
kernel, so not asserted); grad norms to 1e-6 relative (measured <= 6e-8); final fp32 masters to 1e-6
relative over all parameters (measured <= 9e-8) and 5e-6 per parameter (measured <= 1.1e-6),
attention key biases 1e-4 (their true gradient is zero, softmax being shift-invariant: Adam
amplifies rounding noise, as in test_equivalence.py; measured 6.5e-6). The differences are the
weight gradients' sum over rows, taken chunk by chunk instead of in one matmul: the same fp32
additions in another order.
"""

import copy
import types

import pytest
import torch
from torch import nn
from torch.func import functional_call

import megatrain_ds
from megatrain_ds.model import tiling
from megatrain_ds.planning.config import ConfigError, parse_config
from tests.models import tiny_hf

GA, STEPS, SEQ, CHUNK = 2, 3, 13, 5  # 2 x 13 = 26 rows per micro-batch: chunks of 5, 5, 5, 5, 5, 1


def _config(tiled, clip: float = 0.5, **megatrain) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GA,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-6},
        },
        "gradient_clipping": clip,
        "megatrain": {"tiled_mlp": tiled, **megatrain},
    }


def _train(model, tiled, **megatrain):
    engine, *_ = megatrain_ds.initialize(
        model=model, model_parameters=model.parameters(), config=_config(tiled, **megatrain)
    )
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        for _ in range(GA):
            ids = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    state = {k: v.detach().clone() for k, v in engine.master_state_dict().items()}
    tiled_modules = list(engine.tiled_modules)
    engine.destroy()
    return losses, norms, state, tiled_modules


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _assert_same_training(ref, got):
    (ref_losses, ref_norms, ref_state, _), (losses, norms, state, _) = ref, got
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, ref_losses)), (
        losses,
        ref_losses,
    )
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    assert min(ref_norms) > 0.5, "clipping (at 0.5) must fire for the test to cover it"
    names = list(ref_state)
    assert (
        _rel(
            torch.cat([state[n].flatten() for n in names]),
            torch.cat([ref_state[n].flatten() for n in names]),
        )
        < 1e-6
    )
    for name in names:
        assert _rel(state[name], ref_state[name]) < (1e-4 if "k_proj.bias" in name else 5e-6), name
    init = tiny_hf("qwen2").state_dict()  # the run moved the weights (else equality proves nothing)
    assert any(_rel(ref_state[n], init[n]) > 1e-4 for n in names if n in init)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiled_training_equals_untiled(arch):
    model = tiny_hf(arch)
    ref = _train(copy.deepcopy(model), False)
    got = _train(model, CHUNK)
    assert ref[3] == []
    assert got[3] == ["0:mlp", "0:input_layernorm", "0:post_attention_layernorm"]
    _assert_same_training(ref, got)


def test_tiled_training_with_kept_layers_and_offloaded_activations():
    # a kept layer runs the tiled Function in its forward with grad on (its graph held to the
    # backward); the others recompute it from the saved input, which is in host memory here its
    # q_norm / k_norm ([batch, seq, heads, head_dim] rows) are tiled too
    model = tiny_hf("qwen3")
    ref = _train(copy.deepcopy(model), False, keep_activations=1, offload_activations=True)
    got = _train(model, CHUNK, keep_activations=1, offload_activations=True)
    assert {"0:self_attn.q_norm", "0:self_attn.k_norm", "0:mlp"} <= set(got[3])
    _assert_same_training(ref, got)


def test_auto_is_off_on_tiny_models(monkeypatch):
    calls = []
    apply = tiling._TiledRows.apply
    monkeypatch.setattr(tiling._TiledRows, "apply", lambda *a: calls.append(1) or apply(*a))
    model = tiny_hf("qwen2")
    ref = _train(copy.deepcopy(model), False)
    got = _train(model, "auto")
    assert calls == []  # installed, never tiled: 26 rows x 128 x 4 bytes is far below the threshold
    assert ref[0] == got[0] and all(torch.equal(ref[2][k], got[2][k]) for k in ref[2])
    assert tiling.chunk_rows("auto", 26, 128 * 4) is None
    # Qwen2.5-7B at 512K tokens: tiled, chunks of ~512 MiB of [rows, 18944] bf16
    rows = tiling.chunk_rows("auto", 524288, 18944 * 2)
    assert rows == 14080 and rows * 18944 * 2 <= tiling.TARGET_CHUNK_BYTES
    assert tiling.chunk_rows(True, 26, 128 * 4) == tiling.chunk_rows("auto", 1 << 30, 128 * 4)
    assert tiling.chunk_rows(7, 26, 1) == 7 and tiling.chunk_rows(False, 1 << 30, 1 << 20) is None


@pytest.mark.parametrize("bad", ["yes", 0, -4, 2.5, None, "512"])
def test_bad_setting_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"megatrain\.tiled_mlp"):
        parse_config(_config(bad))


def test_settings_accepted():
    for good in ("auto", True, False, 4096):
        assert parse_config(_config(good)).megatrain.tiled_mlp == good
    assert parse_config({"train_micro_batch_size_per_gpu": 1}).megatrain.tiled_mlp == "auto"


def test_moe_blocks_and_dropout_mlps_are_left_alone():
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
    )
    layers = tf.Qwen2MoeForCausalLM(cfg).model.layers
    tiled = tiling.apply_tiling([copy.deepcopy(layers[0]), copy.deepcopy(layers[1])], 4)
    # the sparse block is not tiled; the dense MLP layer is
    assert "0:mlp" not in tiled and "1:mlp" in tiled
    assert not any(t.startswith("0:mlp.") for t in tiled)  # nor anything inside the sparse block

    class DropMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(self.fc(x))

    block = nn.Module()
    block.mlp = DropMLP()
    assert tiling.apply_tiling([block], 2) == []


def _executor_style_grads(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """As executor.py takes a layer's gradients: parameters bound by functional_call to views of one
    flat leaf, torch.autograd.grad over [flat leaf, input] (nothing read from .grad)."""
    names = [n for n, _ in layer.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for _, p in layer.named_parameters()]).requires_grad_(
        True
    )
    views, offset = {}, 0
    for name, p in layer.named_parameters():
        views[name] = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    x = x.detach().requires_grad_(True)
    out = functional_call(layer, views, (x,))
    grads = torch.autograd.grad(out, [flat, x], g)
    assert all(layer.get_parameter(n).grad is None for n in names)
    return out.detach(), grads


def test_liger_style_bound_forward_is_wrapped_and_gets_weight_gradients_through_autograd_grad():
    # liger's instance patching binds its SwiGLU forward on the module (a custom autograd Function
    # inside); the tiled forward wraps whatever forward the module has. Weight gradients must come
    # back through autograd.grad over the flat leaf, as the executor takes them.
    class SiLUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return torch.nn.functional.silu(a) * b

        @staticmethod
        def backward(ctx, dc):
            a, b = ctx.saved_tensors
            s = torch.sigmoid(a)
            return dc * b * s * (1 + a * (1 - s)), dc * a * s

    calls = []

    def liger_like_forward(self, x):
        calls.append(x.shape[-2])
        return self.down_proj(SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))

    torch.manual_seed(0)
    layer = tiny_hf("qwen2", layers=1).model.layers[0]
    layer.mlp.__dict__["forward"] = types.MethodType(liger_like_forward, layer.mlp)
    x, g = torch.randn(2, 11, 64), torch.randn(2, 11, 64)
    kwargs_free = _WithRope(layer)
    ref_out, ref_grads = _executor_style_grads(kwargs_free, x, g)
    tiled = copy.deepcopy(kwargs_free)
    assert tiling.apply_tiling([tiled.layer], 4) == [
        "0:mlp",
        "0:input_layernorm",
        "0:post_attention_layernorm",
    ]
    calls.clear()
    out, grads = _executor_style_grads(tiled, x, g)
    # 22 rows: the forward's chunks, then the backward's recompute
    assert calls == [4, 4, 4, 4, 4, 2] * 2
    assert _rel(out, ref_out) < 1e-6
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 1e-6


class _WithRope(nn.Module):
    """A decoder layer called with its rotary embeddings, as the model calls it (single positional
    input)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        head_dim = 16
        pos = torch.arange(x.shape[1]).float()
        freqs = torch.outer(pos, 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        emb = torch.cat([freqs, freqs], dim=-1)[None].expand(x.shape[0], -1, -1)
        out = self.layer(x, position_embeddings=(emb.cos(), emb.sin()), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


def test_liger_rmsnorm_is_not_tiled():
    norm = tiny_hf("qwen2", layers=1).model.layers[0].input_layernorm

    def forward(self, x):
        return x

    # what liger's instance patching binds
    forward.__module__ = "liger_kernel.transformers.rms_norm"
    norm.__dict__["forward"] = types.MethodType(forward, norm)
    block = nn.Module()
    block.input_layernorm = norm
    assert tiling.apply_tiling([block], 4) == []
