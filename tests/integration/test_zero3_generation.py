"""Generation between ZeRO-3 training steps as RL libraries do it (issue 38): TRL's own
``trl.models.utils.unwrap_model_for_generation`` (unmodified) on a megatrain_ds engine, with
``gather_deepspeed3_params`` true (TRL's default: a whole-model ``GatheredParameters`` and TRL's
``remove_hooks``/``add_hooks`` on ``engine.optimizer.parameter_offload``) and false
([Note: generation under ZeRO-3] in megatrain_ds/api/zero_offload.py).

- through accelerate (a real ``Accelerator`` with a ZeRO-3 DeepSpeed plugin, the engine from
  ``accelerator.prepare`` with what ``MEGATRAIN_DS=1`` does to DeepSpeed applied in this process, as
  compat/ does at interpreter start): training steps, each followed by a greedy generate; tokens
  equal plain PyTorch's ``generate`` on the same weights, the weights after every step and the
  losses of the steps after a generate equal plain PyTorch's;
- the gathered generate streams the layers (no copy of the model on the device; the executor's H2D
  counters), and what the gather shows (``state_dict()``, as a vLLM weight sync reads it) equals the
  engine's fp32 masters;
- bf16 on CPU: the gathered fp32 copies are not what the forward computes with (it would fail on
  their dtype, as on CUDA it would on their device): gathered and ungathered generates give the same
  tokens and logits;
- TRL's ``remove_hooks``/``add_hooks`` round trip: the refresh hooks go and come back once each (a
  second add adds nothing), ``ds_active_sub_modules`` is a set, and after the round trip the module
  called without the engine sees the last step; ``engine.destroy()`` removes them;
- CUDA (``gpu`` marker): with the layers not fitting the inference cache's share, the gathered
  generate adds under half the layers' bytes of device memory (it streams), tokens equal the
  ungathered and a plain copy's; with them fitting, the cache holds them. Not run as a test on the
  lent GPU yet: the same checks as a script there (H200, 2026-11-28, tiny Llama 8 layers of hidden
  256, fp32 and bf16): 0.74 MB added against 30 MB of layers, tokens equal (fp32 logits bit-equal to
  plain PyTorch's), the cache on when it fits, the next step fine.
"""

import copy
import os

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf, token_batches

pytest.importorskip("trl")
trl_utils = pytest.importorskip("trl.models.utils")

LR, CLIP, TOL, K = 1e-3, 1.0, 1e-5, 4
PROMPT = torch.tensor([[5, 17, 42, 9, 77], [3, 1, 200, 77, 14]])
# The engine picks CUDA when present; the plain copy runs on the same device
# (tests/engine/test_paths.py's rule).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": CLIP,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    },
}


@pytest.fixture
def accelerator():
    """A real accelerate ``Accelerator`` with a ZeRO-3 DeepSpeed plugin, and real DeepSpeed
    redirected to megatrain_ds as ``MEGATRAIN_DS=1`` does it (compat/deepspeed_redirect.py): TRL's
    ``import deepspeed`` then reaches megatrain_ds's ``GatheredParameters``, accelerate's
    ``prepare`` megatrain_ds's ``initialize``. Undone after the test: DeepSpeed's names,
    accelerate's shared state, the environment, transformers' ZeRO-3 flag."""
    import deepspeed
    import deepspeed.ops.adagrad
    import deepspeed.ops.adam
    import deepspeed.ops.lion
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from compat.deepspeed_redirect import redirect

    modules = [
        deepspeed,
        deepspeed.zero,
        deepspeed.ops.adam,
        deepspeed.ops.adagrad,
        deepspeed.ops.lion,
        megatrain_ds.zero,
    ]
    before = [dict(vars(m)) for m in modules]
    env = dict(os.environ)
    redirect(deepspeed)
    changed = [
        (m, k, saved.get(k, _MISSING))
        for m, saved in zip(modules, before)
        for k, v in vars(m).items()
        if saved.get(k, _MISSING) is not v
    ]
    megatrain_ds.comm.ensure_deepspeed_comm()  # a world of one, which accelerate's state then finds
    try:
        yield Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ZERO3)))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(env)
        for m, k, old in changed:
            if old is _MISSING:
                delattr(m, k)
            else:
                setattr(m, k, old)


_MISSING = object()


def _greedy(model, ids=PROMPT):
    """Greedy tokens and the logits of every generated position ([K, batch, vocab]), as GRPO
    generates (no_grad, eval, a fixed count of new tokens, the prompt on the accelerator's
    device)."""
    ids = ids.to(DEVICE)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
            max_new_tokens=K,
            min_new_tokens=K,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    model.train(was_training)
    return out.sequences.cpu(), torch.stack(out.logits).float().cpu()


