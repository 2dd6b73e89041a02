"""The engine's forward helpers: the batch onto the device, and the fused LM head + cross-entropy.

This module owns what a training forward does around the model: the batch's tensors moved to the
device (``to_device``), whether a call may take the fused loss (``fused_loss_call``, [Note: fused
loss only where exact]), the fused forward itself (``forward_fused_loss``: the decoder, then
loss.py's chunked ``linear_cross_entropy``, never the whole logits), and the ``.logits`` such a
forward returns (``LogitsNotComputed``, which says why they are missing). Which models have a plain
head is loss.py's ``fused_loss_parts``; the engine's ``forward`` (engine.py) calls these.

[Note: fused loss only where exact] The fused loss replaces the model's own code: it calls the
decoder, then the head's weight, never ``model.forward``. So it runs only where that computes
exactly what ``model(*args, **kwargs)`` would, checked at every call (a library may patch the model
after ``initialize``):

- the forward is the causal-LM class's own, as transformers wrote it: no ``forward`` on the instance
  (TRL's ``add_fused_lm_head``, liger's instance patch, a script's wrapper), the class that defines
  ``forward`` and every function it wraps come from ``transformers`` (not a subclass's override, not
  liger's class-level patch), the ``loss_function`` is transformers' ``ForCausalLMLoss``, no forward
  hooks on the model or the head;
- under PEFT, PEFT's own pass-through wrappers (``PeftModelForCausalLM``, the tuner) around such a
  model, and an adapter that only changes layers: prompt learning, POLY and aLoRA add inputs of
  their own;
- every keyword is one it handles: the decoder's inputs, passed on as the model's forward passes
  them (``DECODER_KEYWORDS``), and ``labels``, ``num_items_in_batch``, ``use_cache``,
  ``logits_to_keep=0``, ``return_dict`` (not False), ``output_router_logits`` (off: on, the model
  adds its router aux loss); positional arguments are bound to the forward's parameter names first.

Anything else runs the model's own forward through the streamed layers (correct; its head may form
the whole logits) and logs why, once per reason. TRL's fused head is such a case and keeps its
speed: its forward is a chunked log-prob head of its own (``trl.kernels.ChunkedLogProbFunction``)
that never forms the whole logits, so it runs as TRL wrote it (per-token ``log_probs``, ``entropy``,
temperature, ... exactly TRL's) on the streamed decoder.
"""

from __future__ import annotations

import functools

import torch

from ..log import log
from ..model import linear_cross_entropy
from ..streaming import positional_names

# The decoder's inputs: the causal LM's forward hands them to the decoder (its ``**kwargs``
# included), so the fused path, which calls the decoder with them, computes the same hidden states.
DECODER_KEYWORDS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "past_key_values",
        "cache",
        "inputs_embeds",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "is_causal",
    }
)
# What the fused head handles itself (values checked in ``_keyword_refusal``)
HEAD_KEYWORDS = frozenset(
    {
        "labels",
        "num_items_in_batch",
        "use_cache",
        "logits_to_keep",
        "return_dict",
        "output_router_logits",
    }
)


class LogitsNotComputed:
    """``.logits`` of a training forward with ``labels=``: the fused LM head + cross-entropy
    computed the loss without ever forming the [tokens, vocab] logits. Any use says so (instead of a
    bare ``None`` error)."""

    _WHY = (
        "megatrain_ds computed this loss with the fused LM head + cross-entropy, so the logits "
        "were never "
        "formed; to get them, call the model without labels= and take the loss from the logits, or "
        "set "
        "\"megatrain\": {\"fused_loss\": false} in the config"
    )

    def __getattr__(self, name):
        raise AttributeError(f"{self._WHY} (asked for .logits.{name})")

    def __getitem__(self, key):
        raise TypeError(self._WHY)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "LogitsNotComputed(fused loss: logits were never formed)"


