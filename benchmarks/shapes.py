"""Random-init Qwen2.5 model shapes and the model-FLOPs formula shared by every benchmark.

Shapes are built as ``transformers.Qwen2Config`` objects; nothing is downloaded. The FLOPs
formula follows the project anchors: flops/token = 6 * N_matmul + 6 * L * h * s, where N_matmul
counts the weight matrices of every nn.Linear in the decoder layers (q, k, v, o, gate, up, down;
biases excluded) plus vocab * hidden for the LM head. Recompute is not counted.
"""
from __future__ import annotations

import torch.nn as nn
from transformers import Qwen2Config

# name -> (hidden, layers, intermediate, heads, kv_heads, vocab, tied embeddings)
SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "tiny": (64, 2, 128, 4, 2, 256, True),
    "qwen2.5-1.5b": (1536, 28, 8960, 12, 2, 151936, True),
    "qwen2.5-3b": (2048, 36, 11008, 16, 2, 151936, True),
    "qwen2.5-7b": (3584, 28, 18944, 28, 4, 152064, False),
    "qwen2.5-14b": (5120, 48, 13824, 40, 8, 152064, False),
    "qwen2.5-32b": (5120, 64, 27648, 40, 8, 152064, False),
    "qwen2.5-72b": (8192, 80, 29568, 64, 8, 152064, False),
}


def make_config(name: str, layers: int | None = None) -> Qwen2Config:
    """Return a Qwen2Config for shape ``name``; ``layers`` (count) overrides the depth if given."""
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
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


def matmul_params(config: Qwen2Config) -> int:
    """Analytic N_matmul (parameter count): decoder nn.Linear weights + vocab * hidden for the LM head."""
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = h * config.num_attention_heads * head_dim
    kv = 2 * h * config.num_key_value_heads * head_dim
    o = config.num_attention_heads * head_dim * h
    mlp = 3 * h * config.intermediate_size
    return config.num_hidden_layers * (q + kv + o + mlp) + config.vocab_size * h


def count_matmul_params(model: nn.Module) -> int:
    """N_matmul counted from a built model: nn.Linear weights inside model.model.layers + vocab * hidden.

    Works on ZeRO-3 partitioned models too (uses ``ds_shape`` when a weight is partitioned).
    """
    total = 0
    for module in model.model.layers.modules():
        if isinstance(module, nn.Linear):
            w = module.weight
            shape = getattr(w, "ds_shape", None) or w.shape
            total += int(shape[0]) * int(shape[1])
    config = model.config
    return total + config.vocab_size * config.hidden_size


def model_flops_per_token(config: Qwen2Config, seq: int) -> float:
    """Model FLOPs per trained token (FLOP/token): 6 * N_matmul + 6 * L * h * seq."""
    return 6.0 * matmul_params(config) + 6.0 * config.num_hidden_layers * config.hidden_size * seq


def tflops(config: Qwen2Config, seq: int, tokens_per_s: float) -> float:
    """Model TFLOPS (1e12 FLOP/s) at ``tokens_per_s`` tokens per second."""
    return model_flops_per_token(config, seq) * tokens_per_s / 1e12


def self_check(names: tuple[str, ...] = ("tiny",), layers: int = 2) -> None:
    """Build each shape (depth ``layers``) on the meta device and assert analytic == counted N_matmul."""
    import torch
    from transformers import Qwen2ForCausalLM

    for name in names:
        config = make_config(name, layers=layers)
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        counted, analytic = count_matmul_params(model), matmul_params(config)
        assert counted == analytic, f"{name}: counted {counted} != analytic {analytic}"


if __name__ == "__main__":
    self_check(tuple(SHAPES))
    for shape_name in SHAPES:
        cfg = make_config(shape_name)
        print(f"{shape_name:14s} N_matmul={matmul_params(cfg) / 1e6:11.3f} M  "
              f"flops/token@1024={model_flops_per_token(cfg, 1024) / 1e9:10.4f} GFLOP")
