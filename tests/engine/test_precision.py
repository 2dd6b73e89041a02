"""bf16 compute with fp32 master weights; host bytes per parameter; dropout replay in recompute."""

import copy

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf
from tests.engine.test_equivalence import DEVICE, _assert_close


def _cfg(ga=1, bf16=False, clip=1.0, megatrain=None):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "bf16": {"enabled": bf16},
        "megatrain": megatrain or {},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
        "gradient_clipping": clip,
    }


def _run_ref(model, batches, steps):
    model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    losses = []
    for ids in batches[:steps]:
        ids = ids.to(DEVICE)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run_engine(model, batches, steps, **cfg):
    engine, *_ = megatrain_ds.initialize(model=model, config=_cfg(**cfg))
    losses = []
    for ids in batches[:steps]:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


def _batches(n=10):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (2, 16), generator=g) for _ in range(n)]


BF16_WIRE = {"stream_fp32_master": False}


@pytest.mark.parametrize("options", [{}, BF16_WIRE, {**BF16_WIRE, "fp32_grad_landing": True}])
def test_bf16_tracks_fp32_reference(options):
    ref = tiny_hf("qwen2")
    ours = copy.deepcopy(ref)
    batches = _batches()
    want = _run_ref(ref, batches, 10)
    got, engine = _run_engine(ours, batches, 10, bf16=True, megatrain=options)
    assert engine.store.master.dtype == torch.float32
    assert engine.executor.slots[0].buf.dtype == torch.bfloat16  # compute in bf16 in every mode
    expected_wire = torch.bfloat16 if options.get("stream_fp32_master") is False else torch.float32
    assert engine.store.wire.dtype == expected_wire
    _assert_close("bf16 losses", got, want, rtol=2e-2)
    assert got[-1] < got[0]
    engine.destroy()


@pytest.mark.parametrize(
    "ga,bf16,options,expected",
    [
        (1, True, {}, 14),
        (4, True, {}, 16),
        (1, False, {}, 16),
        (4, False, {}, 16),
        (1, True, {"host_kernel": "torch"}, 16),
        (1, True, BF16_WIRE, 16),
        (4, True, BF16_WIRE, 18),
        (1, True, {**BF16_WIRE, "fp32_grad_landing": True}, 18),
    ],
)
def test_host_bytes_per_parameter(ga, bf16, options, expected):
    engine = _run_engine(tiny_hf("llama"), _batches(), 0, ga=ga, bf16=bf16, megatrain=options)[1]
    n = engine.store.n_train
    assert (engine.store.nbytes() - engine.store.fixed_nbytes()) / n == expected
    engine.destroy()


def test_dropout_is_replayed_in_recompute():
    """GPT-2 with dropout: recompute must see the same masks as forward, so grads match PyTorch."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=64,
        vocab_size=256,
        resid_pdrop=0.2,
        embd_pdrop=0.0,
        attn_pdrop=0.2,
    )
    ref = tf.GPT2LMHeadModel(cfg)
    ours = copy.deepcopy(ref)
    batches = _batches(5)
    torch.manual_seed(123)
    if DEVICE == "cuda":
        torch.cuda.manual_seed(123)
    want = _run_ref(ref, batches, 5)
    torch.manual_seed(123)
    if DEVICE == "cuda":
        torch.cuda.manual_seed(123)
    got, engine = _run_engine(ours, batches, 5)
    _assert_close("losses with dropout", got, want, rtol=1e-5)
    ref_params = torch.cat([p.detach().cpu().flatten() for p in ref.parameters()])
    state = engine.master_state_dict()
    ours_params = torch.cat([state[n].flatten() for n, _ in ref.named_parameters()])
    _assert_close("params with dropout", ours_params, ref_params, rtol=1e-5)
    engine.destroy()


def test_eval_mode_reaches_the_streamed_layers():
    """engine.eval() must switch dropout off inside the (stateless) layer templates: eval logits are
    then deterministic and equal PyTorch's eval logits."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        vocab_size=256,
        resid_pdrop=0.5,
        embd_pdrop=0.0,
        attn_pdrop=0.5,
    )
    ref = tf.GPT2LMHeadModel(cfg).eval()
    engine, *_ = megatrain_ds.initialize(model=copy.deepcopy(ref), config=_cfg())
    ids = _batches(1)[0]
    engine.eval()
    with torch.no_grad():
        got = engine(input_ids=ids).logits.cpu()
        want = ref.to(DEVICE)(input_ids=ids.to(DEVICE)).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    engine.train()
    with torch.no_grad():
        noisy = engine(input_ids=ids).logits.cpu()
    assert not torch.allclose(noisy, want, atol=1e-3)  # dropout is back on in train mode
    engine.destroy()
