"""Every path a training script takes, against plain PyTorch (fp32, CPU): per-parameter gradients of
every step within 1e-5 relative, losses, and the weights after 3 optimizer steps (AdamW, clipping
on).

The paths: a loss the script computes from ``.logits``, from hidden states, from attention weights;
a sequence-classification head; a DPO step with a frozen reference engine in the same process; PEFT
LoRA; MoE models whose router aux loss is part of the loss (clipping firing), and whose router
jitter draws random numbers the recompute must replay; ``generate()`` before training; a parameter
shared by two layers; BatchNorm inside streamed layers (one statistics update per forward).
"""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megatrain_ds
from tests.models import PlainLM, tiny_hf

STEPS, LR, CLIP, TOL = 3, 1e-3, 1.0, 1e-5
# The engine picks CUDA when present; the plain copy runs on the same device (fp32 matmuls, no
# TF32), so on the GPU box these tests check the three-stream path against the same numbers.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_with(monkeypatch, megatrain: dict) -> None:
    """Every path below, rerun by another test file with ``megatrain`` as the engine's own block
    (kept layers, the weight cache)."""
    plain = _config

    def config(optimizer: bool = True) -> dict:
        return {**plain(optimizer), "megatrain": megatrain}

    monkeypatch.setattr(sys.modules[__name__], "_config", config)


def _config(optimizer: bool = True) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP}
    if optimizer:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": 0.01, "eps": 1e-6},
        }
    return cfg


def _batches(vocab: int = 256, n: int = STEPS, shape=(2, 10), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(n)]


def engine_grads(engine) -> dict[str, torch.Tensor]:
    """The gradients the engine will step with (after backward, before step), keyed like
    named_parameters."""
    ex, res = engine.executor, engine.resident
    for fut in [*ex.sq_norm, *res.sq_norm]:
        if fut is not None:
            fut.result()  # the landings have folded every gradient into its fp32 home
    out = {}
    # on CUDA "auto" may have moved some layers' state to the GPU after the first step
    ds = engine.layer_states.device_state
    for i, layout in enumerate(engine.store.layouts):
        grad = (ds.grad_of(i) if ds is not None and ds.owns(i) else engine.store.grad_of(i)).float()
        for slot in layout.slots:
            if slot.trainable and ex.has_grad[i]:
                out[f"{engine.block_name}.{i}.{slot.name}"] = grad[
                    slot.offset : slot.offset + slot.numel
                ].view(slot.shape)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for k, (p, g, has) in enumerate(zip(res.params, res.grad, res.has_grad)):
        if g is not None and has:  # (GA 1: the landing buffer itself, resident.grad_of)
            out[names[id(p)]] = res.grad_of(k).float().view(p.shape)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str, scale: float = 0.0) -> None:
    """Relative error <= TOL; ``scale`` floors the denominator for tensors whose gradient is ~0
    (attention key weights: softmax is shift-invariant), where both runs' rounding differ by more
    than 1e-5 of a tiny norm."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    err = (got - want).norm() / max(float(want.norm()), scale, 1e-12)
    assert err <= TOL, f"{what}: relative error {err:.2e}"


def _compare(model, loss_fn, batches, prepare=None, trainable=None):
    """Run ``loss_fn`` for len(batches) steps on a plain copy (torch AdamW, clip_grad_norm_) and on
    the engine; compare losses, every gradient of every step, and the trained weights."""
    ref = copy.deepcopy(model).to(DEVICE)
    ref_params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(ref_params.values(), lr=LR, weight_decay=0.01, eps=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = megatrain_ds.initialize(model=model, model_parameters=params, config=_config())
    if prepare is not None:
        prepare(engine)
    for step, batch in enumerate(batches):
        # Each step starts the plain copy from the engine's weights: gradients are compared exactly
        # at every step, not after Adam has amplified rounding in gradients that are ~0 (its update
        # is lr-sized for any nonzero gradient); the weights after the step then check this step's
        # update alone.
        masters = engine.master_state_dict()
        with torch.no_grad():
            for name, p in ref_params.items():
                p.copy_(masters[name])
        want = loss_fn(ref, _to(batch, DEVICE))
        want.backward()
        got = loss_fn(engine, batch)
        engine.backward(got)
        assert abs(got.item() - want.item()) <= TOL * abs(want.item()), f"loss at step {step}"
        grads = engine_grads(engine)
        assert set(grads) == {n for n, p in ref_params.items() if p.grad is not None}, (
            f"step {step}: grad names"
        )
        floor = 0.01 * float(
            torch.stack([p.grad.norm() for p in ref_params.values() if p.grad is not None]).norm()
        )
        for name, g in grads.items():
            _close(g, ref_params[name].grad, f"grad of {name} at step {step}", floor)
        torch.nn.utils.clip_grad_norm_(list(ref_params.values()), CLIP)
        opt.step()
        opt.zero_grad()
        engine.step()
        masters = engine.master_state_dict()
        for name, p in ref_params.items():
            _close(masters[name], p.detach(), f"{name} after step {step}")
    engine.reference = ref  # the plain copy, for tests that compare more than parameters
    return engine


def _to(batch, device):
    return tuple(_to(b, device) for b in batch) if isinstance(batch, tuple) else batch.to(device)


def _logits_loss(m, ids):
    # no labels: the model returns logits, the script takes the loss
    logits = m(input_ids=ids).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        ids.to(logits.device)[:, 1:].reshape(-1),
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_from_logits(arch):
    _compare(tiny_hf(arch), _logits_loss, _batches())


def test_loss_from_hidden_states():
    def loss_fn(m, ids):
        out = m(input_ids=ids, output_hidden_states=True)
        return (
            out.hidden_states[2].pow(2).mean() + 0.1 * out.hidden_states[-1].float().pow(2).mean()
        )

    _compare(tiny_hf("llama"), loss_fn, _batches())


def test_loss_from_attention_weights():
    """Attention weights come out of the layer through Hugging Face's output-capturing hooks: they
    must carry the layer's gradient (eager attention returns them)."""
    model = tiny_hf("llama")
    model.config._attn_implementation = "eager"

    def loss_fn(m, ids):
        out = m(input_ids=ids, output_attentions=True)
        return (
            F.cross_entropy(
                out.logits[:, :-1].reshape(-1, 256), ids.to(out.logits.device)[:, 1:].reshape(-1)
            )
            + out.attentions[1].pow(2).sum() * 0.1
        )

    _compare(model, loss_fn, _batches())


