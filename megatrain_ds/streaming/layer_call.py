"""A streamed layer's call as one autograd node. Every streamed layer's ``forward`` is rerouted to
``_layer_forward`` (``make_layer_forward``, installed by ``StreamedLayers`` in executor.py): a
no-grad call goes straight to the executor's ``run_forward``; a grad-enabled one drops its KV cache
(``_without_cache``), is recorded as a ``LayerCall`` (what the backward replays) and runs as
``_StreamedLayerFn``, whose forward and backward call the executor's ``run_forward`` and
``run_backward``. It owns which outputs the Function returns (the primary output, the layer's other
floating-point tensors, the tensors Hugging Face's output-capturing hooks recorded:
``function_outputs``) and the collector the executor's recompute records into
(``fresh_collector``); ``positional_names`` is the engine's too (engine_forward.py). Kept layers
skip the recompute: [Note: kept layers] in executor.py.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)  # identity: a call is a key of the saved-activation maps
class LayerCall:
    """What a layer call needs to be replayed in backward (non-tensor payload of the Function)."""

    index: int
    args: tuple
    kwargs: dict
    rng_state: tuple | None = None
    # the forward's torch.autocast on the device ((dtype, cache) or None: off), replayed
    autocast: tuple | None = None
    # The layer's other outputs, recorded by the forward so the backward's recompute can match them
    # one to one: ``extras``: the non-primary items when the layer returns a tuple (tensors replaced
    # by the Function's outputs, so they carry gradient); ``captured``: tensors that
    # output-capturing hooks on the layer's submodules appended to Hugging Face's collector (router
    # logits, attention weights), as (key, position).
    extras: tuple = ()
    extra_tensor_at: tuple = ()  # positions in ``extras`` that are Function outputs
    captured: tuple = ()  # ((collector key, list position), ...) in output order
    # keys of the collector active in the forward (recreated for the recompute)
    capture_keys: tuple = ()
    # pre-forward copies of the buffers the layer mutates (replayed by recompute)
    buffers: dict | None = None
    # the previous layer's call of the same forward (its input loads next)
    prev: "LayerCall | None" = None
    # kept layer (``StreamedLayers.keep``): the forward's own graph, used by backward
    graph: tuple | None = None
    # what the recompute must match while the recompute check is on (recompute_check.py)
    check: object = None


def make_layer_forward(executor, index: int):
    """The ``forward`` of streamed layer ``index``: every call goes to ``executor`` (the
    ``StreamedLayers`` that installs it)."""

    def forward(hidden_states, *args, **kwargs):
        return _layer_forward(executor, index, hidden_states, args, kwargs)

    forward._megatrain_executor = True  # engine.destroy() removes exactly these
    return forward


# KV-cache arguments of Hugging Face decoder layers, by name (transformers >= 5.24 calls it
# ``cache``; earlier releases ``past_key_values``, older ones ``past_key_value``, GPT-2
# ``layer_past``). A value that is a cache object is recognised by its type too, whatever its name
# (``_is_cache``): a rename upstream cannot slip one through.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


@functools.lru_cache(maxsize=None)
def positional_names(cls: type) -> tuple[str, ...]:
    """The parameter names ``cls.forward`` binds positional arguments to (after ``self``): a decoder
    layer's start with its hidden states (GPT-2 passes its cache positionally after them), a model's
    with its inputs."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _is_cache(value) -> bool:
    """A KV cache object: transformers' ``Cache`` (any subclass, the hybrid Mamba caches included),
    or anything shaped like one (``update`` and ``get_seq_length``), so a cache passed under a name
    we do not know is still seen."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, tuple, list, dict)):
        return False
    return callable(getattr(value, "get_seq_length", None)) and callable(
        getattr(value, "update", None)
    )


def _without_cache(i: int, args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[tuple, dict]:
    """A grad-enabled layer call runs without the KV cache, as Hugging Face's own gradient
    checkpointing does: the forward appends this step's keys/values to the cache, so the backward's
    recompute would append them a second time and attend to both (a wrong gradient for every loss
    taken from the logits). An empty cache is dropped (nothing in it changes the result); a cache
    that already holds tokens cannot be: an error.

    A cache is found by name (``_CACHE_KWARGS``, positional ones through ``names``) or by type
    (``_is_cache``)."""
    named = {name: j for j, name in enumerate(names[: len(args)])}
    cache_at = [
        ("arg", j)
        for j, v in enumerate(args)
        if _is_cache(v) or (names[j : j + 1] and names[j] in _CACHE_KWARGS and v is not None)
    ]
    cache_at += [
        ("kw", k)
        for k, v in kwargs.items()
        if _is_cache(v) or (k in _CACHE_KWARGS and v is not None)
    ]
    flag_at = (
        [("arg", named["use_cache"])] if "use_cache" in named and args[named["use_cache"]] else []
    )
    flag_at += [("kw", "use_cache")] if kwargs.get("use_cache") else []
    if not cache_at and not flag_at:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for where, key in cache_at:
        cache = args[key] if where == "arg" else kwargs[key]
        name = (
            (names[key] if key < len(names) else f"argument {key + 2}") if where == "arg" else key
        )
        length = (
            cache.get_seq_length() if callable(getattr(cache, "get_seq_length", None)) else None
        )
        if length != 0:
            raise NotImplementedError(
                f"layer {i} was called with grad enabled and a KV cache that already holds "
                f"{'some' if length is None else length} tokens ({name}=): megatrain_ds recomputes "
                "each layer in "
                "backward and cannot replay a cache the forward has changed. Train without a "
                "prefix cache "
                "(use_cache=False, no cache passed), or run this forward under torch.no_grad()"
            )
        if where == "arg":
            args[key] = None
        else:
            kwargs[key] = None
    for where, key in flag_at:
        if where == "arg":
            args[key] = False
        else:
            kwargs[key] = False
    return tuple(args), kwargs


def _layer_forward(executor, i: int, hidden: torch.Tensor, args: tuple, kwargs: dict):
    if not torch.is_grad_enabled():
        return executor.run_forward(LayerCall(i, args, kwargs), hidden, training=False)
    args, kwargs = _without_cache(i, args, kwargs, executor.arg_names[i])
    for value in (*args, *kwargs.values()):
        leaves = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            raise NotImplementedError(
                f"layer {i} was called with an extra tensor argument that requires grad; "
                "megatrain_ds "
                "propagates gradients only through the hidden states of a streamed block"
            )
    call = LayerCall(i, args, kwargs)
    # since the last backward: speculation needs exactly one (speculation.py)
    executor.schedule.forward(i)
    executor.chain(call)
    executor.check.before_forward(call, executor.arg_names[i])
    executor.check.handed_on(call.prev, hidden)
    outs = _StreamedLayerFn.apply(executor.anchor, hidden, executor, call)
    executor.check.remember_output(call, outs[0])
    n_extra = len(call.extra_tensor_at)
    collector = _hf_collector()
    for (key, pos, _), tensor in zip(call.captured, outs[1 + n_extra :]):
        collector[key][pos] = tensor  # the collected value now carries the layer's gradient
    if call.extras is None:  # the layer returned a tensor
        return outs[0]
    extras = list(call.extras)
    for j, tensor in zip(call.extra_tensor_at, outs[1 : 1 + n_extra]):
        extras[j] = tensor
    return (outs[0], *extras)


class _StreamedLayerFn(torch.autograd.Function):
    """One streamed layer as one autograd node: saves its input, recomputes in backward.

    Outputs: the primary output (hidden states), then the layer's other floating-point tensor
    outputs, then the tensors output-capturing hooks recorded inside the layer (see ``LayerCall``):
    every output a loss may use carries its gradient. Outputs the loss did not use get ``None`` in
    backward (materialize off)."""

    @staticmethod
    def forward(ctx, anchor, hidden, executor, call):
        collector = _hf_collector()
        sizes = (
            {k: len(v) for k, v in collector.items() if isinstance(v, list)} if collector else {}
        )
        out = executor.run_forward(call, hidden, training=True)
        if collector:
            call.capture_keys = tuple(
                (k, isinstance(v, list), None if isinstance(v, list) else v)
                for k, v in collector.items()
            )
            call.captured = tuple(
                (k, pos, pos - n)
                for k, n in sizes.items()
                for pos in range(n, len(collector[k]))
                if isinstance(collector[k][pos], torch.Tensor)
                and collector[k][pos].is_floating_point()
            )
        if isinstance(out, torch.Tensor):
            call.extras = None
        elif isinstance(out, (tuple, list)):
            call.extras = tuple(out[1:])
            call.extra_tensor_at = tuple(
                j
                for j, t in enumerate(call.extras)
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            )
        else:
            raise NotImplementedError(
                f"layer {call.index} returned {type(out).__name__}; megatrain_ds streams "
                "layers that return a tensor or a tuple whose first item is the hidden states"
            )
        outputs = function_outputs(call, out, collector)
        ctx.executor, ctx.call = executor, call
        ctx.set_materialize_grads(False)
        if call.graph is None:
            executor.check.after_forward(call, outputs)
        else:  # a kept layer is not recomputed: nothing of its own to compare
            call.check = None
        # a kept layer ([Note: kept layers] in executor.py): the graph stays with the call; the
        # Function's outputs are aliases without it (their grad_fn becomes this node)
        if call.graph is not None:
            call.graph = (outputs, *call.graph[1:])
            return tuple(o.detach() for o in outputs)
        # the input goes to pinned host memory (activations.py)
        if executor.activations is not None:
            executor.activations.save(call, hidden)
        else:
            ctx.save_for_backward(hidden)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outs):
        if not ctx.executor.in_engine_backward and ctx.executor.open_implicit_backward is not None:
            # loss.backward() (engine.py: [Note: loss.backward()])
            ctx.executor.open_implicit_backward()
        if not ctx.executor.in_engine_backward:
            raise RuntimeError(
                "a backward through the streamed layers outside engine.backward(loss) "
                "(loss.backward() or "
                "torch.autograd.grad): megatrain_ds lands each layer's gradient in host memory and "
                "needs the "
                "engine to scale it and close the accumulation window. Call engine.backward(loss) "
                "(accelerate: "
                "accelerator.backward(loss)); the gradients of this backward were not kept"
            )
        if ctx.call.graph is not None:
            hidden = None  # a kept layer: its graph holds what it needs
        elif ctx.executor.activations is not None:
            hidden = ctx.executor.activations.load(ctx.call)
        else:
            (hidden,) = ctx.saved_tensors
        grad_in = ctx.executor.run_backward(ctx.call, hidden, grad_outs, ctx.needs_input_grad[1])
        ctx.executor.schedule.backward(ctx.call.index)
        return None, grad_in, None, None


def function_outputs(call: LayerCall, out, collector, recompute: bool = False) -> list:
    """[primary, the extras at ``call.extra_tensor_at``, the captured tensors] of one run of the
    layer. In the recompute ``collector`` is a fresh one (``fresh_collector``): captured items sit
    at their relative positions."""
    items = [out if call.extras is None else out[0]]
    if call.extras is not None:
        items += [out[1 + j] for j in call.extra_tensor_at]
    for key, pos, rel in call.captured:
        items.append(collector[key][rel if recompute else pos])
    return items


_collector_var = None  # transformers' active output collector (a ContextVar), once looked up


def _hf_collector() -> dict | None:
    """The dict Hugging Face's output-capturing hooks append to during this model forward (router
    logits, attention weights, ...), or None (no capture requested, or a transformers without
    it)."""
    global _collector_var
    if _collector_var is None:
        try:
            from transformers.utils.output_capturing import _active_collector
        # older/newer transformers: hooks still run (mirrored), values carry no gradient
        except Exception:
            _active_collector = False
        _collector_var = _active_collector
    return _collector_var.get() if _collector_var else None


class fresh_collector:
    """Context manager for the recompute: an empty collector with the forward's keys, so the hooks
    record the recomputed (graph-carrying) values where ``function_outputs`` finds them and the
    user's lists stay as the forward left them."""

    def __init__(self, capture_keys: tuple) -> None:
        self.capture_keys, self.token, self.collector = capture_keys, None, None

    def __enter__(self):
        if self.capture_keys and _collector_var:
            self.collector = {k: ([] if is_list else v) for k, is_list, v in self.capture_keys}
            self.token = _collector_var.set(self.collector)
        return self.collector

    def __exit__(self, *exc):
        if self.token is not None:
            _collector_var.reset(self.token)
        return False
