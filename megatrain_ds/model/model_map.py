"""How a model splits into streamed decoder layers and small resident parts.

The streamed part is the repeated block list (``model.model.layers`` for Llama/Qwen/Mistral,
``model.transformer.h`` for GPT-2, or any ``nn.ModuleList`` of blocks in a plain module). Everything
else (embeddings, final norm, LM head, rotary tables) is *resident*: small, kept on the device in
the compute dtype, with fp32 master state on the host like the layers.

Each layer's parameters are laid out in one flat buffer: trainable parameters first, grouped by
optimizer param group (so each group is a contiguous segment the fused optimizer can step), then
frozen ones. Layers with the same structure share one stateless *template*: a copy of the first such
layer whose parameters live on the meta device (no storage) and are supplied per call as views of a
device slot.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """The engine cannot stream this model; the message says why and what it looked for."""


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter of a layer lives inside the layer's flat buffer."""

    name: str  # name relative to the layer, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # element offset inside the trainable or frozen region
    numel: int
    trainable: bool
    group: int  # optimizer param-group index (-1 when frozen)


@dataclass(slots=True)
class LayerLayout:
    """Flat layout of one streamed layer: [trainable (by group) | frozen]."""

    index: int
    slots: list[ParamSlot]
    n_train: int  # elements in the trainable region
    n_frozen: int
    # (group, start, end) in trainable
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    # names of parameters shared with another layer or the rest of the model (or tied inside this
    # layer): resident, not in the flat buffer; bound by the executor from the model's own parameter
    shared: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return self.n_train + self.n_frozen

    def signature(self) -> tuple:
        return tuple((s.name, s.shape, s.trainable) for s in self.slots)


_TAKES_TRAINABLE_INPUT = (
    "megatrain_ds propagates gradients only through a streamed block's hidden states, so a block "
    "input that needs "
    "a gradient of its own cannot be trained exactly"
)


