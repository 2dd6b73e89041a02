"""A script's own ``loss.backward()`` then ``engine.step()`` (DeepSpeed >= 0.17 allows it; its
bf16_master_weight example does it): [Note: loss.backward()] in megatrain_ds/engine.py. With GA 1 in
bf16 or fp32 on one process it trains exactly as ``engine.backward(loss)`` does (losses, gradient
norms, masters: bit for bit), with the loss the model returns or one the script computes from the
logits, with an evaluation forward or a zero_grad() between the backward and the step, and in
bf16-master mode with bf16 moments (the example's config); a forward under the script's
torch.autocast is recomputed under it; a backward that raised part way is discarded. Elsewhere the
backward is refused with the reason (tests/engine/test_faults_engine.py)."""

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf, token_batches

STEPS = 5


def _config(**extra):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
        "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0, "speculative_step": False},
        **extra,
    }


def _train(config, own_backward: bool, logits_loss: bool = False, between: str | None = None):
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2, seed=7), config=config)
    losses, norms = [], []
    for ids in token_batches(STEPS):
        # the script's own loss from the logits (the bf16_master_weight example's way)
        if logits_loss:
            logits = engine(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
            )
        else:
            loss = engine(input_ids=ids, labels=ids).loss
        if own_backward:
            loss.backward()
        else:
            engine.backward(loss)
        if between == "eval":
            with torch.no_grad():
                engine(input_ids=ids)
        # before the step: the window's gradients are the engine's (DeepSpeed's too)
        elif between == "zero_grad":
            engine.zero_grad()
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    engine.synchronize()
    masters = {k: v.clone() for k, v in engine.master_state_dict().items()}
    steps = engine.global_steps
    engine.destroy()
    return losses, norms, masters, steps


@pytest.mark.parametrize(
    "case", ["model loss", "logits loss", "eval between", "zero_grad between", "fp32", "bf16 state"]
)
def test_loss_backward_trains_as_engine_backward(case):
    config = _config(bf16={"enabled": True})
    if case == "fp32":
        config = _config()
    elif case == "bf16 state":
        config = _config(
            bf16={
                "enabled": True,
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
            }
        )
    kw = {
        "logits_loss": case == "logits loss",
        "between": {"eval between": "eval", "zero_grad between": "zero_grad"}.get(case),
    }
    own, theirs = _train(config, True, **kw), _train(config, False, **kw)
    assert own[3] == theirs[3] == STEPS
    assert own[0] == theirs[0] and own[1] == theirs[1]
    assert all(torch.equal(own[2][k], theirs[2][k]) for k in theirs[2])
    assert own[0][-1] < own[0][0]


def test_fp16_needs_engine_scale():
    """fp16: a bare loss.backward() is refused (the loss scale is missing, as DeepSpeed refuses it);
    engine.scale(loss).backward() trains as engine.backward(loss) does, bit for bit, skipped
    overflow steps included."""
    config = _config(fp16={"enabled": True, "initial_scale_power": 30, "loss_scale_window": 4})
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=config)
    ids = token_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"fp16 loss scaling without engine\.scale\(loss\)"):
        engine(input_ids=ids, labels=ids).loss.backward()
    # scaled, but not the loss that is backwarded next
    engine.scale(engine(input_ids=ids, labels=ids).loss)
    with pytest.raises(RuntimeError, match=r"fp16 loss scaling without engine\.scale\(loss\)"):
        engine(input_ids=ids, labels=ids).loss.backward()
    engine.destroy()
    runs = []
    for own in (True, False):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2, seed=7), config=config
        )
        losses = []
        for ids in token_batches(STEPS):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.scale(loss).backward() if own else engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.synchronize()
        runs.append(
            (
                losses,
                engine.skipped_steps,
                {k: v.clone() for k, v in engine.master_state_dict().items()},
            )
        )
        engine.destroy()
    (l_own, skip_own, m_own), (l_eng, skip_eng, m_eng) = runs
    assert l_own == l_eng and skip_own == skip_eng > 0
    assert all(torch.equal(m_own[k], m_eng[k]) for k in m_eng)


class _PostNormBlock(torch.nn.Module):
    """DeepSpeedExamples' bf16_master_weight block, small: attention and MLP, each followed by a
    LayerNorm (which autocast runs in fp32: the next block's input is fp32 there, its weights
    bf16)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        x = self.norm1(x + self.attention(x, x, x)[0])
        return self.norm2(x + self.ff(x))


class _PostNormLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embedding = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(_PostNormBlock(width) for _ in range(depth))
        self.output_proj = torch.nn.Linear(width, vocab)

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.output_proj(x)


@pytest.mark.parametrize("own_backward", [True, False])
def test_forward_under_autocast_recomputes_under_it(own_backward):
    """The script wraps its forward and loss in torch.autocast (the bf16_master_weight example), the
    backward runs outside it: each layer's recompute runs under the forward's autocast
    (model/replay.py), so training with recompute equals training with every layer kept (the
    forward's own graph), bit for bit. fp32 weights here, so a recompute without autocast would
    compute its matmuls in fp32 where the forward used bf16 (on the GPU, where the bf16 weights meet
    the fp32 output of an autocast LayerNorm, it raised a dtype mismatch)."""

    def run(keep: int):
        config = _config()
        config["megatrain"]["keep_activations"] = keep
        engine, *_ = megatrain_ds.initialize(model=_PostNormLM(), config=config)
        losses = []
        for ids in token_batches(3, vocab=64):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
            loss.backward() if own_backward else engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.synchronize()
        masters = {k: v.clone() for k, v in engine.master_state_dict().items()}
        engine.destroy()
        return losses, masters

    (l_rec, m_rec), (l_kept, m_kept) = run(0), run(3)
    assert l_rec == l_kept
    assert all(torch.equal(m_rec[k], m_kept[k]) for k in m_kept)


def test_a_loss_backward_that_raised_part_way_is_discarded(monkeypatch):
    """loss.backward() raises in layer 0's backward (the last one it reaches) and the script catches
    it: at the engine's next call the partial gradients are discarded with a warning, and the next
    step trains as a clean engine's does."""
    from megatrain_ds.streaming.executor import StreamedLayers

    config = _config(bf16={"enabled": True})
    clean = megatrain_ds.initialize(model=tiny_hf("llama", layers=2, seed=7), config=config)[0]
    engine = megatrain_ds.initialize(model=tiny_hf("llama", layers=2, seed=7), config=config)[0]
    real = StreamedLayers.run_backward
    ids = token_batches(2)

    def boom(self, call, *args):
        if call.index == 0:
            raise RuntimeError("boom")
        return real(self, call, *args)

    monkeypatch.setattr(StreamedLayers, "run_backward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        engine(input_ids=ids[0], labels=ids[0]).loss.backward()
    monkeypatch.setattr(StreamedLayers, "run_backward", real)
    for e in (clean, engine):
        if e is engine:  # the engine's next call finds the backward incomplete
            with pytest.warns(UserWarning, match=r"stopped before layers \[0\].*discarded"):
                loss = e(input_ids=ids[1], labels=ids[1]).loss
        else:
            loss = e(input_ids=ids[1], labels=ids[1]).loss
        loss.backward()
        e.step()
    assert engine.get_global_grad_norm() == clean.get_global_grad_norm()
    a, b = engine.master_state_dict(), clean.master_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    for e in (clean, engine):
        e.destroy()