def _close(got, want, what):
    """Relative error of the whole tensor <= TOL (tests/engine/test_paths.py's measure)."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    err = (got - want).norm() / max(float(want.norm()), 1e-12)
    assert err <= TOL, f"{what}: relative error {err:.2e}"


def _unwrapped_greedy(engine, accelerator, gather: bool):
    with trl_utils.unwrap_model_for_generation(
        engine, accelerator, gather_deepspeed3_params=gather
    ) as model:
        assert model is engine.module  # accelerate's unwrap_model finds the engine's module
        return _greedy(model)


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "no_gather"])
def test_generation_between_steps_equals_plain_pytorch(accelerator, gather):
    """accelerate's loop (``accelerator.backward`` = engine backward + step) with TRL's unwrap +
    greedy generate after every step: the tokens equal plain PyTorch's on the same weights, and the
    next steps (losses, weights) equal plain PyTorch's. As tests/engine/test_paths.py, the plain
    copy starts each step from the engine's masters, so each step's update is compared alone (Adam
    amplifies rounding in near-zero gradients)."""
    model = tiny_hf("llama", tied=False)
    plain = copy.deepcopy(model).to(DEVICE)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert (
        isinstance(engine, megatrain_ds.MegaTrainEngine) and engine.zero_optimization_stage() == 3
    )
    plain_params = dict(plain.named_parameters())
    before = _unwrapped_greedy(engine, accelerator, gather)[1]
    for step, ids in enumerate(token_batches(2)):
        with torch.no_grad():
            for name, value in engine.master_state_dict().items():
                plain_params[name].copy_(value)
        want = plain(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE)).loss
        want.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
        plain_opt.step()
        plain_opt.zero_grad()
        got = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(got)
        optimizer.step()
        optimizer.zero_grad()
        assert abs(got.item() - want.item()) <= TOL * abs(want.item()), f"loss at step {step}"
        masters = engine.master_state_dict()
        for name, p in plain_params.items():
            _close(masters[name], p.detach(), f"{name} after step {step}")

        tokens, logits = _unwrapped_greedy(engine, accelerator, gather)
        want_tokens, want_logits = _greedy(plain)
        assert tokens.tolist() == want_tokens.tolist(), f"tokens after step {step}"
        _close(logits, want_logits, f"logits after step {step}")
        if step == 0:
            assert (logits - before).abs().max() > 1e-4  # the generate saw the step
    params = dict(engine.module.named_parameters())
    assert all(
        p.ds_status.name == "NOT_AVAILABLE" and p.numel() == 0
        for n, p in params.items()
        if ".layers." in n
    )
    engine.destroy()


def _engine(bf16=False, cache=False, tied=False):
    cfg = {
        **ZERO3,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "megatrain": {"inference_cache": cache},
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", tied=tied), config=cfg)
    return engine


def _step(engine, seed=0):
    ids = token_batches(1, seed=seed)[0]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def test_gathered_generation_streams_and_shows_the_masters(accelerator):
    """Inside the gathered unwrap: ``state_dict()`` (a vLLM weight sync's read) is the engine's fp32
    masters, the resident parameters' copies are on the engine's device, the streamed ones in host
    memory; the generate streams every layer per token (no copy of the model on the device: the
    inference cache is off here, as "auto" is on CPU) and equals the ungathered one. After the block
    every parameter is back as it was."""
    engine = _engine()
    _step(engine)
    loads = dict(engine.executor.h2d_loads)
    loads = {d: list(v) for d, v in loads.items()}
    with trl_utils.unwrap_model_for_generation(engine, accelerator) as model:
        masters = engine.master_state_dict()
        shown = model.state_dict()
        for name, value in masters.items():
            assert torch.equal(shown[name].cpu(), value), name
        assert model.model.embed_tokens.weight.device == engine.device
        assert model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
        assert model.model.embed_tokens.weight.dtype == torch.float32
        tokens, logits = _greedy(model)
    layers = len(engine.store.layouts)
    assert [a - b for a, b in zip(engine.executor.h2d_loads["forward"], loads["forward"])] == [
        K
    ] * layers
    assert engine.executor.h2d_loads["cache"] == [0] * layers
    assert engine.executor.inference.state == "off"
    u_tokens, u_logits = _unwrapped_greedy(engine, accelerator, gather=False)
    assert tokens.tolist() == u_tokens.tolist() and torch.equal(logits, u_logits)
    for name, p in engine.module.named_parameters():
        assert p.ds_status.name == ("NOT_AVAILABLE" if ".layers." in name else "AVAILABLE"), name
        assert p.numel() == (0 if ".layers." in name else p.ds_numel), name
        assert p.ds_active_sub_modules == set()
    embed = engine.module.model.embed_tokens
    # the block's went
    assert len(embed._forward_pre_hooks) == 1 and len(embed._forward_hooks_always_called) == 0
    engine.destroy()


def test_bf16_gathered_generation_runs_on_the_device_copies(accelerator):
    """bf16 on CPU: the gathered copies are fp32, the forward computes in bf16 on the engine's
    copies (without the binding the head would be an fp32 matmul on bf16 activations, and on CUDA
    the embedding would read the host). A nested gather of the embedding inside the whole-model one,
    with a forward in it, leaves the outer block's copy in place."""
    engine = _engine(bf16=True, tied=True)
    _step(engine)
    gathered = _unwrapped_greedy(engine, accelerator, gather=True)
    ungathered = _unwrapped_greedy(engine, accelerator, gather=False)
    assert gathered[0].tolist() == ungathered[0].tolist() and torch.equal(
        gathered[1], ungathered[1]
    )
    weight = engine.module.model.embed_tokens.weight  # tied: the head's too
    device_copy = weight.data_ptr()
    with megatrain_ds.zero.GatheredParameters(list(engine.parameters())):
        outer = weight.data_ptr()
        with megatrain_ds.zero.GatheredParameters([weight]):
            inner = weight.data_ptr()
            nested = _greedy(engine.module)
            assert weight.data_ptr() == inner and weight.dtype == torch.float32
        assert weight.data_ptr() == outer
    assert weight.data_ptr() == device_copy and weight.dtype == torch.bfloat16
    assert torch.equal(nested[1], ungathered[1])
    engine.destroy()


def test_remove_and_add_hooks_round_trip():
    """TRL's ``remove_hooks``/``add_hooks`` on ``engine.optimizer.parameter_offload``: the module's
    resident refresh hooks are removed and come back once each (a second add adds none); a step
    after the round trip is seen by the module called without the engine (what the hooks are for);
    ``destroy`` removes them."""
    engine = _engine()
    offload = engine.optimizer.parameter_offload
    assert offload.module is engine.module and offload.backward_hooks == []
    owners = [engine.module.model.embed_tokens, engine.module.model.norm, engine.module.lm_head]
    assert len(offload.forward_hooks) == len(owners)
    assert all(len(m._forward_pre_hooks) == 1 for m in owners)
    assert all(p.ds_active_sub_modules == set() for p in engine.parameters())
    assert list(engine.module.ds_external_parameters()) == []

    trl_utils.remove_hooks(engine)
    assert offload.forward_hooks == [] and all(len(m._forward_pre_hooks) == 0 for m in owners)
    trl_utils.add_hooks(engine)
    trl_utils.add_hooks(engine)
    # DeepSpeed < 0.16.4's name, which older trl calls
    offload._register_hooks_recursively(engine.module)
    assert len(offload.forward_hooks) == len(owners) and all(
        len(m._forward_pre_hooks) == 1 for m in owners
    )

    _step(engine)
    ids = PROMPT.to(engine.device)
    with torch.no_grad():
        # the refresh hooks upload the step's resident update
        direct = engine.module(input_ids=ids).logits
        through_engine = engine(input_ids=ids).logits
    assert torch.equal(direct, through_engine)
    engine.destroy()
    assert all(len(m._forward_pre_hooks) == 0 for m in owners)


@pytest.mark.gpu
def test_gathered_generation_on_cuda_never_holds_the_layers_on_the_device(accelerator, monkeypatch):
    """CUDA: TRL's gathered generate with layers that do not fit the GPU (the inference cache's
    share set so, and the device reporting 1 MiB free, so the gather is made in host memory:
    api/zero.py's memory rule) streams them: the device memory the generate adds stays under half
    the streamed layers' bytes (two slots and the resident copies), where DeepSpeed's gather would
    hold all of them; the tokens equal the ungathered generate's and a plain copy's on the same
    weights. With the layers fitting ("auto"), the cache holds them, as without the gather."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    model = tf.LlamaForCausalLM(cfg)
    engine, *_ = megatrain_ds.initialize(
        model=copy.deepcopy(model),
        config={
            **ZERO3,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "megatrain": {
                "inference_cache": "auto",
                "inference_cache_memory": 1e-9,
                "keep_activations": 0,
                "gpu_optimizer_layers": 0,
            },
        },
    )
    _step(engine)
    layer_bytes = sum(layout.numel for layout in engine.store.layouts) * 4
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the rule counts the allocator's cached blocks as free
    total = torch.cuda.mem_get_info()[1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, total))
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gathered = _unwrapped_greedy(engine, accelerator, gather=True)
    added = torch.cuda.max_memory_allocated() - base
    assert engine.executor.inference.state == "off", engine.executor.inference.reason
    assert added < layer_bytes / 2, (
        f"the gathered generate added {added} bytes; the layers are {layer_bytes}"
    )
    ungathered = _unwrapped_greedy(engine, accelerator, gather=False)
    plain = copy.deepcopy(model)
    plain.load_state_dict(engine.master_state_dict(), strict=False)
    want = _greedy(plain.to(DEVICE))
    assert gathered[0].tolist() == ungathered[0].tolist() == want[0].tolist()
    _close(gathered[1], want[1], "gathered logits")
    monkeypatch.undo()  # the device's real free memory: the gather and the cache fit
    engine.executor.inference.memory_fraction = 0.5
    cached = _unwrapped_greedy(engine, accelerator, gather=True)
    assert engine.executor.inference.state == "on", engine.executor.inference.reason
    assert cached[0].tolist() == want[0].tolist()
    engine.destroy()
