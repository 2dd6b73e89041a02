"""The recompute checks itself ([Note: recompute check], megatrain_ds/model/recompute_check.py).

Each test makes the recompute differ from the forward the way an upstream release could (a KV cache
that reaches the layer under a name the engine does not know, RNG not replayed, a layer that keeps
state of its own) and asserts that the first step stops with ``RecomputeMismatch`` naming the layer,
the model class and the transformers version, and that nothing of that step was applied. The other
tests: the check is quiet on correct runs (every other test runs with it on for its first steps), is
on for exactly the steps the config says, compares the extra outputs (router logits) and works with
the layer inputs offloaded to host memory.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import megatrain_ds
from megatrain_ds.streaming import executor as executor_mod
from megatrain_ds.streaming import layer_call as layer_call_mod
from megatrain_ds.planning.config import ConfigError
from megatrain_ds.model.recompute_check import AUTO_STEPS, RecomputeMismatch
from tests.models import PlainLM, tiny_hf


def _config(**megatrain) -> dict:
    # on CUDA "auto" would keep layers (no recompute) after step 1
    megatrain.setdefault("keep_activations", 0)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "megatrain": megatrain,
    }


def _ids(seed: int = 0, vocab: int = 256):
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(seed))


def _logits_loss(engine, ids):
    logits = engine(input_ids=ids).logits
    targets = ids.to(logits.device)[:, 1:].reshape(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets)


def _plain_loss(engine, ids):
    logits = engine(ids)
    return F.cross_entropy(logits.reshape(-1, 64), ids.to(logits.device).reshape(-1))


def _masters(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


def _assert_untouched(engine, before: dict, steps: int = 0) -> None:
    after = engine.master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), (
        "a weight changed in the step that was refused"
    )
    assert engine.global_steps == steps
    assert not any(engine.executor.has_grad), "the refused window's gradients were kept"


def test_cache_forced_through_is_caught_at_the_first_step(monkeypatch):
    """transformers 5.24's regression, replayed: the layer's KV cache is not taken out of a
    grad-enabled call, so the forward appends this step's keys and the recompute appends them again.
    The recompute's output equals the forward's (causal attention over duplicated keys), its
    gradient does not: only the argument check sees it."""
    monkeypatch.setattr(
        layer_call_mod, "_without_cache", lambda i, args, kwargs, names: (args, kwargs)
    )
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=_config())
    before = _masters(engine)
    ids = _ids()
    loss = engine(input_ids=ids, use_cache=True).logits.float().pow(2).mean()
    with pytest.raises(RecomputeMismatch) as err, pytest.warns(UserWarning, match="discarded"):
        engine.backward(loss)
    message = str(err.value)
    assert "layer 2 of LlamaForCausalLM" in message  # the first layer the backward recomputes
    assert (
        "DynamicCache" in message
        and "changed between its forward and its backward recompute" in message
    )
    assert f"transformers {transformers.__version__}" in message and "check_recompute" in message
    _assert_untouched(engine, before)


class _NoReplay:
    """Stands in for executor.replay_rng: the recompute draws fresh random numbers (RNG replay
    drifted away)."""

    def __init__(self, state, device):
        pass

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _plain_dropout_lm():
    model = PlainLM()
    # a random draw in every training forward: the recompute must replay it
    for block in model.blocks:
        block.fc1 = nn.Sequential(block.fc1, nn.Dropout(0.2))
    return model


def test_rng_not_replayed_is_caught_at_the_step(monkeypatch):
    """Dropout whose RNG the recompute does not replay: the recomputed outputs differ from the
    forward's. The error is read at engine.step() (no sync per layer) and nothing of the step is
    applied."""
    monkeypatch.setattr(executor_mod, "replay_rng", _NoReplay)
    engine, *_ = megatrain_ds.initialize(model=_plain_dropout_lm(), config=_config())
    before = _masters(engine)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    loss = _plain_loss(engine, ids)
    engine.backward(loss)  # the errors are queued on the device, not read here
    with pytest.raises(
        RecomputeMismatch,
        match=r"layer \d of PlainLM .*output \(hidden states\) differs from the "
        r"forward's by [0-9.e-]+ \(relative, L2\), over the tolerance 0.0001",
    ):
        engine.step()
    _assert_untouched(engine, before)


class _CountingBlock(nn.Module):
    """A layer that keeps hidden state of its own: each call scales its output by how often it
    ran."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.calls = [0]  # a list: mutated in place, shared by the template the engine runs

    def forward(self, x):
        self.calls[0] += 1
        return x + self.fc2(torch.tanh(self.fc1(x))) * self.calls[0]


def test_layer_with_mutable_state_is_caught():
    model = PlainLM(depth=2)
    model.blocks = nn.ModuleList(_CountingBlock(32) for _ in range(2))
    engine, *_ = megatrain_ds.initialize(model=model, config=_config())
    before = _masters(engine)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    engine.backward(_plain_loss(engine, ids))
    with pytest.raises(RecomputeMismatch, match=r"layer [01] of PlainLM"):
        engine.step()
    _assert_untouched(engine, before)
    # the same model with the check off trains on (the user's explicit choice): the step is applied
    model = PlainLM(depth=2)
    model.blocks = nn.ModuleList(_CountingBlock(32) for _ in range(2))
    engine, *_ = megatrain_ds.initialize(model=model, config=_config(check_recompute=False))
    engine.backward(_plain_loss(engine, ids))
    engine.step()
    assert engine.global_steps == 1


def test_offloaded_inputs_are_the_reference(monkeypatch):
    """With the layer inputs in host memory the hidden-states reference is the next layer's input as
    it came back (no device alias kept): a mismatch is still seen, and a correct run compares every
    layer but the last's."""
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=3), config=_config(offload_activations=True)
    )
    ids = _ids()
    engine.backward(_logits_loss(engine, ids))
    check = engine.executor.check
    # 3 layers' hidden states (the last: its alias)
    assert len(check.pending) == 3 and check.unchecked == 0
    engine.step()
    assert check.compared == 3 and check.worst <= 1e-6

    monkeypatch.setattr(executor_mod, "replay_rng", _NoReplay)
    engine, *_ = megatrain_ds.initialize(
        model=_plain_dropout_lm(), config=_config(offload_activations=True)
    )
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    engine.backward(_plain_loss(engine, ids))
    with pytest.raises(RecomputeMismatch, match="hidden states"):
        engine.step()


def test_router_logits_are_compared_too():
    """MoE: the router logits the output-capturing hooks record are outputs of the layer; each is
    compared."""
    model = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
        )
    )
    engine, *_ = megatrain_ds.initialize(model=model, config=_config())
    ids = _ids()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    labels = [label for _, label, _, _ in engine.executor.check.pending]
    assert sum("router_logits" in label for label in labels) == 2, labels
    engine.step()
    assert engine.executor.check.worst <= 1e-6


@pytest.mark.parametrize("setting,checked", [("auto", AUTO_STEPS), (True, 5), (False, 0), (2, 2)])
def test_checked_steps_follow_the_config(setting, checked):
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2), config=_config(check_recompute=setting)
    )
    for step in range(5):
        ids = _ids(step)
        engine.backward(_logits_loss(engine, ids))
        engine.step()
    assert engine.executor.check.steps_checked == checked
    assert engine.executor.check.compared == 2 * checked


@pytest.mark.parametrize(
    "key,value",
    [
        ("check_recompute", "sometimes"),
        ("check_recompute", -1),
        ("check_recompute_tolerance", 0),
        ("check_recompute_tolerance", "loose"),
    ],
)
def test_bad_settings_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"megatrain.{key}"):
        megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=_config(**{key: value}))
