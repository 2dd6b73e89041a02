"""Masters on NVMe (DeepSpeed's ZeRO-Infinity pair ``offload_param: {device: nvme}`` +
``offload_optimizer: {device: nvme}``): the NVMe layers' fp32 masters join their Adam moments in the
swap file, and only their bf16 wire copy and gradient stay in RAM. Training, checkpoints and the
ZeRO-3 parameter surface give what host-only training with the same (bf16) wire gives, bit for bit;
host RAM shrinks by 12 bytes per parameter of those layers, exactly as the planner says; a config
whose master is what streams (fp32 compute, ``stream_fp32_master: true``, bf16 masters) is refused
with the keys named.
"""

import os

import pytest
import torch

import megatrain_ds
from megatrain_ds.planning import plan
from megatrain_ds.planning.config import ConfigError
from megatrain_ds.host.nvme import align
from tests.models import tiny_hf, token_batches, train_lm

LAYERS, DISK, GA, STEPS = 5, 3, 2, 5


def _config(path=None, *, clip=0.05, ga=GA, buffers=2, layers=DISK, masters=True):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        # host-only reference: the same bf16 wire the NVMe masters need (the master cannot stream
        # from disk)
        "megatrain": {
            "gpu_optimizer_layers": 0,
            "keep_activations": 0,
            "stream_fp32_master": False,
        },
    }
    if path is not None:
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(path),
                "buffer_count": buffers,
                "pipeline_read": True,
                "pipeline_write": True,
            },
            "offload_param": {"device": "nvme" if masters else "cpu", "nvme_path": str(path)},
        }
        cfg["megatrain"].update(nvme_layers=layers, nvme_backend="threads")
    return cfg


def _masters(engine):
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference():
    """Host-only, bf16 wire: losses and masters after STEPS steps, and its host bytes."""
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=_config())
    losses = train_lm(engine, token_batches(STEPS * GA))
    out = losses, _masters(engine), engine.host_memory()["total_bytes"]
    engine.destroy()
    return out


def test_masters_on_nvme_equal_host_only(tmp_path, reference):
    """GA 2 and clipping that fires (speculative updates undone and redone through the tier, masters
    included): every loss and master bit-identical to host-only; the swap file holds master +
    moments of the disk layers; host RAM is 12 bytes per disk-layer parameter lighter (plus the
    staging buffers), as ``plan`` predicts."""
    model = tiny_hf("llama", layers=LAYERS)
    cfg = _config(tmp_path)
    pred = plan.plan_model(model, plan.load_train_config(cfg), device="cpu")
    engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
    store, tier = engine.store, engine.store.tier
    assert store.masters_on_disk and store.disk_from == LAYERS - DISK
    disk_train = [store.layouts[i].n_train for i in range(LAYERS - DISK, LAYERS)]
    assert (
        tier.file_bytes == sum(3 * align(4 * n) for n in disk_train) == os.path.getsize(tier.path)
    )
    assert store.master.numel() == sum(store.layouts[i].n_train for i in range(LAYERS - DISK))
    with pytest.raises(RuntimeError, match="on NVMe"):
        store.master_of(LAYERS - 1)
    losses, masters, host_only_bytes = reference
    assert train_lm(engine, token_batches(STEPS * GA)) == losses
    _assert_same(_masters(engine), masters)
    mem = engine.host_memory()
    assert mem["total_bytes"] == host_only_bytes - 12 * sum(disk_train) + tier.staging_bytes()
    assert pred.host_state_bytes == mem["total_bytes"] and pred.disk_bytes == tier.file_bytes
    assert pred.nvme_masters and "fp32 masters and Adam moments" in pred.table()
    assert tier.writes >= STEPS * DISK
    engine.destroy()


def test_checkpoints_between_nvme_masters_and_host_only(tmp_path, reference):
    """Saved with masters on disk after 3 steps: a host-only engine and an NVMe-masters engine both
    resume to the uninterrupted run; a host-only checkpoint resumes into an NVMe-masters engine
    too."""
    nv = tmp_path / "nvme"
    nv.mkdir()
    losses, masters, _ = reference
    batches = token_batches(STEPS * GA)
    for save_cfg, name in ((_config(nv), "disk"), (_config(), "ram")):
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=save_cfg)
        train_lm(engine, batches[: 3 * GA])
        engine.save_checkpoint(str(tmp_path / name), tag="t3")
        engine.destroy()
    for load_cfg, name in (
        (_config(), "disk"),
        (_config(nv, layers=2), "disk"),
        (_config(nv), "ram"),
    ):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=LAYERS, seed=7), config=load_cfg
        )
        engine.load_checkpoint(str(tmp_path / name), tag="t3")
        assert train_lm(engine, batches[3 * GA :]) == losses[3 * GA :], (
            load_cfg["megatrain"],
            name,
        )
        _assert_same(_masters(engine), masters)
        engine.destroy()