def test_sequence_classification_head():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_labels=3,
        pad_token_id=0,
    )
    model = tf.LlamaForSequenceClassification(cfg)
    labels = [torch.tensor([0, 2]), torch.tensor([1, 1]), torch.tensor([2, 0])]
    batches = [(ids.clamp_min(1), y) for ids, y in zip(_batches(), labels)]
    _compare(model, lambda m, b: m(input_ids=b[0], labels=b[1]).loss, batches)


def test_dpo_policy_and_frozen_reference_in_one_process():
    """A DPO step: the policy engine trains; the reference is a second engine with no optimizer, run
    under no_grad. Same numbers as two plain models."""
    policy, reference = tiny_hf("llama", seed=0), tiny_hf("llama", seed=0)
    ref_engine, *_ = megatrain_ds.initialize(model=reference, config=_config(optimizer=False))
    plain_reference = tiny_hf("llama", seed=0).to(DEVICE)

    def logps(m, ids):
        logits = m(input_ids=ids).logits[:, :-1].float()
        ids = ids.to(logits.device)
        return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(2).sum(-1)

    def dpo(m, batch):
        chosen, rejected = batch
        with torch.no_grad():
            r = ref_engine if isinstance(m, megatrain_ds.MegaTrainEngine) else plain_reference
            ref_c, ref_r = logps(r, chosen.to(DEVICE)), logps(r, rejected.to(DEVICE))
        margin = (logps(m, chosen) - ref_c.to(DEVICE)) - (logps(m, rejected) - ref_r.to(DEVICE))
        return -F.logsigmoid(0.1 * margin).mean()

    pairs = list(zip(_batches(seed=1), _batches(seed=2)))
    _compare(policy, dpo, pairs)


