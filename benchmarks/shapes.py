"""Random-init model shapes (dense Qwen2.5, and two mixture-of-experts families) and the model-FLOPs
formulas shared by every benchmark.

The shapes themselves (``SHAPES``, ``MOE_SHAPES``, ``SHAPE_NAMES``, ``make_config``) are
megatrain_ds/planning/shapes.py's, re-exported here: built as ``transformers`` config objects
(``Qwen2Config``, ``OlmoeConfig``, ``Qwen2MoeConfig``); nothing is downloaded. The FLOPs formulas
(FLOP per trained token; s = tokens per sequence, L = decoder layers, h = hidden size; recompute is
never counted):

- Full fine-tuning, dense (the project anchors, unchanged): ``6 * N_matmul + 6 * L * h * s``, where
  N_matmul counts the weight matrices of every nn.Linear in the decoder layers (q, k, v, o, gate,
  up, down; biases excluded) plus vocab * hidden for the LM head. ``6 * L * h * s`` is the attention
  core with the causal mask already counted: per token and layer, Q K^T and A V over all s keys
  would be 2 * s * h FLOP each in the forward (4 * s * h), the causal mask halves that (2 * s * h),
  and the backward costs twice the forward (6 * s * h in all). At long context it dominates:
  Qwen2.5-3B at s = 524288 (512K) has 6 L h s = 2.3e11 FLOP/token against 6 N_matmul = 1.9e10 (no
  sliding window: these shapes attend over the whole sequence).
- Full fine-tuning, mixture of experts: ``6 * N_active + 6 * L * h * s``, where N_active counts the
  weights one token is multiplied with: per layer q, k, v, o, the router (experts * h: every token
  scores every expert), top-k experts' gate/up/down (k * 3 * h * moe_intermediate), the shared
  expert (3 * h * shared_intermediate) and its sigmoid gate (h) where the family has one
  (Qwen2-MoE), a dense MLP (3 * h * intermediate) in the layers that are not sparse; plus vocab *
  hidden for the LM head. For a dense model N_active = N_matmul.
- LoRA (frozen base, adapters trained): ``4 * N_active + 6 * N_lora + 6 * L * h * s``. The frozen
  base weights do a forward (2 FLOP per weight) and an input-gradient backward (2), no weight
  gradient; every adapter matrix (lora_A: in x r, lora_B: r x out) does forward, input gradient and
  weight gradient (6). N_lora = sum over the adapted linears of r * (in + out). The attention core
  (Q K^T and A V) holds no weights, so its backward is input gradients only in both cases and costs
  twice its forward either way: the term stays 6 * L * h * s (causal), as for full fine-tuning. The
  LM head is frozen (4 * vocab * h).
"""

from __future__ import annotations

import torch.nn as nn

# The shapes registry lives in the package (megatrain-ds plan resolves shape names without
# benchmarks/): re-exported
from megatrain_ds.planning.shapes import (  # noqa: F401
    MOE_CONFIGS,
    MOE_SHAPES,
    SHAPE_NAMES,
    SHAPES,
    make_config,
)

# The linears peft's LoRA adapts by default in the harness (h2h --lora R); "all-linear" is peft's
# own choice
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_moe(config) -> bool:
    return int(getattr(config, "num_experts", 0) or 0) > 0


def _attention_params(config) -> int:
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = h * config.num_attention_heads * head_dim
    kv = 2 * h * config.num_key_value_heads * head_dim
    o = config.num_attention_heads * head_dim * h
    return q + kv + o


def _sparse_layer(config, i: int) -> bool:
    """Layer ``i`` holds experts (Qwen2-MoE can interleave dense layers: decoder_sparse_step,
    mlp_only_layers)."""
    if not is_moe(config):
        return False
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return i not in (getattr(config, "mlp_only_layers", None) or []) and (i + 1) % step == 0


def _mlp_params(config, i: int, active: bool) -> int:
    """Matmul weights of layer ``i``'s MLP block: all of them, or those one token multiplies with
    (``active``)."""
    h = config.hidden_size
    if not _sparse_layer(config, i):
        return 3 * h * config.intermediate_size
    experts = int(config.num_experts)
    used = int(config.num_experts_per_tok) if active else experts
    expert_inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    out = experts * h + used * 3 * h * expert_inter  # router + experts
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    if shared:
        out += 3 * h * shared + h  # shared expert + its sigmoid gate (Linear(h, 1))
    return out


def matmul_params(config) -> int:
    """Analytic matmul weights (count): every decoder-layer linear / expert / router weight +
    vocab * hidden for the LM head. Dense: the anchors' N_matmul. MoE: all experts (see
    :func:`active_matmul_params` for FLOPs)."""
    layers = sum(
        _attention_params(config) + _mlp_params(config, i, active=False)
        for i in range(config.num_hidden_layers)
    )
    return layers + config.vocab_size * config.hidden_size


def active_matmul_params(config) -> int:
    """Analytic N_active (count): the matmul weights one token is multiplied with (top-k experts
    only); equals :func:`matmul_params` for a dense model."""
    layers = sum(
        _attention_params(config) + _mlp_params(config, i, active=True)
        for i in range(config.num_hidden_layers)
    )
    return layers + config.vocab_size * config.hidden_size


