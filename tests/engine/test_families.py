"""Every model family people fine-tune trains through megatrain_ds exactly like plain PyTorch (fp32,
CPU), or is refused at ``megatrain_ds.initialize`` with an UnsupportedModelError that says why.

One tiny random-init model per family (hidden 64, 2-4 layers, vocab 256), compared with ``_compare``
(tests/engine/test_paths.py): the loss, every gradient of every step and the weights after each of 3
AdamW steps with clipping, within 1e-5. Sequences are 24 tokens and sliding windows 8, so windowed
attention differs from full attention (test_configured_features_matter); layers of one family that
differ only in scalar attributes (sliding window, attention type) share one template and get their
own values overlaid (model_map.per_layer_attributes); layer lists mixing classes or parameter shapes
(hybrids, dense + MoE) get one template per (class, parameter signature). Families whose blocks take
a second input needing a gradient are refused (test_refused_at_initialize). MoE router tests live in
tests/engine/test_paths.py. docs/families.md lists the results.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megatrain_ds
from tests.engine.test_paths import _batches, _compare, _logits_loss

tf = pytest.importorskip("transformers")

SEQ, WINDOW = 24, 8


def _seq_batches(vocab: int = 256):
    return _batches(vocab=vocab, shape=(2, SEQ))


def _labels_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


def _decoder_common(**extra) -> dict:
    return {
        **dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        **extra,
    }


def _build(cls, config):
    """``cls(config)`` with seed 0, then every all-zero parameter (biases, Gemma's norm offsets)
    drawn small and nonzero, as in a pretrained checkpoint. A key-projection bias has an
    exactly-zero gradient (softmax is shift-invariant): from zero, Adam's first update of it is lr x
    sign(rounding noise), which no two implementations share; from a nonzero start that update is
    rounding-sized relative to the weight."""
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.02)
    return model


# --- decoder-only causal LMs ----------------------------------------------------------------------


def _llama3():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return _build(tf.LlamaForCausalLM, tf.LlamaConfig(rope_scaling=rope, **_decoder_common()))


def _qwen2():
    return _build(tf.Qwen2ForCausalLM, tf.Qwen2Config(**_decoder_common()))


def _qwen3():
    return _build(tf.Qwen3ForCausalLM, tf.Qwen3Config(head_dim=16, **_decoder_common()))


def _mistral():
    return _build(
        tf.MistralForCausalLM, tf.MistralConfig(sliding_window=WINDOW, **_decoder_common())
    )


def _gemma2(attn_cap: float | None = 2.0, final_cap: float | None = 1.0):
    """Soft-caps far below Gemma 2's 50 / 30 and larger query/key weights: at this size and init,
    scores and logits are ~0.1 and tanh-capping at 50 / 30 would be the identity to 1e-5
    (test_configured_features_matter)."""
    cfg = tf.Gemma2Config(
        head_dim=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
        query_pre_attn_scalar=16,
        **_decoder_common(num_hidden_layers=3),
    )
    # eager attention, as Hugging Face advises for Gemma 2 training: SDPA drops the attention
    # soft-cap (some transformers versions pick SDPA by default: then the cap changes nothing, in
    # the engine or in plain PyTorch)
    cfg._attn_implementation = "eager"
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    model = _build(tf.Gemma2ForCausalLM, cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
            layer.self_attn.k_proj.weight.mul_(10.0)
    return model


def _gemma3():
    cfg = tf.Gemma3TextConfig(
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        **_decoder_common(num_hidden_layers=3),
    )
    return _build(tf.Gemma3ForCausalLM, cfg)


_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary


def _phi3():
    # Phi-4 (phi-4, Phi-4-mini) is Phi3ForCausalLM too: this case covers it. Fused qkv_proj /
    # gate_up_proj.
    return _build(tf.Phi3ForCausalLM, tf.Phi3Config(**_TOKENS, **_decoder_common()))


def _olmo2():
    return _build(tf.Olmo2ForCausalLM, tf.Olmo2Config(**_TOKENS, **_decoder_common()))


def _gpt_neox():  # Pythia: parallel residual, rotary on a quarter of each head
    cfg = tf.GPTNeoXConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        **_TOKENS,
    )
    assert cfg.use_parallel_residual
    return _build(tf.GPTNeoXForCausalLM, cfg)


def _falcon(**variant):
    cfg = tf.FalconConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        **_TOKENS,
        **variant,
    )
    return _build(tf.FalconForCausalLM, cfg)


# IBM Granite 3.x: muP-style multipliers, logits divided by logits_scaling in the head
def _granite():
    cfg = tf.GraniteConfig(
        logits_scaling=4.0,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        **_TOKENS,
        **_decoder_common(),
    )
    return _build(tf.GraniteForCausalLM, cfg)


# Command-R(+): parallel attention + MLP, LayerNorm, q/k norms, logits times logit_scale
def _cohere():
    cfg = tf.CohereConfig(logit_scale=0.5, use_qk_norm=True, **_TOKENS, **_decoder_common())
    return _build(tf.CohereForCausalLM, cfg)


# Mamba-2 + attention layers (one class, different mixers: two templates); a z-loss in the loss
def _bamba():
    cfg = tf.BambaConfig(
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_chunk_size=8,
        z_loss_coefficient=0.1,
        **_TOKENS,
        **_decoder_common(num_hidden_layers=3),
    )
    return _build(tf.BambaForCausalLM, cfg)


# attention and Mamba-2 side by side in every layer; logits times lm_head_multiplier
def _falcon_h1():
    cfg = tf.FalconH1Config(
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_chunk_size=8,
        mamba_d_ssm=None,
        lm_head_multiplier=0.5,
        **_TOKENS,
        **_decoder_common(),
    )
    return _build(tf.FalconH1ForCausalLM, cfg)


# multi-head latent attention (q/kv LoRA ranks), a dense first layer, routed + shared experts
def _deepseek_v3():
    cfg = tf.DeepseekV3Config(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        **_TOKENS,
        **_decoder_common(num_key_value_heads=4),
    )
    return _build(tf.DeepseekV3ForCausalLM, cfg)


# gated DeltaNet linear-attention layers and gated full-attention layers, MoE MLPs
def _qwen3_next():
    cfg = tf.Qwen3NextConfig(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        **_TOKENS,
        **_decoder_common(),
    )
    return _build(tf.Qwen3NextForCausalLM, cfg)


def _llama4_text():  # MoE with a shared expert, chunked-free text stack, q/k L2 norm
    cfg = tf.Llama4TextConfig(
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
        head_dim=16,
        interleave_moe_layer_step=1,
        **_TOKENS,
        **_decoder_common(),
    )
    return _build(tf.Llama4ForCausalLM, cfg)


CAUSAL = {
    "llama3": _llama3,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral_sliding_window": _mistral,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "gpt_neox": _gpt_neox,
    # FalconConfig's defaults (Falcon-7B: multi-query, parallel attention + MLP, rotary)
    "falcon": _falcon,
    # Falcon-40B/180B: new_decoder_architecture (grouped KV heads, two layer norms)
    "falcon_new_decoder_architecture": lambda: _falcon(
        new_decoder_architecture=True, num_kv_heads=2
    ),
    # Falcon-RW: ALiBi position bias instead of rotary, sequential residual
    "falcon_alibi": lambda: _falcon(alibi=True, parallel_attn=False, multi_query=False, bias=True),
    "granite": _granite,
    "cohere": _cohere,
    # hybrid SSM families (the Mamba paths are the reference PyTorch scans: no CUDA kernels needed)
    "bamba": _bamba,
    "falcon_h1": _falcon_h1,
    "deepseek_v3": _deepseek_v3,
    "qwen3_next": _qwen3_next,
    "llama4_text": _llama4_text,
}
# whose head does more than a matmul (soft-capping, logit scales) or whose loss adds a term (Bamba's
# z-loss): labels= runs the model's own forward, not the engine's fused head + cross-entropy
# (model_map.plain_lm_head reads it from the forward's source) (Llama4ForCausalLM: its
# base_model_prefix, "language_model", names no submodule of it)
NOT_FUSED = {"gemma2", "granite", "cohere", "bamba", "falcon_h1", "llama4_text"}
# layer lists with more than one template (class or parameter signature differs); the others share
# one
TEMPLATES = {"bamba": [0, 1, 0], "deepseek_v3": [0, 1], "qwen3_next": [0, 1]}


@pytest.mark.parametrize("family", list(CAUSAL))
def test_causal_lm_labels_loss(family):
    """The model's own labels loss (the engine's fused head + cross-entropy where it applies)."""
    engine = _compare(CAUSAL[family](), _labels_loss, _seq_batches())
    assert (engine._fused is None) == (family in NOT_FUSED)
    assert engine.executor.template_of == TEMPLATES.get(
        family, [0] * len(engine.executor.template_of)
    )


def test_fused_loss_follows_the_configured_head():
    """The fused head + cross-entropy is used exactly when the model's forward, with this config, is
    head matmul -> Hugging Face's causal-LM loss: a branch the config switches off does not count
    (Gemma 2 without soft-capping, Bamba without z-loss), one it switches on does (a cap of 1.0 is a
    cap)."""
    from megatrain_ds.model.model_map import plain_lm_head

    def why(model):
        return plain_lm_head(model, "lm_head", model.base_model_prefix)

    assert why(_gemma2(attn_cap=None, final_cap=None)) is None
    assert "changes the logits" in why(_gemma2(final_cap=1.0))
    bamba = _bamba()
    assert "loss other than" in why(bamba)
    bamba.z_loss_coefficient = 0.0
    assert why(bamba) is None
    # logits = lm_head(h) * lm_head_multiplier
    assert "not self.lm_head(hidden_states)" in why(_falcon_h1())
    assert why(_llama3()) is None and why(CAUSAL["gemma3_text"]()) is None


WINDOWED = ["gemma2", "gemma3_text", "mistral_sliding_window"]


def test_configured_features_matter():
    """Plain PyTorch only: what the family tests configure changes the output at this size, so
    matching it is evidence the engine runs it (sliding windows shorter than the sequence, Gemma 2's
    soft-capping)."""
    ids = _seq_batches()[0]

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits

    for family in WINDOWED:
        model = CAUSAL[family]()
        windowed = logits(model)
        model.config.sliding_window = 10 * SEQ
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sliding_window", None) is not None:
                layer.self_attn.sliding_window = 10 * SEQ
        assert (logits(model) - windowed).abs().max() > 1e-2, family
    capped = logits(_gemma2())
    assert (logits(_gemma2(attn_cap=None)) - capped).abs().max() > 1e-2
    assert (logits(_gemma2(final_cap=None)) - capped).abs().max() > 1e-2


@pytest.mark.parametrize("family", WINDOWED)
def test_causal_lm_loss_from_logits(family):
    """The model's own forward, logits and all (Gemma 2's final soft-capping sits in the head)."""
    _compare(CAUSAL[family](), _logits_loss, _seq_batches())


@pytest.mark.parametrize("family", WINDOWED)
def test_windowed_layers_keep_their_own_window(family):
    """Layers that share one template but differ in window (Gemma 2/3: sliding and global layers)
    run with their own ``sliding_window`` / ``layer_idx``: greedy generation past the window (the KV
    cache keeps a window-sized cache for sliding layers, indexed by ``layer_idx``) equals the plain
    model's, token for token. Without the per-layer overlay Gemma 2 fails here with a mask/key
    length mismatch (the issue's report)."""
    model = CAUSAL[family]()
    plain = copy.deepcopy(model).eval()
    engine, *_ = megatrain_ds.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1})
    assert engine.module.config.sliding_window == WINDOW
    if family != "mistral_sliding_window":  # every Mistral layer is windowed (from the config)
        assert {layer.self_attn.sliding_window for layer in engine.module.model.layers} == {
            WINDOW,
            None,
        }
    prompt = _seq_batches()[0][:, : SEQ // 2]
    with torch.no_grad():
        engine.module.eval()
        got = engine.module.generate(
            prompt, max_new_tokens=WINDOW, do_sample=False, min_new_tokens=WINDOW
        )
        want = plain.generate(prompt, max_new_tokens=WINDOW, do_sample=False, min_new_tokens=WINDOW)
    assert got.shape == (2, SEQ // 2 + WINDOW) and torch.equal(got.cpu(), want)


# --- encoder-only ---------------------------------------------------------------------------------

_ENCODER = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_labels=3,
)

ENCODERS = {
    "bert": lambda: _build(
        tf.BertForSequenceClassification,
        tf.BertConfig(
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
            **_ENCODER,
        ),
    ),
    "roberta": lambda: _build(
        tf.RobertaForSequenceClassification,
        tf.RobertaConfig(
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
            pad_token_id=0,
            **_ENCODER,
        ),
    ),
    # ModernBERT: local (window 8 < 24 tokens) and global attention layers alternating, local rope
    # theta
    "modernbert": lambda: _build(
        tf.ModernBertForSequenceClassification,
        tf.ModernBertConfig(
            local_attention=WINDOW,
            global_attn_every_n_layers=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            **{**_ENCODER, "num_hidden_layers": 3},
        ),
    ),
}


@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoder_sequence_classification(family):
    """Encoder-only with a classification head: the labels loss, a padded row (the mask reaches
    every layer)."""
    labels = [torch.tensor([0, 2]), torch.tensor([1, 1]), torch.tensor([2, 0])]
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, SEQ - 5 :] = 0
    batches = [(ids.clamp_min(3), mask, y) for ids, y in zip(_seq_batches(), labels)]
    _compare(
        ENCODERS[family](),
        lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss,
        batches,
    )