def refuse_known_unsupported(model: nn.Module) -> None:
    """Refuse (UnsupportedModelError) the Hugging Face families whose blocks take a second input
    that needs a gradient, instead of failing at the first training forward. A model with no
    trainable parameter (a frozen reference, inference) passes: nothing needs those gradients. What
    is known (docs/families.md):

    * encoder-decoder models (``config.is_encoder_decoder``: T5, BART, mBART, Pegasus, Marian,
      Whisper, ...): every decoder block cross-attends to the encoder's output;
    * T5-style stacks (t5, mt5, longt5, switch_transformers; T5EncoderModel too): the first block
      computes the relative position bias from its own trainable table and passes it to every later
      block;
    * DeBERTa / DeBERTa-v2/v3 with ``relative_attention``: the encoder's trainable relative-position
      embeddings go into every block.
    """
    if not any(p.requires_grad for p in model.parameters()):
        return
    config = getattr(model, "config", None)
    name = type(model).__name__
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model (config.is_encoder_decoder): each decoder block "
            "cross-attends to "
            f"the encoder's output, an input that needs a gradient; {_TAKES_TRAINABLE_INPUT}. "
            "Decoder-only and "
            "encoder-only models are supported (docs/families.md)"
        )
    if model_type in ("t5", "mt5", "longt5", "switch_transformers"):
        raise UnsupportedModelError(
            f"{name} ({model_type}): the first block computes the relative position bias from its "
            "trainable "
            f"relative_attention_bias table and every later block takes that bias as an input; "
            f"{_TAKES_TRAINABLE_INPUT} (docs/families.md)"
        )
    if model_type in ("deberta", "deberta-v2") and getattr(config, "relative_attention", False):
        raise UnsupportedModelError(
            f"{name} ({model_type}, relative_attention=True): every block takes the encoder's "
            "trainable relative "
            f"position embeddings (encoder.rel_embeddings) as an input; {_TAKES_TRAINABLE_INPUT} "
            "(docs/families.md)"
        )


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return the qualified name and the ModuleList holding the model's repeated blocks.

    The block list is the ``nn.ModuleList`` holding the most parameters; a model whose parameters
    are not mostly inside one list cannot be streamed layer by layer. Known unsupported families are
    refused first (``refuse_known_unsupported``).
    """
    refuse_known_unsupported(model)
    best_name, best, best_numel = None, None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 1:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best_name, best, best_numel = name, module, numel
    total = sum(p.numel() for p in model.parameters())
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no nn.ModuleList of blocks: megatrain_ds streams a model "
            "one "
            "repeated block at a time and found no repeated block list to stream. Put the decoder "
            "blocks "
            "in an nn.ModuleList (as Hugging Face models do)."
        )
    if best_numel < 0.5 * total:
        raise UnsupportedModelError(
            f"the largest block list '{best_name}' holds only {best_numel}/{total} parameters of "
            f"{type(model).__name__}; the rest would have to stay resident on the GPU. "
            "megatrain_ds needs "
            "most parameters inside the repeated blocks."
        )
    return best_name, best


def shared_parameter_ids(model: nn.Module, layers: nn.ModuleList) -> set[int]:
    """ids of parameters that appear in more than one streamed layer, more than once inside one
    layer, or in a layer and outside the layers: such a parameter cannot live in one layer's flat
    buffer (its gradient is the sum over every use), so it is kept resident like the embeddings."""
    uses: dict[int, int] = {}
    for layer in layers:
        for _, p in layer.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    in_layers = {id(m) for m in layers.modules()}
    for module in model.modules():
        if id(module) not in in_layers:
            for p in module.parameters(recurse=False):
                if id(p) in uses:
                    uses[id(p)] += 1
    return {k for k, n in uses.items() if n > 1}


def build_layout(
    index: int, layer: nn.Module, group_of: dict[int, int], shared_ids: set[int] = frozenset()
) -> LayerLayout:
    """Lay out ``layer``'s parameters: trainable sorted by group, then frozen; shared ones are left
    out."""
    named = list(layer.named_parameters(remove_duplicate=False))
    shared = tuple(n for n, p in named if id(p) in shared_ids)
    named = [(n, p) for n, p in named if id(p) not in shared_ids]
    # trainable = handed to the optimizer (in a param group); anything else is streamed but never
    # updated
    trainable = [(n, p) for n, p in named if id(p) in group_of]
    frozen = [(n, p) for n, p in named if id(p) not in group_of]
    trainable.sort(key=lambda item: group_of[id(item[1])])
    slots, segments, offset = [], [], 0
    for name, p in trainable:
        group = group_of[id(p)]
        if segments and segments[-1][0] == group:
            segments[-1] = (group, segments[-1][1], offset + p.numel())
        else:
            segments.append((group, offset, offset + p.numel()))
        slots.append(ParamSlot(name, tuple(p.shape), offset, p.numel(), True, group))
        offset += p.numel()
    n_train, offset = offset, 0
    for name, p in frozen:
        slots.append(ParamSlot(name, tuple(p.shape), offset, p.numel(), False, -1))
        offset += p.numel()
    return LayerLayout(index, slots, n_train, offset, segments, shared)


# the forward-hook dictionaries of an nn.Module (mirrored from a layer's submodules onto a
# template's)
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def submodule_pairs(template: nn.Module, layer: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(template submodule, the layer's submodule of the same name), the roots excluded: the layer's
    own hooks run in its ``__call__``, outside the streamed forward."""
    originals = dict(layer.named_modules())
    return [
        (sub, originals[name])
        for name, sub in template.named_modules()
        if name and name in originals
    ]


def make_template(layer: nn.Module, device: torch.device) -> nn.Module:
    """A stateless copy of ``layer``: parameters on the meta device; buffers are supplied per call.

    The deep copy never copies weight storage: each parameter is pre-seeded in the memo with a meta
    tensor.
    """
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in layer.parameters()
    }
    template = copy.deepcopy(layer, memo)
    for attr in HOOK_DICTS:
        # the layer's own hooks run in its __call__, not a second time here
        getattr(template, attr).clear()
    if hasattr(template, "gradient_checkpointing"):
        template.gradient_checkpointing = False  # the executor already recomputes each layer
    return template