def to_device(value, device):
    """Tensors (in lists, tuples and dicts too) onto ``device``, without blocking; anything else as
    it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def fused_loss_call(
    model, fused, args: tuple, kwargs: dict, *, enabled: bool, own_hooks: set, refusals: set[str]
) -> dict | None:
    """A grad-enabled call's arguments as keywords when the fused LM head + cross-entropy computes
    exactly what the model's own forward would ([Note: fused loss only where exact]); None
    otherwise, and the model's own forward runs: for a call with labels it logs why, once per reason
    (``refusals``: the reasons logged so far, which it adds to).

    ``model``: the engine's module; ``fused``: its (decoder, head), loss.py's ``fused_loss_parts``
    (None: no plain head); ``enabled``: ``megatrain.fused_loss``; ``own_hooks``: ids of the engine's
    own forward hooks (the resident refresh, zero_offload.py), which the fused path runs itself."""
    if fused is None or not enabled:
        return None
    names = positional_names(type(model))
    if len(args) > len(names) or any(n in kwargs for n in names[: len(args)]):
        # the model's own forward takes (or refuses) them as it would without the engine
        return None
    call = {**dict(zip(names, args)), **kwargs}
    if call.get("labels") is None:
        return None
    reason = forward_refusal(model, fused[1], own_hooks) or _keyword_refusal(call, fused[0])
    if reason is None:
        return call
    if reason not in refusals:
        refusals.add(reason)
        log(
            "labels= runs the model's own forward, not megatrain_ds's fused LM head + "
            f"cross-entropy: {reason}"
        )
    return None


def forward_refusal(model, head, own_hooks=frozenset()) -> str | None:
    """Why ``model``'s forward is not (PEFT's pass-through around) the transformers causal-LM
    forward the fused loss reproduces; None when it is. ``head``: the LM head the fused loss reads;
    ``own_hooks``: ids of the engine's own hooks, which the fused path runs itself."""
    base, tuner = model, None
    if callable(getattr(model, "get_base_model", None)):  # PEFT
        reason = _peft_refusal(model)
        if reason is not None:
            return reason
        base, tuner = model.get_base_model(), model.base_model
    name = type(base).__name__
    patched = vars(base).get("forward")
    if patched is not None:
        origin = _origin(patched)
        if origin.startswith("trl."):
            return (
                f"TRL's fused LM head ({origin}) replaced {name}.forward; it runs as TRL wrote it, "
                "on the streamed "
                "decoder (its head is chunked too: no whole logits)"
            )
        return f"{name}.forward is replaced on the instance (by {origin})"
    owner = _defining_class(type(base))
    if not owner.__module__.startswith("transformers.") or not _comes_from(
        vars(owner)["forward"], "transformers."
    ):
        return (
            f"{name}.forward is {owner.__module__}.{owner.__qualname__}.forward "
            f"({_origin(vars(owner)['forward'])}), not transformers' own"
        )
    if getattr(base, "loss_function", None) is not _causal_lm_loss():
        return f"{name}.loss_function is not transformers' ForCausalLMLoss"
    for label, module in (
        ("the model", model),
        ("the PEFT tuner", tuner),
        (name, base),
        ("the LM head", head),
    ):
        if module is not None and _has_hooks(module, own_hooks):
            return (
                f"forward hooks on {label} ({type(module).__name__}), which the fused loss would "
                "not call"
            )
    if _has_hooks(None, own_hooks):
        return "global module forward hooks (torch.nn.modules.module.register_module_forward_hook)"
    return None


def _peft_refusal(model) -> str | None:
    """PEFT's ``PeftModelForCausalLM.forward`` and the tuner's pass a LoRA-style call straight to
    the base model; prompt learning (virtual tokens), POLY (task ids) and aLoRA (offsets) add inputs
    of their own."""
    for module in (model, getattr(model, "base_model", None)):
        if module is None:
            continue
        if "forward" in vars(module):
            return (
                f"PEFT's {type(module).__name__}.forward is replaced on the instance (by "
                f"{_origin(module.forward)})"
            )
        owner = _defining_class(type(module))
        if not _comes_from(vars(owner)["forward"], "peft."):
            return (
                f"{type(module).__name__}.forward is {owner.__module__}.{owner.__qualname__}"
                ".forward, not PEFT's own"
            )
    config = getattr(model, "active_peft_config", None)
    kind = str(
        getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    )
    if (
        config is None
        or getattr(config, "is_prompt_learning", True)
        or kind == "POLY"
        or getattr(config, "alora_invocation_tokens", None) is not None
    ):
        return f"PEFT {kind}: its forward adds inputs of its own"
    return None


