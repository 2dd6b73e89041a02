"""PEFT LoRA as a first-class path (bf16 compute, CPU): the frozen base is kept in the compute dtype
only (no fp32 master, moments or gradient: host_state.py ``compact``), which changes no number; the
host bytes per base parameter are what the layout says; checkpoints carry the adapter as peft saves
it and resume exactly.

(Exactness of LoRA gradients against plain PyTorch, fp32:
tests/engine/test_paths.py::test_peft_lora_qkvo.)
"""

import json
import os

import pytest
import torch
from torch import nn

import megatrain_ds
from tests.models import tiny_hf, token_batches, train_lm

peft = pytest.importorskip("peft")
STEPS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(seed: int = 0):
    model = peft.get_peft_model(
        tiny_hf("llama", seed=seed),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS),
    )
    g = torch.Generator().manual_seed(seed + 1)
    # LoRA B starts at zero: give every adapter a gradient at step 0
    for name, p in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _config(clip: float = 0.0) -> dict:
    # placement pinned: on CUDA "auto" would move state to the GPU after the first step (a resumed
    # run's first step would then run where the uninterrupted run's did not, and the GPU's AdamW
    # rounds differently from the host's)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0},
    }


def _batches(n: int = STEPS, seed: int = 1):
    return token_batches(n, seed)


def _adapters(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.master_state_dict().items() if "lora_" in n}


def test_frozen_base_in_compute_dtype_changes_no_number():
    """The same LoRA model twice, bf16: (a) as peft leaves it (base frozen: compact, 2 bytes per
    base parameter);
    (b) with the base in an optimizer group with lr 0 and no weight decay (fp32 master and moments
        for the base,
    never changed: the layout before compact storage). Losses and adapter weights agree bit for bit,
    and (a) keeps no fp32 state for the base."""
    compact, *_ = megatrain_ds.initialize(model=_lora(), config=_config())
    model = _lora()
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    for p in base:
        p.requires_grad_(True)
    groups = [
        {"params": [p for n, p in model.named_parameters() if "lora_" in n]},
        {"params": base, "lr": 0.0, "weight_decay": 0.0},
    ]
    full, *_ = megatrain_ds.initialize(model=model, model_parameters=groups, config=_config())
    batches = _batches()
    assert train_lm(compact, batches) == train_lm(full, batches)
    a, b = _adapters(compact), _adapters(full)
    assert a.keys() == b.keys() and len(a) == 2 * len(TARGETS) * 3
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the base did not move, and is kept in bf16
    for name, t in compact.master_state_dict().items():
        if "lora_" not in name:
            assert t.dtype == torch.bfloat16, name
            assert torch.equal(t, full.master_state_dict()[name].to(torch.bfloat16)), name

    store = compact.store
    assert store.compact and store.master.numel() == store.n_train  # fp32 master: adapters only
    assert store.wire.numel() == store.n_full and store.wire.dtype == torch.bfloat16
    n_lora = sum(p.ds_numel for n, p in compact.module.named_parameters() if "lora_" in n)
    assert store.n_train == n_lora
    # every resident parameter (embedding, norm; the head is tied) is frozen: no host copy, no
    # optimizer state
    assert all(
        w is None and m is None for w, m in zip(compact.resident.wire, compact.resident.exp_avg)
    )
    mem, mem_full = compact.host_memory(), full.host_memory()
    # layers: 2 bytes per element (wire) + fp32 master, two moments, bf16 gradient home for the
    # adapters
    assert mem["layers_bytes"] == 2 * store.n_full + (4 + 4 + 4 + 2) * store.n_train
    assert mem["trainable"] == n_lora and mem["base"] == mem["params"] - n_lora
    print(
        f"\nhost bytes per base parameter (tiny model, adapters {n_lora / mem['base']:.1%} of the "
        "base): "
        f"{mem['bytes_per_base_param']:.2f} compact; {mem_full['bytes_per_param']:.2f} per "
        "parameter with fp32 "
        "base state"
    )
    assert mem["total_bytes"] < 0.5 * mem_full["total_bytes"]


def test_checkpoint_resumes_and_carries_the_peft_adapter(tmp_path):
    """save -> load into a fresh engine -> the next steps equal the uninterrupted run's; the frozen
    fragments are written in bf16; the tag folder holds the adapter as peft's save_pretrained writes
    it, and PeftModel.from_pretrained loads the engine's adapter weights from it."""
    batches = _batches(5)
    engine, *_ = megatrain_ds.initialize(model=_lora(), config=_config(clip=1.0))
    train_lm(engine, batches[:2])
    engine.save_checkpoint(str(tmp_path), tag="t")
    want = train_lm(engine, batches[2:])
    folder = tmp_path / "t"
    states = torch.load(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    fragments = states["frozen_param_fragments"]
    assert fragments and all(f.dtype == torch.bfloat16 for f in fragments.values())

    # the adapter, as peft reads it back onto a fresh base model
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    assert os.path.exists(folder / "adapter_model.safetensors")
    saved = _adapters_at(tmp_path, "t")
    resumed, *_ = megatrain_ds.initialize(model=_lora(seed=5), config=_config(clip=1.0))
    resumed.load_checkpoint(str(tmp_path), tag="t")
    got = resumed.master_state_dict()
    for name, value in saved.items():  # peft's names drop the adapter name ("default")
        assert torch.equal(value, got[name.replace(".weight", ".default.weight")]), name
    assert train_lm(resumed, batches[2:]) == want


def _adapters_at(root, tag) -> dict[str, torch.Tensor]:
    """The adapter weights of the checkpoint, through peft's own loader onto a fresh base."""
    fresh = peft.PeftModel.from_pretrained(tiny_hf("llama", seed=7), str(root / tag))
    state = peft.get_peft_model_state_dict(fresh)
    assert state, "peft loaded no adapter weights"
    return {
        "base_model.model." + k if not k.startswith("base_model") else k: v.float()
        for k, v in state.items()
    }


def test_save_adapter_needs_a_peft_model(tmp_path):
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=_config())
    with pytest.raises(TypeError, match="not a peft PeftModel"):
        engine.save_adapter(str(tmp_path))
    assert isinstance(engine.module, nn.Module)


def test_layers_with_optimizer_state_on_the_device():
    """gpu_optimizer_layers with a compact store: the device holds the adapters' fp32 master and
    moments, a load casts them and copies the frozen bf16 base from the wire; the numbers equal the
    all-host run's."""

    def run(megatrain: dict):
        cfg = _config(clip=1.0)
        cfg["megatrain"].update(megatrain)
        engine, *_ = megatrain_ds.initialize(model=_lora(), config=cfg)
        return train_lm(engine, _batches(4)), _adapters(engine), engine

    host, held = run({}), run({"gpu_optimizer_layers": 2})
    # 2 of 3 layers' adapters only
    assert held[2].layer_states.device_state.master.numel() < held[2].store.n_train
    if held[2].device.type == "cpu":  # the same AdamW kernel on the same device: bit for bit
        assert host[0] == held[0]
        for name, value in host[1].items():
            assert torch.equal(value, held[1][name]), name
    # CUDA: the GPU's fused AdamW rounds differently from the host's (fp32), then bf16 wire copies
    else:
        assert host[0] == pytest.approx(held[0], rel=1e-3)
        for name, value in host[1].items():
            assert (value - held[1][name]).abs().max() <= 1e-5, name
