"""The fused LM head + cross-entropy only where it is exact ([Note: fused loss only where exact] in
megatrain_ds/training/engine_forward.py), and non-finite values reported as what they are ([Note:
non-finite values are not drift] in megatrain_ds/model/recompute_check.py). fp32, CPU, against plain
PyTorch.

A model whose forward computes another loss than transformers' causal-LM forward -- a forward
patched on the instance, a subclass's own forward, a keyword the fused loss does not handle --
trains exactly as the plain model (losses, every gradient, the weights after each step); each of
these took the fused path and trained on the wrong loss before. TRL's fused LM head
(``add_fused_lm_head``, called with ``fused_lm_head=True``) returns TRL's ``FusedCausalLMOutput``:
per-token log-probs equal to plain PyTorch's, and TRL's own numbers and gradients. A NaN in the
batch, or a learning rate that blows the weights up, skips the step with a report of where the
non-finite values are (it stopped the run with ``RecomputeMismatch`` blaming the installed
transformers).
"""

import math
import types

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from transformers.modeling_outputs import CausalLMOutputWithPast

import megatrain_ds
from tests.engine import test_paths
from tests.models import PlainLM, tiny_hf


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def _patch_aux_loss(model) -> None:
    """A script's patch on the instance: the model's own forward, plus 0.5 x z-loss of its
    logits."""

    def forward(self, *args, **kwargs):
        out = type(self).forward(self, *args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 0.5 * _z_loss(out.logits)
        return out

    model.forward = types.MethodType(forward, model)


class ZLossLlamaForCausalLM(tf.LlamaForCausalLM):
    """A subclass whose forward reads like transformers' own (decoder -> head -> loss_function) and
    returns the loss with a z-loss term added: its source looks plain to the head analysis
    (model_map.plain_lm_head)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(
            loss=None if loss is None else loss + 1e-2 * _z_loss(logits), logits=logits
        )


def _labels_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def test_forward_patched_on_the_instance_runs(capsys):
    model = tiny_hf("llama", layers=2)
    _patch_aux_loss(model)
    engine = test_paths._compare(model, _labels_loss, test_paths._batches())
    assert engine._fused is not None  # a plain head: only the patch keeps the fused loss off
    out = capsys.readouterr().out
    # once, not per call
    assert out.count("LlamaForCausalLM.forward is replaced on the instance (by ") == 1
    assert "test_forward_exact.forward)" in out


def test_subclass_forward_runs(capsys):
    torch.manual_seed(0)
    model = ZLossLlamaForCausalLM(tiny_hf("llama", layers=2).config)
    test_paths._compare(model, _labels_loss, test_paths._batches())
    out = capsys.readouterr().out
    assert (
        "ZLossLlamaForCausalLM.forward is " in out
        and "test_forward_exact.ZLossLlamaForCausalLM.forward" in out
    )
    assert "not transformers' own" in out


@pytest.mark.parametrize("keyword", ["shift_labels", "ignore_index"])
def test_keyword_the_fused_loss_does_not_handle_runs_the_model(keyword, capsys):
    """shift_labels (pre-shifted targets, as accelerate's context parallelism passes them) and
    ignore_index reach the model's loss_function: the fused loss would have dropped them."""

    def loss_fn(m, ids):
        if keyword == "shift_labels":  # two tokens ahead
            target = torch.cat([ids[:, 2:], torch.full_like(ids[:, :2], -100)], dim=1)
            return m(input_ids=ids, labels=ids, shift_labels=target.to(ids.device)).loss
        return m(input_ids=ids, labels=ids, ignore_index=int(ids[0, 4])).loss  # a token that occurs

    test_paths._compare(tiny_hf("llama", layers=2), loss_fn, test_paths._batches())
    assert f"keyword(s) {keyword}, which the fused loss does not handle" in capsys.readouterr().out


def test_positional_arguments_still_take_the_fused_loss(capsys):
    """engine(ids, mask, labels=...) binds the positional arguments to the forward's names: still
    the fused loss (and the same loss as the plain model)."""

    def loss_fn(m, ids):
        return m(ids, torch.ones_like(ids), labels=ids).loss

    engine = test_paths._compare(tiny_hf("llama", layers=2), loss_fn, test_paths._batches(n=1))
    ids = test_paths._batches(n=1)[0]
    assert engine._fused_loss_call((ids, torch.ones_like(ids)), {"labels": ids}) is not None
    assert "own forward" not in capsys.readouterr().out


def _trl_model(seed: int = 3):
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_hf("llama", layers=2, seed=seed)
    # as TRL's trainers do, before initialize
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def test_trl_fused_lm_head(capsys):
    """``model(..., labels=, fused_lm_head=True)`` returns TRL's FusedCausalLMOutput through the
    engine: log_probs equal to plain PyTorch's per-token log-probs of the labels; loss, log_probs,
    entropy and every gradient equal to TRL's own patched forward on a plain copy, over 2 steps of
    an SFT-style loss with an entropy term."""
    pytest.importorskip("trl")
    from trl.trainer.utils import FusedCausalLMOutput

    plain, ref = tiny_hf("llama", layers=2, seed=3), _trl_model()
    engine, *_ = megatrain_ds.initialize(model=_trl_model(), config=test_paths._config())
    ref_params = dict(ref.named_parameters())
    opt = torch.optim.AdamW(ref_params.values(), lr=test_paths.LR, weight_decay=0.01, eps=1e-6)
    for step, ids in enumerate(test_paths._batches(n=2)):
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt
        out = engine(input_ids=ids, labels=labels, fused_lm_head=True)
        want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
        assert isinstance(out, FusedCausalLMOutput) and out.log_probs.shape == (2, 9)
        if step == 0:  # plain PyTorch: log-softmax of the whole logits, the labels' entries
            logp = plain(input_ids=ids).logits.float().log_softmax(-1)[:, :-1]
            tokens = labels[:, 1:]
            expect = logp.gather(-1, tokens.clamp_min(0)[..., None])[..., 0] * (tokens != -100)
            torch.testing.assert_close(
                out.log_probs.detach(), expect.detach(), rtol=1e-5, atol=1e-6
            )
        for name in ("loss", "log_probs", "entropy", "label_mask"):
            torch.testing.assert_close(
                getattr(out, name).detach(), getattr(want, name).detach(), rtol=1e-5, atol=1e-6
            )
        mask = out.label_mask
        loss = out.loss - 1e-2 * (out.entropy * mask).sum() / mask.sum()
        (want.loss - 1e-2 * (want.entropy * mask).sum() / mask.sum()).backward()
        engine.backward(loss)
        for name, g in test_paths.engine_grads(engine).items():
            test_paths._close(g, ref_params[name].grad, f"grad of {name} at step {step}")
        torch.nn.utils.clip_grad_norm_(list(ref_params.values()), test_paths.CLIP)
        opt.step()
        opt.zero_grad()
        engine.step()
        masters = engine.master_state_dict()
        for name, p in ref_params.items():
            test_paths._close(masters[name], p.detach(), f"{name} after step {step}")
    with torch.no_grad():  # the reference-model path (no grad): TRL's head too
        assert engine(input_ids=ids, labels=labels, fused_lm_head=True).log_probs.shape == (2, 9)
    assert (
        capsys.readouterr().out.count("TRL's fused LM head (trl.trainer.utils._fused_forward)") == 1
    )
    engine.destroy()


# -------------------------------------------------------------------------------- non-finite values
def _nan_config(precision: str, lr: float = 1e-3) -> dict:
    cfg = {**test_paths._config(), "megatrain": {"keep_activations": 0, "check_recompute": "auto"}}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nan_in_the_batch_skips_the_step_and_says_where(precision, capsys):
    """A NaN in inputs_embeds at the second step (the recompute check is on): the step is skipped
    (the loss is NaN, the weights stay), a warning names the step and the first layer's input, and
    training goes on."""
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2), config=_nan_config(precision)
    )
    first, second, third = test_paths._batches()
    engine.backward(engine(input_ids=first, labels=first).loss)
    engine.step()
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    embeds = engine.module.get_input_embeddings()(second.to(engine.device)).detach().clone()
    embeds[1, 4] = float("nan")
    loss = engine(inputs_embeds=embeds, labels=second).loss
    engine.backward(loss)
    engine.step()  # raised RecomputeMismatch ("the installed transformers changed ...")
    assert math.isnan(loss.item()) and engine.skipped_steps == 1
    after = engine.master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    out = capsys.readouterr().out
    assert (
        "step 2: non-finite values (NaN/inf, " in out
        and "in the forward of LlamaForCausalLM: the first layer's input already holds them" in out
    )
    assert "not a recompute mismatch" in out and "transformers" not in out.lower().replace(
        "llamaforcausallm", ""
    )
    if precision != "fp16":  # fp16: the loss scaler's own line (DeepSpeed's)
        assert "step 2: non-finite gradients (NaN/inf) of streamed layer(s) 0, 1 (of 2)" in out
    engine.backward(engine(input_ids=third, labels=third).loss)
    engine.step()
    assert engine.skipped_steps == 1 and math.isfinite(engine.get_global_grad_norm())
    engine.destroy()


