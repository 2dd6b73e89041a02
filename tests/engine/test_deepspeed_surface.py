"""Pieces of DeepSpeed's surface beyond initialize(config=...): client optimizers, comm,
attributes."""

import copy

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}


def _train(engine_or_model, opt, steps=5, engine=True):
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 12), generator=g)
        if engine:
            loss = engine_or_model(input_ids=ids, labels=ids).loss
            engine_or_model.backward(loss)
            engine_or_model.step()
        else:
            loss = engine_or_model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(engine_or_model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_client_torch_optimizer_is_mapped(cls):
    """A script's own torch Adam/AdamW (with two param groups) trains exactly as PyTorch would run
    it."""
    ref = tiny_hf("llama", tied=False)
    ours = copy.deepcopy(ref)

    def groups(model):
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    ref_opt = cls(groups(ref), lr=2e-3, betas=(0.9, 0.95), eps=1e-6)
    want = _train(ref, ref_opt, engine=False)
    client = cls(groups(ours), lr=2e-3, betas=(0.9, 0.95), eps=1e-6)
    engine, optimizer, _, _ = megatrain_ds.initialize(model=ours, optimizer=client, config=CFG)
    assert optimizer.adam_w_mode == (cls is torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    got = _train(engine, None)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    engine.destroy()


def test_optimizer_factory_and_unsupported_client_optimizer():
    model = tiny_hf("llama")
    engine, optimizer, _, _ = megatrain_ds.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=CFG,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
    )
    assert optimizer.param_groups[0]["lr"] == 3e-4
    engine.destroy()
    with pytest.raises(NotImplementedError, match="SGD"):
        megatrain_ds.initialize(
            model=tiny_hf("llama"), optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1), config=CFG
        )


def test_engine_forwards_attributes_to_the_module():
    model = tiny_hf("qwen2")
    engine, *_ = megatrain_ds.initialize(
        model=model, config={**CFG, "optimizer": {"type": "AdamW"}}
    )
    # the DeepSpeed dict, not the HF config
    assert engine.config["train_micro_batch_size_per_gpu"] == 2
    assert engine.module.config.model_type == "qwen2"
    assert engine.get_input_embeddings() is model.get_input_embeddings()  # forwarded to the module
    with pytest.raises(AttributeError):
        engine.no_such_attribute
    engine.destroy()


def test_comm_in_one_process():
    from megatrain_ds import comm

    assert comm.get_world_size() == 1 and comm.get_rank() == 0 and comm.get_local_rank() == 0
    t = torch.ones(3)
    comm.all_reduce(t)
    comm.barrier()
    assert torch.equal(t, torch.ones(3))
    # no launcher: a world of one in memory, no MASTER_ADDR needed (as DeepSpeed)
    megatrain_ds.init_distributed()
    assert comm.is_initialized() and comm.get_world_size() == 1 and comm.get_rank() == 0


def test_ops_adam_descriptions_are_mapped():
    model = tiny_hf("llama")
    opt = megatrain_ds.ops.adam.DeepSpeedCPUAdam(
        model.parameters(), lr=5e-4, weight_decay=0.05, adamw_mode=False
    )
    engine, optimizer, _, _ = megatrain_ds.initialize(model=model, optimizer=opt, config=CFG)
    assert not optimizer.adam_w_mode and optimizer.param_groups[0]["lr"] == 5e-4
    engine.destroy()
    with pytest.raises(RuntimeError, match="engine runs the updates"):
        megatrain_ds.ops.adam.FusedAdam([torch.zeros(1, requires_grad=True)]).step()


def test_zero_init_builds_on_cpu_and_gathered_parameters_read_and_write():
    with megatrain_ds.zero.Init():
        model = tiny_hf("llama")
    assert all(p.device.type == "cpu" for p in model.parameters())
    ref = copy.deepcopy(model)
    engine, *_ = megatrain_ds.initialize(
        model=model, config={**CFG, "optimizer": {"type": "AdamW"}}
    )
    w = engine.module.model.layers[1].mlp.down_proj.weight
    assert w.numel() == 0 and w.ds_status == megatrain_ds.zero.ZeroParamStatus.NOT_AVAILABLE
    assert w.ds_shape == tuple(ref.model.layers[1].mlp.down_proj.weight.shape)
    with megatrain_ds.zero.GatheredParameters(w):
        assert torch.equal(w.data, ref.model.layers[1].mlp.down_proj.weight.data)
        w.data.zero_()  # no modifier_rank: not written back
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        before = engine(input_ids=ids).logits.cpu()
        assert torch.allclose(before, ref(input_ids=ids).logits, atol=1e-5)
    with megatrain_ds.zero.GatheredParameters([w], modifier_rank=0):
        w.data.mul_(0.0)
    with torch.no_grad():
        ref.model.layers[1].mlp.down_proj.weight.zero_()
        after = engine(input_ids=ids).logits.cpu()
        # the engine runs the edit
        assert torch.allclose(after, ref(input_ids=ids).logits, atol=1e-5)
    assert not torch.allclose(after, before)
    assert w.numel() == 0  # released again
    emb = engine.module.get_input_embeddings().weight
    with megatrain_ds.zero.GatheredParameters(emb, modifier_rank=0):
        emb.data[3] = 1.0
    with megatrain_ds.zero.GatheredParameters(emb):
        assert torch.all(emb.data[3] == 1.0)
    engine.destroy()