def lora_params(config, r: int, targets=LORA_TARGETS) -> int:
    """Analytic N_lora (count) for rank ``r`` adapters on the linears named ``targets`` of a dense
    Qwen2 layer: r * (in + out) per adapted linear, every layer."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    dims = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    return config.num_hidden_layers * sum(r * sum(dims[t]) for t in targets)


def _matmul_counts(model: nn.Module) -> tuple[float, float]:
    """(all, active) matmul weights counted from a built model's decoder layers + vocab * hidden;
    adapters (peft ``lora_*`` modules) left out. nn.Linear weights; 3-D expert weights (a
    ``*Experts`` module: all, and the top-k share of them); router weights (a ``*Router`` module).
    ZeRO-3 partitioned weights count by ``ds_shape``."""
    config = model.config
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    total = active = 0.0
    for name, module in base.model.layers.named_modules():
        if "lora_" in name:
            continue
        kind = type(module).__name__
        if isinstance(module, nn.Linear) or kind.endswith("Router"):
            shape = getattr(module.weight, "ds_shape", None) or module.weight.shape
            n = int(shape[0]) * int(shape[1])
            total, active = total + n, active + n
        elif kind.endswith("Experts"):
            share = int(config.num_experts_per_tok) / int(config.num_experts)
            for p in module.parameters(recurse=False):
                n = 1
                for d in getattr(p, "ds_shape", None) or p.shape:
                    n *= int(d)
                total, active = total + n, active + n * share
    head = config.vocab_size * config.hidden_size
    return total + head, active + head


def count_matmul_params(model: nn.Module) -> int:
    """N_matmul counted from a built model (all experts of an MoE); see :func:`_matmul_counts`.
    Works on ZeRO-3 partitioned and peft-wrapped models."""
    return int(round(_matmul_counts(model)[0]))


def count_active_matmul_params(model: nn.Module) -> int:
    """N_active counted from a built model (top-k experts); see :func:`_matmul_counts`."""
    return int(round(_matmul_counts(model)[1]))


def model_flops_per_token(config, seq: int, lora_params: int | None = None) -> float:
    """Model FLOPs per trained token (FLOP/token), see the module docstring: full fine-tuning 6 *
    N_active + 6 * L * h * seq (dense: N_active = N_matmul); LoRA (``lora_params`` = N_lora, the
    trainable adapter count) 4 * N_active + 6 * N_lora + 6 * L * h * seq."""
    attention = 6.0 * config.num_hidden_layers * config.hidden_size * seq
    if lora_params is None:
        return 6.0 * active_matmul_params(config) + attention
    return 4.0 * active_matmul_params(config) + 6.0 * int(lora_params) + attention


def recompute_flops_per_token(config, seq: int, recomputed: int, skip_down_proj: bool) -> float:
    """The FLOPs per token a step spends recomputing the forwards of ``recomputed`` decoder layers,
    which :func:`model_flops_per_token` does not count: each layer's forward share of the formula
    (2 * its matmul weights + 2 * h * seq), less the MLP's output projection (2 * h * intermediate)
    where the recompute skips it (megatrain_ds's ``skip_recompute_down_proj``). Dense layers
    (an MoE's active weights averaged over its layers)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    per_layer = (active_matmul_params(config) - config.vocab_size * h) / layers
    forward = 2.0 * per_layer + 2.0 * h * seq
    if skip_down_proj:
        forward -= 2.0 * h * config.intermediate_size
    return recomputed * forward


def tflops(config, seq: int, tokens_per_s: float, lora_params: int | None = None) -> float:
    """Model TFLOPS (1e12 FLOP/s) at ``tokens_per_s`` tokens per second."""
    return model_flops_per_token(config, seq, lora_params) * tokens_per_s / 1e12


def meta_model(config) -> nn.Module:
    """The model of ``config`` built on the meta device (no storage): for counting."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def n_params(config) -> int:
    """Parameters (count) of the model of ``config`` (tied weights once)."""
    return sum(p.numel() for p in meta_model(config).parameters())


def layer_params(config, i: int = 0) -> int:
    """Parameters (count) of decoder layer ``i`` of ``config`` (built on the meta device)."""
    return sum(p.numel() for p in meta_model(config).model.layers[i].parameters())


def self_check(
    names: tuple[str, ...] = ("tiny", "tiny-moe", "tiny-olmoe"), layers: int = 2
) -> None:
    """Build each shape (depth ``layers``) on the meta device and assert analytic == counted
    N_matmul and N_active."""
    for name in names:
        config = make_config(name, layers=layers)
        model = meta_model(config)
        counted, analytic = count_matmul_params(model), matmul_params(config)
        assert counted == analytic, f"{name}: counted {counted} != analytic {analytic}"
        counted, analytic = count_active_matmul_params(model), active_matmul_params(config)
        assert counted == analytic, f"{name}: counted active {counted} != analytic {analytic}"


if __name__ == "__main__":
    self_check(tuple(SHAPE_NAMES))
    for shape_name in SHAPE_NAMES:
        cfg = make_config(shape_name)
        print(
            f"{shape_name:18s} N_matmul={matmul_params(cfg) / 1e6:11.3f} M  N_active="
            f"{active_matmul_params(cfg) / 1e6:11.3f} M  flops/token@1024="
            f"{model_flops_per_token(cfg, 1024) / 1e9:10.4f} GFLOP"
        )
