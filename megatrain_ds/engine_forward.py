"""The engine's forward helpers: the batch onto the device, and the fused LM head + cross-entropy.

This module owns what a training forward does around the model: the batch's tensors moved to the device
(``to_device``), whether a ``labels=`` call may take the fused loss (``fused_loss_applies``: plain causal-LM
labels, nothing the model adds to its loss, no logits asked for), the fused forward itself (``forward_fused_loss``:
the decoder, then loss.py's chunked ``linear_cross_entropy``, never the whole logits), and the ``.logits`` such a
forward returns (``LogitsNotComputed``, which says why they are missing). Which models have a plain head is
loss.py's ``fused_loss_parts``; the engine's ``forward`` (engine.py) calls these.
"""
from __future__ import annotations

import torch

from .loss import linear_cross_entropy


class LogitsNotComputed:
    """``.logits`` of a training forward with ``labels=``: the fused LM head + cross-entropy computed the loss
    without ever forming the [tokens, vocab] logits. Any use says so (instead of a bare ``None`` error)."""

    _WHY = ("megatrain_ds computed this loss with the fused LM head + cross-entropy, so the logits were never "
            "formed; to get them, call the model without labels= and take the loss from the logits, or set "
            "\"megatrain\": {\"fused_loss\": false} in the config")

    def __getattr__(self, name):
        raise AttributeError(f"{self._WHY} (asked for .logits.{name})")

    def __getitem__(self, key):
        raise TypeError(self._WHY)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "LogitsNotComputed(fused loss: logits were never formed)"


def to_device(value, device):
    """Tensors (in lists, tuples and dicts too) onto ``device``, without blocking; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def fused_loss_applies(settings, fused, kwargs) -> bool:
    """The fused head + cross-entropy computes exactly the model's loss: plain causal-LM labels, nothing the
    model adds to it (MoE router aux loss: the model's own forward runs, logits and all) and no logits the
    caller asked to keep. ``settings``: the engine's ``TrainConfig``; ``fused``: its (decoder, LM head)."""
    if kwargs.get("labels") is None or not settings.megatrain.fused_loss:
        return False
    config = getattr(fused[0], "config", None)
    if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
        return False
    return kwargs.get("logits_to_keep", 0) == 0 and kwargs.get("return_dict") is not False


def forward_fused_loss(engine, args, kwargs):
    """The decoder, then the LM head + cross-entropy in chunks (timed as compute): a ``CausalLMOutputWithPast``
    whose ``.logits`` is ``LogitsNotComputed``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    decoder, head = engine._fused
    labels = kwargs.pop("labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("logits_to_keep", None)
    kwargs["use_cache"] = False
    out = decoder(*args, **kwargs)
    hidden = out[0]  # (B, S, h)
    mt = engine.config_settings.megatrain
    with engine.timer.span("compute", engine.streams.compute()):
        loss = linear_cross_entropy(hidden, head.weight, head.bias, labels, num_items,
                                    chunk_rows=mt.loss_chunk_rows, use_liger=mt.use_liger)
    return CausalLMOutputWithPast(loss=loss, logits=LogitsNotComputed(),
                                  hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))