def test_checkpointing_module():
    megatrain_ds.checkpointing.configure(None, partition_activations=False)
    assert megatrain_ds.checkpointing.is_configured()
    x = torch.randn(3, requires_grad=True)
    megatrain_ds.checkpointing.checkpoint(lambda t: (t * 2).sum(), x).backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_gather_and_export_with_device_held_optimizer_state():
    """Layers whose masters live on the device (gpu_optimizer_layers) are read from there, not stale
    host copies."""
    cfg = {
        **CFG,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "megatrain": {"gpu_optimizer_layers": 2},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=cfg)
    _train(engine, None, steps=2)
    device_master = engine.layer_states.device_state.master_of(0)
    w = engine.module.model.layers[0].self_attn.q_proj.weight
    with megatrain_ds.zero.GatheredParameters(w):
        gathered = w.data.clone()
    # layout: q_proj first
    assert torch.equal(gathered.reshape(-1), device_master[: w.ds_numel].cpu())
    # the host copy, as of the last sync
    stale = engine.store.param_master(0, "self_attn.q_proj.weight")
    assert not torch.equal(gathered, stale)
    exported = engine._zero3_consolidated_16bit_state_dict()
    assert torch.equal(exported["model.layers.0.self_attn.q_proj.weight"], gathered)
    engine.destroy()


def test_whole_model_gather_reads_device_held_layers_where_they_are():
    """TRL's rollout gathers every parameter. In one process the values are made on the engine's
    device, as DeepSpeed gathers: a GPU-held layer's straight from its device master, never copied
    to the host first (a 1.5B model's 28 layers x 12 parameters once moved its layers D2H a dozen
    times over; then once each, 1.1 s per rollout on an H200), and every gathered value is the
    current master: the device's for the held layers, the host's for the others. They are copies: an
    edit without modifier_rank changes no master."""
    cfg = {
        **CFG,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "megatrain": {"gpu_optimizer_layers": 2},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=cfg)
    _train(engine, None, steps=2)
    states = engine.layer_states
    refreshed = []
    refresh = states._refresh_host
    states._refresh_host = lambda i: (refreshed.append(i), refresh(i))[1]
    params = list(engine.module.parameters())
    before = {n: t.clone() for n, t in engine.master_state_dict().items()}
    refreshed.clear()
    with megatrain_ds.zero.GatheredParameters(params):
        gathered = {n: p.data.clone() for n, p in engine.module.named_parameters()}
        assert {p.data.device.type for p in params} == {engine.device.type}
        for p in params:
            p.data.add_(1.0)  # not written back: no modifier_rank
    assert refreshed == []  # no held layer went to the host
    masters = engine.master_state_dict()
    assert all(torch.equal(masters[n], before[n]) for n in before)
    for name, value in gathered.items():
        assert torch.equal(value.cpu(), masters[name].reshape(value.shape).cpu()), name
    engine.destroy()


def test_a_gather_goes_to_the_gpu_only_when_it_leaves_room_for_the_inference_cache(monkeypatch):
    """On CUDA the gathered copies are made on the device only when they and the inference cache a
    generate in the block will upload take at most half the free device memory; otherwise (a model
    larger than the GPU) the host path reads them. (The CUDA calls are stood in for: the rule, not
    the copies, is what this checks.)"""
    import types

    from megatrain_ds.api import zero

    class Sentinel(Exception):
        pass

    def synchronize():
        raise Sentinel  # the device path's first step: it was taken

    # the model state's part of the rule (host/model_state.py): its device, the cache's bytes, the
    # wait
    state = types.SimpleNamespace(
        parallel=None,
        device=torch.device("cuda", 0),
        pending_device_bytes=lambda: 600,
        synchronize=synchronize,
    )
    # 400 bytes of fp32 copies (ds_shape: the whole)
    params = [types.SimpleNamespace(ds_shape=(10, 10), shape=(0,))]
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1999, 4000))
    assert zero._gather_on_device(state, params) is None  # 400 + 600 > half of 1999
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2000, 4000))
    with pytest.raises(Sentinel):
        zero._gather_on_device(state, params)
    # data parallel: the host path (reads are collectives)
    state.parallel = types.SimpleNamespace(active=True)
    assert zero._gather_on_device(state, params) is None


def test_the_cache_bytes_a_gather_leaves_room_for_are_those_not_yet_allocated():
    """InferenceCache.pending_bytes: the layers' bytes while the cache may still be built; none once
    it is on (its buffers are allocated), when it is off by setting, or where "auto" never caches
    (CPU, data parallel)."""
    import types

    from megatrain_ds.streaming.inference import InferenceCache

    layouts = [types.SimpleNamespace(numel=100)] * 3
    ex = types.SimpleNamespace(
        layouts=layouts,
        keep={},
        own_slot=lambda i: None,  # no kept or weight-cached layer has a buffer of its own
        device=torch.device("cuda", 0),
        dp=None,
        slots=[types.SimpleNamespace(buf=torch.empty(0, dtype=torch.bfloat16))],
    )
    cache = InferenceCache(ex, "auto")
    assert cache.pending_bytes() == cache.nbytes() == 600
    cache.state = "on"
    assert cache.pending_bytes() == 0
    cache.state = "idle"
    assert (
        InferenceCache(ex, False).pending_bytes() == 0
        and InferenceCache(ex, True).pending_bytes() == 600
    )
    ex.dp = object()
    assert cache.pending_bytes() == 0 and InferenceCache(ex, True).pending_bytes() == 600
    ex.dp, ex.device = None, torch.device("cpu")
    assert cache.pending_bytes() == 0