def has_tied_tensors(module: nn.Module) -> bool:
    """Whether one tensor is registered under two names in ``module`` (a parameter or buffer shared
    inside it).

    Only then does ``functional_call`` need its tie search (``tie_weights=True``, which walks every
    submodule on every call: a third of a small layer's Python time in a decode step). Without ties
    its result is the same.
    """
    seen: set[int] = set()
    for named in (
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    ):
        for _, tensor in named:
            if id(tensor) in seen:
                return True
            seen.add(id(tensor))
    return False


_SCALARS = (int, float, str, bool, type(None))


def per_layer_attributes(
    template: nn.Module, layers: list[nn.Module]
) -> list[list[tuple[nn.Module, str, object]]]:
    """Scalar attributes that differ between layers sharing ``template`` (``layer_idx``,
    ``sliding_window``, ``attention_type``, …), as (template submodule, name, value) overlays per
    layer.

    A template is a copy of the first layer of its group; without these overlays every layer would
    run with the first layer's index (wrong KV-cache slot) and attention window.
    """

    def scalars(module: nn.Module) -> dict[tuple[str, str], object]:
        out = {}
        for path, sub in module.named_modules():
            for name, value in vars(sub).items():
                if not name.startswith("_") and (
                    isinstance(value, _SCALARS)
                    or (isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value))
                ):
                    out[(path, name)] = value
        return out

    per_layer = [scalars(layer) for layer in layers]
    keys = {
        k for k in set().union(*per_layer) if k[1] not in ("gradient_checkpointing", "training")
    }
    varying = sorted(k for k in keys if len({repr(p.get(k)) for p in per_layer}) > 1)
    subs = dict(template.named_modules())
    return [
        [(subs[path], name, values.get((path, name))) for path, name in varying]
        for values in per_layer
    ]


_COMPARE = {
    getattr(ast, op): fn
    for op, fn in (
        ("Is", lambda a, b: a is b),
        ("IsNot", lambda a, b: a is not b),
        ("Eq", lambda a, b: a == b),
        ("NotEq", lambda a, b: a != b),
        ("Gt", lambda a, b: a > b),
        ("GtE", lambda a, b: a >= b),
        ("Lt", lambda a, b: a < b),
        ("LtE", lambda a, b: a <= b),
    )
}


