"""test_paths' paths rerun with a layer of the executor's own memory on: the last 2 layers kept
(``keep_activations``, executor.py's [Note: kept layers]; of 2-4 layers in its models) and 2
layers' weights held from forward to backward (``weight_cache_layers``, [Note: weight cache]; its
3-layer models cache layer 0). Each must give the same per-parameter gradients (1e-5 relative),
losses and weights as plain PyTorch."""

import pytest

from tests.engine import test_paths


@pytest.fixture(
    params=[{"keep_activations": 2}, {"weight_cache_layers": 2}], ids=["keep2", "weights2"]
)
def held(request, monkeypatch):
    test_paths.run_with(monkeypatch, request.param)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_from_logits(held, arch):
    test_paths.test_loss_from_logits(arch)


def test_attention_weights_and_hidden_states(held):
    test_paths.test_loss_from_attention_weights()
    test_paths.test_loss_from_hidden_states()


def test_dpo_two_forwards_into_one_loss(held):
    test_paths.test_dpo_policy_and_frozen_reference_in_one_process()


def test_peft_lora(held):
    test_paths.test_peft_lora_qkvo()


def test_moe_router_aux_loss(held):
    test_paths.test_moe_router_aux_loss("mixtral")


def test_moe_router_jitter_replayed(held):
    test_paths.test_moe_router_jitter_noise_replayed_in_recompute("mixtral")


def test_shared_parameter_and_batchnorm(held):
    test_paths.test_parameter_shared_across_layers_and_batchnorm_statistics()


def test_generate_then_train(held):
    test_paths.test_generate_before_training()