def test_huge_learning_rate_is_not_reported_as_drift(capsys):
    """lr 1e6: the weights blow up after the first step, and the activations' fp32 norms in the
    recompute check overflowed and read as a mismatch. They are reported as overflowing values now,
    and training goes on as DeepSpeed would (a step with non-finite gradients is skipped)."""
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2), config=_nan_config("fp32", lr=1e6)
    )
    for ids in test_paths._batches():
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()  # raised RecomputeMismatch at the second step
    assert engine.global_steps == 3
    out = capsys.readouterr().out
    assert (
        "step 2: non-finite values (NaN/inf, or magnitudes past ~1e19" in out and "mismatch" in out
    )
    engine.destroy()


def test_overflow_inside_a_layer_names_the_layer(capsys):
    """Finite inputs, a layer whose output overflows to inf: the report names that layer (1), not
    its input."""
    model = PlainLM(vocab=64, width=32, depth=3)
    with torch.no_grad():
        model.blocks[1].fc2.weight.fill_(3e38)  # finite weights; the sum of 64 such products is not

    def loss_fn(m, ids):
        logits = m(ids)
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, 64), ids.to(logits.device)[:, 1:].reshape(-1)
        )

    engine, *_ = megatrain_ds.initialize(model=model, config=_nan_config("fp32"))
    ids = test_paths._batches(vocab=64, n=1)[0]
    engine.backward(loss_fn(engine, ids))
    engine.step()
    assert engine.skipped_steps == 1
    out = capsys.readouterr().out
    assert (
        "step 1: non-finite values (NaN/inf, " in out
        and "in the forward of PlainLM: layer 1's output (hidden "
        "states) is the first layer output that holds them"
        in out
    )
    engine.destroy()