def plain_lm_head(model: nn.Module, head_name: str, decoder_name: str) -> str | None:
    """None when ``type(model).forward`` is exactly ``decoder -> hidden_states ->
    self.<head_name>(hidden_states) -> self.loss_function(logits, labels, ...)`` with Hugging Face's
    causal-LM loss, so the engine's fused head + cross-entropy computes the model's own loss; else
    why not (the model's own forward then runs: always correct, only without the fused loss).

    Read from the forward's source: a head that does more than a matmul (Gemma 2's final
    soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's
    ``lm_head_multiplier``, ...), hidden states changed on the way to the head, or a loss other than
    ``self.loss_function`` (BART-style ``ForCausalLM``s compute an unshifted CrossEntropyLoss), a
    subclass's own forward around ``super().forward`` all read as "not plain". A statement under
    ``if self.<attr>:`` or ``if self.<attr> <op> <constant>:`` (``is not None``, ``> 0``) counts
    only when that test holds on this model (Gemma 2 without soft-capping, Bamba without z-loss are
    plain); the router aux loss (under ``if output_router_logits``) is checked per call by the
    engine."""
    import inspect
    import textwrap

    cls = type(model)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return f"the source of {cls.__name__}.forward is not available"
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        ForCausalLMLoss = None
    if ForCausalLMLoss is None or getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return f"{cls.__name__}'s loss_function is not Hugging Face's ForCausalLMLoss"

    def self_attr(node):  # self.a.b -> getattr chain value; anything else -> raises
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id == "self"):
            raise ValueError
        value = model
        for name in reversed(names):
            value = getattr(value, name)
        return value

    def dead(test) -> bool:  # an ``if`` this model never enters
        if any(isinstance(n, ast.Name) and "router_logits" in n.id for n in ast.walk(test)):
            # MoE aux loss: _fused_loss_applies refuses the fused loss when router logits are on
            return True
        try:
            if isinstance(test, ast.Compare):  # self.x <op> constant: ``is not None``, ``> 0``, ...
                if (
                    len(test.ops) != 1
                    or not isinstance(test.comparators[0], ast.Constant)
                    or type(test.ops[0]) not in _COMPARE
                ):
                    return False
                return not _COMPARE[type(test.ops[0])](
                    self_attr(test.left), test.comparators[0].value
                )
            return not self_attr(test)
        except (ValueError, AttributeError, TypeError):
            return False

    def strip(node, methods):  # x.float() / x.contiguous() / x.to(...) -> x
        while (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in methods
        ):
            node = node.func.value
        return node

    # name -> the statements (in branches this model runs) assigning it
    assigns: dict[str, list] = {}

    def visit(body):
        for stmt in body:
            if isinstance(stmt, ast.If):
                if not dead(stmt.test):
                    visit(stmt.body)
                visit(stmt.orelse)
                continue
            if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            assigns.setdefault(n.id, []).append(stmt)
            for attr in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(stmt, attr, None)
                if isinstance(inner, list) and not isinstance(stmt, ast.If):
                    visit(
                        [s for s in inner if isinstance(s, ast.stmt)]
                        + [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body]
                    )

    fn = tree.body[0]
    visit(fn.body)
    logits = assigns.get("logits", []) + assigns.get("lm_logits", [])
    if len(logits) != 1 or not isinstance(logits[0], (ast.Assign, ast.AnnAssign)):
        return f"{cls.__name__}.forward changes the logits after the head"
    call = strip(logits[0].value, ("float", "contiguous"))
    if not (
        isinstance(call, ast.Call)
        and len(call.args) == 1
        and not call.keywords
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == head_name
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
    ):
        return f"{cls.__name__}.forward's logits are not self.{head_name}(hidden_states)"
    arg = strip(call.args[0], ("to",))
    arg = arg.value if isinstance(arg, ast.Subscript) else arg
    if not (isinstance(arg, ast.Name) and arg.id == "hidden_states"):
        return (
            f"{cls.__name__}.forward feeds the head something other than the decoder's hidden "
            "states"
        )
    for stmt in assigns.get("hidden_states", []):
        value = stmt.value
        ok = isinstance(stmt, (ast.Assign, ast.AnnAssign)) and (
            (isinstance(value, ast.Attribute) and value.attr == "last_hidden_state")
            or (
                isinstance(value, ast.Subscript)
                and isinstance(value.slice, ast.Constant)
                and value.slice.value == 0
            )
            or (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "slice_logits_to_keep"
            )
        )
        if not ok:
            return f"{cls.__name__}.forward changes the hidden states before the head"
    decoder_calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
        and n.func.attr == decoder_name
    ]
    # (OPT calls self.model.decoder: the model's own forward runs, unfused)
    if len(decoder_calls) != 1:
        return f"{cls.__name__}.forward does not call self.{decoder_name} once"
    for stmt in assigns.get("loss", []):
        value = stmt.value if not isinstance(stmt, ast.AugAssign) else None
        if isinstance(value, ast.Constant) and value.value is None:
            continue
        if not (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "loss_function"
            and isinstance(value.func.value, ast.Name)
            and value.func.value.id == "self"
        ):
            return (
                f"{cls.__name__}.forward computes a loss other than self.loss_function(logits, "
                "labels, ...)"
            )
        first = (
            value.args[0]
            if value.args
            else next((k.value for k in value.keywords if k.arg == "logits"), None)
        )
        if not (isinstance(first, ast.Name) and first.id in ("logits", "lm_logits")):
            return (
                f"{cls.__name__}.forward computes a loss other than self.loss_function(logits, "
                "labels, ...)"
            )
    return None
