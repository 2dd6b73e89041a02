"""The named model shapes: random-init ``transformers`` configs (dense Qwen2.5, and two
mixture-of-experts families) that ``megatrain-ds plan MODEL`` resolves by name (``qwen2.5-7b``,
``tiny``, ``olmoe-1b-7b``, ...) and the benchmark harness builds its models from
(benchmarks/shapes.py re-exports this registry and adds the model-FLOPs formulas).

Shapes are built as config objects (``Qwen2Config``, ``OlmoeConfig``, ``Qwen2MoeConfig``); nothing
is downloaded. This module is the registry's one owner: the package never imports ``benchmarks``
(the harness ships with the repository only), so a shape name resolves wherever megatrain_ds is
installed.
"""

from __future__ import annotations

from transformers import OlmoeConfig, PretrainedConfig, Qwen2Config, Qwen2MoeConfig

# Dense Qwen2.5: name -> (hidden, layers, intermediate, heads, kv_heads, vocab, tied embeddings)
SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "tiny": (64, 2, 128, 4, 2, 256, True),
    "qwen2.5-1.5b": (1536, 28, 8960, 12, 2, 151936, True),
    "qwen2.5-3b": (2048, 36, 11008, 16, 2, 151936, True),
    "qwen2.5-7b": (3584, 28, 18944, 28, 4, 152064, False),
    "qwen2.5-14b": (5120, 48, 13824, 40, 8, 152064, False),
    "qwen2.5-32b": (5120, 64, 27648, 40, 8, 152064, False),
    "qwen2.5-72b": (8192, 80, 29568, 64, 8, 152064, False),
}

# Mixture of experts: name -> (model_type, config kwargs). Untied embeddings, as the released
# models. Parameters (all / active per token): olmoe-1b-7b 6.92 B / 1.28 B; qwen1.5-moe-a2.7b 14.3 B
# / 2.7 B.
MOE_SHAPES: dict[str, tuple[str, dict]] = {
    "tiny-moe": (
        "qwen2_moe",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
    ),
    "tiny-olmoe": (
        "olmoe",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            eos_token_id=None,
        ),
    ),
    "olmoe-1b-7b": (
        "olmoe",
        dict(
            hidden_size=2048,
            num_hidden_layers=16,
            intermediate_size=1024,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=50304,
            num_experts=64,
            num_experts_per_tok=8,
        ),
    ),
    "qwen1.5-moe-a2.7b": (
        "qwen2_moe",
        dict(
            hidden_size=2048,
            num_hidden_layers=24,
            intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=151936,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
        ),
    ),
}
MOE_CONFIGS = {"olmoe": OlmoeConfig, "qwen2_moe": Qwen2MoeConfig}
SHAPE_NAMES: list[str] = [*SHAPES, *MOE_SHAPES]


def make_config(name: str, layers: int | None = None) -> PretrainedConfig:
    """The config of shape ``name`` (Qwen2Config, OlmoeConfig or Qwen2MoeConfig); ``layers`` (count)
    overrides the depth if given. MoE configs have ``output_router_logits=True``: the router's
    load-balancing loss (times the family's ``router_aux_loss_coef``: OLMoE 0.01, Qwen2-MoE 0.001)
    is part of the training loss of every system."""
    if name in MOE_SHAPES:
        model_type, kwargs = MOE_SHAPES[name]
        kwargs = dict(kwargs)
        if layers is not None:
            kwargs["num_hidden_layers"] = int(layers)
        config = MOE_CONFIGS[model_type](
            **kwargs,
            max_position_embeddings=32768,
            use_cache=False,
            output_router_logits=True,
            attn_implementation="sdpa",
        )
        config._attn_implementation = "sdpa"
        config.name_or_path = name
        return config
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPE_NAMES)}")
    hidden, depth, inter, heads, kv_heads, vocab, tied = SHAPES[name]
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=depth if layers is None else int(layers),
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
        use_cache=False,
        attn_implementation="sdpa",
    )
    config._attn_implementation = "sdpa"
    config.name_or_path = name
    return config