# MoE families (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, Phi-3.5-MoE): router aux loss and router
# jitter tests are in tests/engine/test_paths.py (test_moe_router_aux_loss,
# test_moe_router_jitter_noise_replayed_in_recompute)

# --- a hybrid layer list: two block classes in one ModuleList -------------------------------------


class _AttnBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        causal = torch.triu(
            torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1
        )
        return x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]


class _MixerBlock(nn.Module):
    """A recurrent-ish mixer (different parameter shapes from _AttnBlock): a causal depthwise
    convolution and a gated MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.conv = nn.Conv1d(width, width, 4, groups=width, padding=3)
        self.gate = nn.Linear(width, 3 * width)
        self.out = nn.Linear(3 * width, width, bias=False)

    def forward(self, x):
        h = self.conv(self.norm(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.out(F.silu(self.gate(h)))


class _HybridLM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            _AttnBlock(width) if i % 2 else _MixerBlock(width) for i in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_hybrid_layer_list_two_block_classes():
    def loss_fn(m, ids):
        logits = m(ids)
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, 256), ids.to(logits.device)[:, 1:].reshape(-1)
        )

    engine = _compare(_build(_HybridLM, 256), loss_fn, _seq_batches())
    ex = engine.executor
    # one template per (class, signature)
    assert len(ex.templates) == 2 and ex.template_of == [0, 1, 0, 1]


def test_jamba_hybrid_mamba_and_attention_layers():
    """A Hugging Face hybrid: Jamba's layer list alternates Mamba and attention decoder layers (the
    Mamba path is the reference PyTorch scan; no CUDA kernels)."""
    cfg = tf.JambaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
        **_TOKENS,
    )
    engine = _compare(_build(tf.JambaForCausalLM, cfg), _labels_loss, _seq_batches())
    assert engine.executor.template_of == [0, 1, 0, 1] and engine._fused is not None


# --- refused at initialize ------------------------------------------------------------------------


def _t5():
    return _build(
        tf.T5ForConditionalGeneration,
        tf.T5Config(
            vocab_size=256,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        ),
    )


def _bart():
    return _build(
        tf.BartForConditionalGeneration,
        tf.BartConfig(
            vocab_size=256,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            dropout=0.0,
            max_position_embeddings=64,
        ),
    )


def _t5_encoder():
    return _build(
        tf.T5EncoderModel,
        tf.T5Config(
            vocab_size=256,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
        ),
    )


def _deberta_v3():  # DeBERTa-v3 checkpoints are DebertaV2 with relative_attention on
    return _build(
        tf.DebertaV2ForSequenceClassification,
        tf.DebertaV2Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=64,
            relative_attention=True,
            position_buckets=16,
            pos_att_type=["p2c", "c2p"],
        ),
    )


REFUSED = {  # family: (builder, what the message says, a training step of it)
    "t5": (_t5, "encoder-decoder", lambda m, ids: m(input_ids=ids, labels=ids.flip(1)).loss),
    "bart": (_bart, "encoder-decoder", lambda m, ids: m(input_ids=ids, labels=ids.flip(1)).loss),
    "t5_encoder": (
        _t5_encoder,
        "relative position bias",
        lambda m, ids: m(input_ids=ids).last_hidden_state.mean(),
    ),
    "deberta_v3": (
        _deberta_v3,
        "relative position embeddings",
        lambda m, ids: m(input_ids=ids.clamp_min(3), labels=torch.tensor([0, 2])).loss,
    ),
}


@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_at_initialize(family, monkeypatch):
    """Blocks that take a second input needing a gradient (the encoder's output, a bias or
    embeddings computed from trainable parameters outside the block) are refused at initialize with
    the reason, not at the first forward. Without the refusal the first training forward fails (so
    the refusal is not hiding a working model); a frozen copy (inference, a DPO-style reference) is
    accepted."""
    build, why, step = REFUSED[family]
    with pytest.raises(megatrain_ds.UnsupportedModelError, match=why):
        megatrain_ds.initialize(model=build(), config={"train_micro_batch_size_per_gpu": 2})
    frozen = build().requires_grad_(False)
    megatrain_ds.initialize(model=frozen, config={"train_micro_batch_size_per_gpu": 2})
    monkeypatch.setattr(
        megatrain_ds.model.model_map, "refuse_known_unsupported", lambda model: None
    )
    engine, *_ = megatrain_ds.initialize(
        model=build(), config={"train_micro_batch_size_per_gpu": 2}
    )
    with pytest.raises(NotImplementedError, match="extra tensor argument that requires grad"):
        engine.backward(step(engine, _seq_batches()[0]))
