"""How a model splits into streamed decoder layers and small resident parts.

The streamed part is the repeated block list (``model.model.layers`` for Llama/Qwen/Mistral,
``model.transformer.h`` for GPT-2, or any ``nn.ModuleList`` of blocks in a plain module). Everything else
(embeddings, final norm, LM head, rotary tables) is *resident*: small, kept on the device in the compute
dtype, with fp32 master state on the host like the layers.

Each layer's parameters are laid out in one flat buffer: trainable parameters first, grouped by optimizer
param group (so each group is a contiguous segment the fused optimizer can step), then frozen ones.
Layers with the same structure share one stateless *template*: a copy of the first such layer whose
parameters live on the meta device (no storage) and are supplied per call as views of a device slot.
"""
from __future__ import annotations

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
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (group, start, end) in trainable
    # names of parameters shared with another layer or the rest of the model (or tied inside this layer):
    # resident, not in the flat buffer; bound by the executor from the model's own parameter
    shared: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return self.n_train + self.n_frozen

    def signature(self) -> tuple:
        return tuple((s.name, s.shape, s.trainable) for s in self.slots)


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return the qualified name and the ModuleList holding the model's repeated blocks.

    The block list is the ``nn.ModuleList`` holding the most parameters; a model whose parameters are not
    mostly inside one list cannot be streamed layer by layer.
    """
    best_name, best, best_numel = None, None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 1:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best_name, best, best_numel = name, module, numel
    total = sum(p.numel() for p in model.parameters())
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no nn.ModuleList of blocks: megatrain_ds streams a model one "
            "repeated block at a time and found no repeated block list to stream. Put the decoder blocks "
            "in an nn.ModuleList (as Hugging Face models do)."
        )
    if best_numel < 0.5 * total:
        raise UnsupportedModelError(
            f"the largest block list '{best_name}' holds only {best_numel}/{total} parameters of "
            f"{type(model).__name__}; the rest would have to stay resident on the GPU. megatrain_ds needs "
            "most parameters inside the repeated blocks."
        )
    return best_name, best


def shared_parameter_ids(model: nn.Module, layers: nn.ModuleList) -> set[int]:
    """ids of parameters that appear in more than one streamed layer, more than once inside one layer, or in a
    layer and outside the layers: such a parameter cannot live in one layer's flat buffer (its gradient is the
    sum over every use), so it is kept resident like the embeddings."""
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


def build_layout(index: int, layer: nn.Module, group_of: dict[int, int], shared_ids: set[int] = frozenset()
                 ) -> LayerLayout:
    """Lay out ``layer``'s parameters: trainable sorted by group, then frozen; shared ones are left out."""
    named = list(layer.named_parameters(remove_duplicate=False))
    shared = tuple(n for n, p in named if id(p) in shared_ids)
    named = [(n, p) for n, p in named if id(p) not in shared_ids]
    # trainable = handed to the optimizer (in a param group); anything else is streamed but never updated
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


def make_template(layer: nn.Module, device: torch.device) -> nn.Module:
    """A stateless copy of ``layer``: parameters on the meta device; buffers are supplied per call.

    The deep copy never copies weight storage: each parameter is pre-seeded in the memo with a meta tensor.
    """
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in layer.parameters()}
    template = copy.deepcopy(layer, memo)
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
        getattr(template, attr).clear()  # the layer's own hooks run in its __call__, not a second time here
    if hasattr(template, "gradient_checkpointing"):
        template.gradient_checkpointing = False  # the executor already recomputes each layer
    return template


def has_active_dropout(module: nn.Module) -> bool:
    """True when a forward of ``module`` in training mode consumes random numbers (so recompute must
    replay the RNG state)."""
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            return True
        for attr in ("attention_dropout", "dropout"):
            value = getattr(sub, attr, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


_SCALARS = (int, float, str, bool, type(None))


def per_layer_attributes(template: nn.Module, layers: list[nn.Module]) -> list[list[tuple[nn.Module, str, object]]]:
    """Scalar attributes that differ between layers sharing ``template`` (``layer_idx``, ``sliding_window``,
    ``attention_type``, …), as (template submodule, name, value) overlays per layer.

    A template is a copy of the first layer of its group; without these overlays every layer would run with
    the first layer's index (wrong KV-cache slot) and attention window.
    """
    def scalars(module: nn.Module) -> dict[tuple[str, str], object]:
        out = {}
        for path, sub in module.named_modules():
            for name, value in vars(sub).items():
                if not name.startswith("_") and (isinstance(value, _SCALARS) or
                                                 (isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value))):
                    out[(path, name)] = value
        return out

    per_layer = [scalars(layer) for layer in layers]
    keys = {k for k in set().union(*per_layer) if k[1] not in ("gradient_checkpointing", "training")}
    varying = sorted(k for k in keys if len({repr(p.get(k)) for p in per_layer}) > 1)
    subs = dict(template.named_modules())
    return [[(subs[path], name, values.get((path, name))) for path, name in varying] for values in per_layer]