def test_parameter_surface_reads_and_writes_disk_masters(tmp_path):
    """``GatheredParameters`` (modifier), ``safe_get/set_full_fp32_param`` and
    ``load_master_state_dict`` on an NVMe layer's weights: the same values and the same training
    afterwards as host-only; ``ds_tensor`` of such a parameter is its bf16 wire copy."""
    from megatrain_ds.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    name, up = "model.layers.4.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight"
    results = []
    for cfg in (_config(tmp_path), _config()):
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=cfg)
        train_lm(engine, token_batches(2))
        params = dict(engine.module.named_parameters())
        p = params[name]
        if engine.store.masters_on_disk:
            assert p.ds_tensor.dtype == torch.bfloat16 and p.ds_tensor.shape == p.ds_shape
        with megatrain_ds.zero.GatheredParameters([p], modifier_rank=0):
            p.data.mul_(0.5)
        value = safe_get_full_fp32_param(params[up])
        safe_set_full_fp32_param(params[up], value + 0.01)
        state = _masters(engine)
        state["model.layers.2.mlp.down_proj.weight"] = (
            state["model.layers.2.mlp.down_proj.weight"] * 0.9
        )
        state["model.layers.4.mlp.down_proj.weight"] = (
            state["model.layers.4.mlp.down_proj.weight"] * 0.9
        )
        engine.load_master_state_dict(state)
        losses = train_lm(engine, token_batches(4, seed=3))
        results.append((losses, _masters(engine), safe_get_full_fp32_param(params[up])))
        engine.destroy()
    (la, ma, ua), (lb, mb, ub) = results
    assert la == lb and torch.equal(ua, ub)
    _assert_same(ma, mb)


def test_masters_on_nvme_refused_where_the_master_streams(tmp_path):
    """fp32 compute, ``stream_fp32_master: true`` and bf16 masters stream the master itself:
    refused, the key named."""
    fp32 = _config(tmp_path)
    del fp32["bf16"]
    streamed = _config(tmp_path)
    streamed["megatrain"]["stream_fp32_master"] = True
    low = _config(tmp_path)
    low["bf16"]["bf16_master_weights_and_grads"] = True
    for cfg, what in (
        (fp32, "fp32 compute"),
        (streamed, "stream_fp32_master=true"),
        (low, "bf16_master_weights_and_grads"),
    ):
        with pytest.raises(ConfigError, match=f"offload_param.device=nvme.*{what}"):
            megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=cfg)


def test_offload_param_nvme_alone_keeps_masters_in_ram(tmp_path):
    """``offload_param: nvme`` without the optimizer on NVMe: nothing on disk, and the warning says
    where the masters are and what would move them."""
    cfg = _config()
    cfg["zero_optimization"] = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
    }
    with pytest.warns(UserWarning, match="fp32 masters stay in host memory"):
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=cfg)
    assert engine.store.tier is None and engine.host_memory()["disk_bytes"] == 0
    engine.destroy()


def test_zero_infinity_config_from_the_deepspeed_docs(tmp_path):
    """The ZeRO-Infinity block as DeepSpeed's docs give it (params and optimizer to NVMe, fp16, the
    ``aio`` block), with only ``nvme_path`` pointed at a temporary folder: the disk layers' masters
    go to NVMe, training runs, and the keys this engine does not act on (param buffers,
    ``max_in_cpu``, ``fast_init``) are named, not silent."""
    nv = str(tmp_path)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nv,
                "pin_memory": True,
                "buffer_count": 4,
                "fast_init": False,
            },
            "offload_param": {
                "device": "nvme",
                "nvme_path": nv,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 1e8,
                "max_in_cpu": 1e9,
            },
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "megatrain": {"nvme_layers": 2, "nvme_backend": "threads"},
    }
    with pytest.warns(UserWarning) as record:
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=cfg)
    said = " ".join(str(w.message) for w in record)
    for key in ("buffer_size", "max_in_cpu", "fast_init"):
        assert key in said, key
    assert engine.store.masters_on_disk and engine.store.wire_dtype == torch.float16
    losses = train_lm(engine, token_batches(4))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    engine.destroy()


def test_lora_adapters_with_masters_on_nvme(tmp_path):
    """A peft LoRA model: the disk layers' records hold the adapters' masters only (the frozen base
    stays in its bf16 wire copy), and training equals host-only bit for bit."""
    peft = pytest.importorskip("peft")

    def model():
        return peft.get_peft_model(
            tiny_hf("llama", layers=LAYERS),
            peft.LoraConfig(
                r=4,
                lora_alpha=8,
                lora_dropout=0.0,
                target_modules=["q_proj", "v_proj", "down_proj"],
            ),
        )

    results = []
    for cfg in (_config(tmp_path), _config()):
        engine, *_ = megatrain_ds.initialize(model=model(), config=cfg)
        if engine.store.masters_on_disk:
            tier, store = engine.store.tier, engine.store
            assert tier.file_bytes == sum(
                3 * align(4 * store.layouts[i].n_train) for i in tier.n_train
            )
            assert all(
                store.layouts[i].n_frozen > store.layouts[i].n_train > 0 for i in tier.n_train
            )
        results.append((train_lm(engine, token_batches(2 * GA)), _masters(engine)))
        engine.destroy()
    (la, ma), (lb, mb) = results
    assert la == lb
    _assert_same(ma, mb)
