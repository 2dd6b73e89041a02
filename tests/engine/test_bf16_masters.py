"""Opt-in bf16-master mode (DeepSpeed's ``bf16.bf16_master_weights_and_grads``): the streamed
layers' master weights are the bf16 wire copy (12 host bytes per trained parameter with GA 1, not
16); fp32 masters stay the default. The mode is named at initialize and in the progress line, and it
costs what it says: an update below bf16's resolution rounds away, where fp32 masters keep it.
"""

import pytest
import torch

import megatrain_ds
from megatrain_ds.planning.config import ConfigError
from tests.models import tiny_hf, token_batches, train_lm


def _config(bf16_masters=True, lr=3e-3, **mt):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 1,
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": bf16_masters},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0, **mt},
    }


def _layer_masters(engine):
    return {k: v.clone() for k, v in engine.master_state_dict().items() if ".layers." in k}


def test_bf16_masters_bytes_step_line_and_learning(capsys):
    model = tiny_hf("llama", layers=2)
    engine, *_ = megatrain_ds.initialize(model=model, config=_config())
    store = engine.store
    assert store.master.dtype == torch.bfloat16 and store.master is store.wire  # one 2-byte copy
    # 2 (master = wire) + 4 + 4 (fp32 moments) + 2 (bf16 gradient, GA 1) bytes per streamed
    # parameter
    assert store.nbytes() == 12 * store.n_train
    before = _layer_masters(engine)
    losses = train_lm(engine, token_batches(8))
    out = capsys.readouterr().out
    assert "bf16 master weights (bf16.bf16_master_weights_and_grads)" in out
    assert "step=1, skipped=0" in out and "bf16 masters" in out.split("step=1,")[1].splitlines()[0]
    assert losses[-1] < losses[0]
    after = _layer_masters(engine)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for v in after.values():  # every master value is a bf16 number
        assert torch.equal(v, v.bfloat16().float())
    engine.destroy()


def test_fp32_masters_stay_default_and_named(capsys):
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=2), config=_config(bf16_masters=False)
    )
    assert engine.store.master_dtype == torch.float32
    train_lm(engine, token_batches(1))
    assert "fp32 masters" in capsys.readouterr().out
    engine.destroy()


def test_updates_below_bf16_resolution_round_away():
    """With a tiny learning rate (1e-7) the updates are below half a bf16 ulp for all but the
    weights nearest zero: bf16 masters barely move, fp32 masters all do (the documented price of the
    mode)."""
    moved = {}
    for bf16_masters in (True, False):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config=_config(bf16_masters, lr=1e-7)
        )
        before = _layer_masters(engine)
        train_lm(engine, token_batches(3))
        after = _layer_masters(engine)
        moved[bf16_masters] = sum(int((before[k] != after[k]).sum()) for k in before)
        engine.destroy()
    assert moved[True] * 100 < moved[False]


def test_bf16_masters_checkpoint_resume_exact(tmp_path):
    full_engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=_config())
    full = train_lm(full_engine, token_batches(4))
    final = _layer_masters(full_engine)
    full_engine.destroy()
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=_config())
    train_lm(engine, token_batches(2))
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.destroy()
    # bf16 runs name it bf16_..., as DeepSpeed does (its bf16 engine reads no other name)
    optim = torch.load(
        tmp_path / "t" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False
    )
    groups = optim["optimizer_state_dict"]["fp32_flat_groups"]
    assert all(g.dtype == torch.float32 for g in groups)  # as DeepSpeed writes them
    resumed, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=_config())
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert train_lm(resumed, token_batches(4)[2:]) == full[2:]
    got = _layer_masters(resumed)
    for k in final:
        assert torch.equal(got[k], final[k]), k
    resumed.destroy()


def test_bf16_masters_conflicts_are_config_errors():
    with pytest.raises(ConfigError, match="bf16_master_weights_and_grads.*stream_fp32_master"):
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config=_config(stream_fp32_master=True)
        )
    with pytest.raises(ConfigError, match="gpu_optimizer_layers"):
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=2), config=_config(gpu_optimizer_layers=1)
        )


def test_bf16_masters_with_lora_keep_the_base_and_train_the_adapters():
    """A peft LoRA model in bf16-master mode: the base stays bit-identical (frozen, in the bf16 wire
    copy, no moments), the adapters learn, and the host keeps 2 bytes per frozen and 12 per trained
    streamed parameter."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_hf("llama", layers=2),
        peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"]
        ),
    )
    # LoRA B starts at zero: give every adapter a gradient at once
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    engine, *_ = megatrain_ds.initialize(model=model, config=_config())
    store = engine.store
    # master = wire (2) + moments (8) + grad (2)
    assert store.nbytes() == 2 * store.n_full + 10 * store.n_train
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    train_lm(engine, token_batches(4))
    after = engine.master_state_dict()
    lora = [k for k in before if "lora_" in k]
    assert lora and any(not torch.equal(before[k], after[k]) for k in lora)
    for k in before:
        if "lora_" not in k and ".layers." in k:
            assert torch.equal(before[k], after[k]), k
    engine.destroy()