def _keyword_refusal(call: dict, decoder) -> str | None:
    unknown = sorted(k for k in call if k not in DECODER_KEYWORDS and k not in HEAD_KEYWORDS)
    if unknown:
        return f"keyword(s) {', '.join(unknown)}, which the fused loss does not handle"
    if call.get(
        "output_router_logits",
        getattr(getattr(decoder, "config", None), "output_router_logits", False),
    ):
        return "output_router_logits: the model adds its router aux loss to the loss"
    keep = call.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        return "logits_to_keep asks for logits"
    if call.get("return_dict") is False:
        return "return_dict=False"
    return None


def _defining_class(cls: type) -> type:
    return next(c for c in cls.__mro__ if "forward" in vars(c))


def _origin(fn) -> str:
    """Where a function was written: its module (from its globals, which ``functools.wraps`` does
    not copy) and its code's name, e.g. ``trl.trainer.utils._fused_forward``."""
    f = getattr(fn, "__func__", fn)
    globals_ = getattr(f, "__globals__", None)
    module = (
        globals_.get("__name__")
        if isinstance(globals_, dict)
        else getattr(type(f), "__module__", "?")
    )
    code = getattr(f, "__code__", None)
    return (
        f"{module}"
        f".{code.co_name if code is not None else getattr(f, '__qualname__', type(f).__name__)}"
    )


def _comes_from(fn, package: str) -> bool:
    """``fn`` and every function it wraps (``__wrapped__``: transformers' own decorators) were
    written in ``package``."""
    for _ in range(16):
        if fn is None:
            return True
        if not _origin(fn).startswith(package):
            return False
        fn = getattr(getattr(fn, "__func__", fn), "__wrapped__", None)
    return False


def _has_hooks(module, own_hooks) -> bool:
    """Forward (pre-)hooks other than the engine's on ``module``; ``None``: the global ones."""
    if module is None:
        from torch.nn.modules import module as nn_module

        return bool(
            getattr(nn_module, "_global_forward_hooks", None)
            or getattr(nn_module, "_global_forward_pre_hooks", None)
        )
    return any(k not in own_hooks for k in (*module._forward_pre_hooks, *module._forward_hooks))


@functools.lru_cache(maxsize=1)
def _causal_lm_loss():
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    return ForCausalLMLoss


def forward_fused_loss(fused, args, kwargs, *, megatrain, timer, streams):
    """The decoder, then the LM head + cross-entropy in chunks (timed by ``timer`` as compute on
    ``streams``' compute stream): a ``CausalLMOutputWithPast`` whose ``.logits`` is
    ``LogitsNotComputed``. ``fused``: the model's (decoder, head); ``kwargs``: ``fused_loss_call``'s
    keywords; ``megatrain``: the config's ``megatrain`` block (``loss_chunk_rows``,
    ``use_liger``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    decoder, head = fused
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    kwargs["use_cache"] = False
    out = decoder(*args, **kwargs)
    hidden = out[0]  # (B, S, h)
    with timer.span("compute", streams.compute()):
        loss = linear_cross_entropy(
            hidden,
            head.weight,
            head.bias,
            labels,
            num_items,
            chunk_rows=megatrain.loss_chunk_rows,
            use_liger=megatrain.use_liger,
        )
    return CausalLMOutputWithPast(
        loss=loss,
        logits=LogitsNotComputed(),
        hidden_states=getattr(out, "hidden_states", None),
        attentions=getattr(out, "attentions", None),
    )
