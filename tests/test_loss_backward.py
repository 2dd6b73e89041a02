"""A script's own ``loss.backward()`` then ``engine.step()`` (DeepSpeed >= 0.17 allows it; its bf16_master_weight
example does it): [Note: loss.backward()] in megatrain_ds/engine.py. With GA 1 in bf16 or fp32 on one process it
trains exactly as ``engine.backward(loss)`` does (losses, gradient norms, masters: bit for bit), with the loss the
model returns or one the script computes from the logits, with an evaluation forward between the backward and the
step, and in bf16-master mode with bf16 moments (the example's config). Elsewhere the backward is refused with the
reason (tests/test_faults_engine.py)."""
import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf, token_batches

STEPS = 5


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
            "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0, "speculative_step": False}, **extra}


def _train(config, own_backward: bool, logits_loss: bool = False, eval_between: bool = False):
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2, seed=7), config=config)
    losses, norms = [], []
    for ids in token_batches(STEPS):
        if logits_loss:  # the script's own loss from the logits (the bf16_master_weight example's way)
            logits = engine(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        else:
            loss = engine(input_ids=ids, labels=ids).loss
        if own_backward:
            loss.backward()
        else:
            engine.backward(loss)
        if eval_between:
            with torch.no_grad():
                engine(input_ids=ids)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    engine.synchronize()
    masters = {k: v.clone() for k, v in engine.master_state_dict().items()}
    steps = engine.global_steps
    engine.destroy()
    return losses, norms, masters, steps


@pytest.mark.parametrize("case", ["model loss", "logits loss", "eval between", "fp32", "bf16 state"])
def test_loss_backward_trains_as_engine_backward(case):
    config = _config(bf16={"enabled": True})
    if case == "fp32":
        config = _config()
    elif case == "bf16 state":
        config = _config(bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                               "bf16_optimizer_states": True})
    kw = {"logits_loss": case == "logits loss", "eval_between": case == "eval between"}
    own, theirs = _train(config, True, **kw), _train(config, False, **kw)
    assert own[3] == theirs[3] == STEPS
    assert own[0] == theirs[0] and own[1] == theirs[1]
    assert all(torch.equal(own[2][k], theirs[2][k]) for k in theirs[2])
    assert own[0][-1] < own[0][0]


def test_fp16_loss_backward_is_refused():
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=_config(fp16={"enabled": True}))
    ids = token_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"fp16 loss scaling.*engine\.backward\(loss\)"):
        engine(input_ids=ids, labels=ids).loss.backward()
    engine.destroy()