def test_peft_lora_qkvo():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_hf("llama"),
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    )
    # LoRA B starts at zero: give every adapter a gradient at step 0
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    engine = _compare(model, lambda m, ids: m(input_ids=ids, labels=ids).loss, _batches())
    assert engine.store.n_train == n_lora > 0  # only the adapters have optimizer state


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
def test_moe_router_aux_loss(arch):
    """output_router_logits: the loss the model returns includes its router aux loss (coef x load
    balancing), and the router weights get that loss's gradient."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    )
    if arch == "mixtral":
        model = tf.MixtralForCausalLM(
            tf.MixtralConfig(
                intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common
            )
        )
    elif arch == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(
            tf.Qwen2MoeConfig(
                intermediate_size=64,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
                **common,
            )
        )
    # the first layer dense (mlp_only_layers): two layer templates, dense and sparse
    elif arch == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(
                intermediate_size=64,
                moe_intermediate_size=32,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                mlp_only_layers=[0],
                **common,
            )
        )
    elif arch == "olmoe":  # q/k norms over the full projection width, clip_qkv
        model = tf.OlmoeForCausalLM(
            tf.OlmoeConfig(
                intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                clip_qkv=8.0,
                pad_token_id=0,
                eos_token_id=1,
                **common,
            )
        )
    # gpt-oss: attention sinks, sliding (window 4 < 10 tokens) and full layers alternating, biased
    # experts
    else:
        model = tf.GptOssForCausalLM(
            tf.GptOssConfig(
                intermediate_size=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                head_dim=16,
                sliding_window=4,
                pad_token_id=0,
                eos_token_id=1,
                **common,
            )
        )
        assert model.config.layer_types == ["sliding_attention", "full_attention"]

    def loss_fn(m, ids):
        out = m(input_ids=ids, labels=ids)
        assert out.aux_loss is not None and out.aux_loss.requires_grad
        return out.loss

    engine = _compare(model, loss_fn, _batches())
    # clipping fired (the last step's norm; the others' are too)
    assert engine.get_global_grad_norm() > CLIP
    if arch == "qwen3_moe":
        # dense first layer, sparse second: one template each
        assert engine.executor.template_of == [0, 1]


@pytest.mark.parametrize("arch", ["mixtral", "phimoe"])
def test_moe_router_jitter_noise_replayed_in_recompute(arch):
    """Router jitter draws random numbers in training mode outside any dropout module: the
    backward's recompute must draw the same ones (the forward's RNG state is replayed for every
    training forward), or the gradient is that of another routing. The loss seeds the RNG so the
    plain copy and the engine draw the same noise."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.1,
    )
    if arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common))
    else:  # Phi-3.5-MoE: sparsemixer routing, input jitter too
        model = tf.PhimoeForCausalLM(
            tf.PhimoeConfig(
                input_jitter_noise=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, **common
            )
        )

    def loss_fn(m, ids):
        torch.manual_seed(int(ids.sum()))  # the same draws for both at each step
        return m(input_ids=ids, labels=ids).loss

    # router logits off: the fused loss
    assert _compare(model, loss_fn, _batches())._fused is not None


def test_generate_before_training():
    """generate() builds a KV cache through the streamed layers; nothing of it may reach the
    training step."""

    def prepare(engine):
        with torch.no_grad():
            engine.module.eval()
            tokens = engine.module.generate(
                torch.tensor([[1, 2, 3]], device=engine.device), max_new_tokens=4, do_sample=False
            )
            engine.module.train()
        assert tokens.shape == (1, 7)

    _compare(tiny_hf("llama"), _logits_loss, _batches(), prepare=prepare)


class _SharedBlock(nn.Module):
    def __init__(self, width, shared):
        super().__init__()
        self.shared, self.own = shared, nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):  # (B, S, W)
        y = self.own(torch.tanh(self.shared(x)))
        return x + self.norm(y.transpose(1, 2)).transpose(1, 2)


class _SharedLM(PlainLM):
    """PlainLM whose blocks share one Linear (ALBERT-style) and hold BatchNorm statistics."""

    def __init__(self, vocab=32, width=32, depth=3):
        super().__init__(vocab, width, depth)
        shared = nn.Linear(width, width)
        self.blocks = nn.ModuleList(_SharedBlock(width, shared) for _ in range(depth))


def test_parameter_shared_across_layers_and_batchnorm_statistics():
    """A parameter used by every layer trains as in PyTorch (its gradient sums over the layers), and
    BatchNorm running statistics inside the streamed layers get one update per forward (not a second
    one from the recompute): equal to PyTorch's after 3 steps."""

    def loss_fn(m, ids):
        logits = m(ids)
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, 32), ids.to(logits.device)[:, 1:].reshape(-1)
        )

    model = _SharedLM()
    engine = _compare(model, loss_fn, _batches(vocab=32))
    want = {n: b for n, b in engine.reference.named_buffers()}
    got = dict(model.named_buffers())
    assert set(got) == set(want) and len(want) == 9
    for name, b in want.items():
        assert torch.allclose(got[name].cpu().double(), b.cpu().double(), rtol=1e-5, atol=1e-7), (
            name
        )
    assert [int(b.norm.num_batches_tracked) for b in model.blocks] == [STEPS] * 3


class _TiedInsideBlock(nn.Module):
    """A block whose two projections are one Parameter under two names (tied inside the layer,
    shared with no other layer): only functional_call's tie search binds the second name."""

    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width, bias=False)
        self.down.weight = self.up.weight

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class _TiedInsideLM(PlainLM):
    def __init__(self, vocab=32, width=32, depth=3):
        super().__init__(vocab, width, depth)
        self.blocks = nn.ModuleList(_TiedInsideBlock(width) for _ in range(depth))


def test_parameter_tied_inside_a_layer_and_the_tie_search_only_where_needed():
    """A weight registered twice inside one layer trains as in PyTorch (its gradient sums both
    uses): the executor keeps functional_call's tie search for that template. A decoder layer has no
    such tie, so its calls skip the search (a decode step's Python time): the flag is per template
    (model_map.has_tied_tensors)."""

    def loss_fn(m, ids):
        logits = m(ids)
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, 32), ids.to(logits.device)[:, 1:].reshape(-1)
        )

    engine = _compare(_TiedInsideLM(), loss_fn, _batches(vocab=32))
    assert engine.executor.tie_weights == [True]
    hf, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=_config())
    assert hf.executor.tie_weights == [False]


def test_fused_loss_logits_say_why_they_are_missing():
    """labels= on a causal LM: the loss is the model's, the logits were never formed, and using them
    raises an error that says so and how to get them (config fused_loss=false gives the model's own
    logits)."""
    model = tiny_hf("llama")
    want = copy.deepcopy(model).to(DEVICE)
    ids = _batches()[0]
    engine, *_ = megatrain_ds.initialize(model=model, config=_config())
    out = engine(input_ids=ids, labels=ids)
    assert out.loss.item() == pytest.approx(
        want(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE)).loss.item(), rel=1e-5
    )
    with pytest.raises(AttributeError, match="fused_loss"):
        out.logits.float()
    with pytest.raises(TypeError, match="fused_loss"):
        out.logits[:, -1]
    plain, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama"), config={**_config(), "megatrain": {"fused_loss": False}}
    )
    out = plain(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 10, 256)


@pytest.mark.parametrize("tied", [True, False])
def test_two_backwards_in_one_window_sum_the_resident_gradients(tied):
    """GA 1 with two backward() calls before step(): a resident parameter's first gradient, left in
    its landing buffer (resident.grad_of), goes to the fp32 home before the second lands; the step
    uses the sum, as PyTorch."""
    model = tiny_hf("qwen2", tied=tied, layers=2)
    ref = copy.deepcopy(model).to(DEVICE)
    engine, *_ = megatrain_ds.initialize(model=model, config=_config())
    a, b = _batches(n=2)
    for ids in (a, b):
        ref(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE)).loss.backward()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
    grads = engine_grads(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    resident = [names[id(p)] for p in engine.resident.params]
    floor = 0.01 * float(
        torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]).norm()
    )
    for name, p in ref.named_parameters():
        if name in resident:
            _close(grads[name], p.grad, f"grad of {name}", floor)
    assert not any(engine.resident.direct)  # folded: two gradients
    engine.step()
    engine.destroy()
