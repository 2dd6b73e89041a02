"""Sequence-tiled MLP (and RMSNorm) for long context (``megatrain.tiled_mlp``).

At 512K tokens in one micro-batch the MLP's intermediates dominate a layer's GPU memory: each
``[tokens, intermediate]`` tensor of Qwen2.5-7B is 512K x 18944 x 2 bytes = 19.9 GB (Qwen2.5-3B:
11.5 GB), and a recompute + backward holds several (gate, up, their product, and their gradients).
Here a decoder layer's MLP runs in row chunks (the sequence dimension, batch folded in: the MLP is
row-wise), only its input is saved, and each chunk is recomputed in the backward, so the peak is one
chunk's intermediates.

The same treatment, minimal on purpose, covers the layer's RMSNorms *when liger-kernel's RMSNorm is
not patched in*: Hugging Face's RMSNorm upcasts to fp32, and its autograd graph keeps that fp32 copy
plus a compute-dtype copy of the normalized rows, 6 bytes per element per norm (Qwen2.5-7B, 512K
tokens: 11.3 GB per norm, two or four norms per layer), against nothing for the tiled norm (its
input is the residual stream, alive anyway). liger's RMSNorm saves only its input and one fp32 per
row, so it is left as it is. Nothing else is chunked: at 512K the other per-layer tensors are
``[tokens, hidden]``-sized (the projections' inputs and outputs, attention's q/k/v/output that flash
attention keeps), each one of them being needed whole by attention.

Measured on CPU (one Qwen2.5-3B decoder layer in bf16, without liger, 16K tokens, chunks of 4096
rows; live bytes as the peak RSS with every large tensor its own mmap), in units of T = tokens x
hidden x 2 bytes: the graph a forward leaves for the backward is 33.0 T untiled, 11.5 T with the MLP
tiled, 6.5 T with MLP and norms tiled; the peak of forward + backward 44.4 T, 26.0 T, 21.0 T (of
which 2.3 T are the weights' gradients at 16K; at 32K tokens the tiled peak is 14.1 T: it grows as
~7.3 T plus one chunk's work and the weight gradients).

Why not DeepSpeed's ``TiledMLP`` / ``SequenceTiledCompute``
(deepspeed.runtime.sequence_parallel.ulysses_sp, 0.19.8)? They do not fit how executor.py takes a
layer's gradients, in two ways (checked with 0.19.8):

1. Their backward recomputes with ``fn(self, x_shard)``, i.e. the module's *own* parameters at
   backward time. The executor runs a stateless template whose parameters are bound per call by
   ``functional_call`` to views of the streamed slot; the backward runs after that call returned,
   when the template's parameters are its meta placeholders again: the backward fails ("MmBackward0
   returned an invalid gradient ... expected device meta"). On a module with real parameters it
   would recompute with the wrong (module's) weights.
2. They return no gradient for the weights (the weights are not inputs of the Function) and instead
   run a nested ``torch.autograd.backward`` that accumulates into ``param.grad``. The executor takes
   a layer's gradient with ``torch.autograd.grad(outputs, [flat trainable slot region, shared
   params, input])``: over explicit inputs, reading nothing from ``.grad``. The weights' gradient
   would be missing from the flat gradient (zero: measured, a layer whose MLP went through
   ``TiledMLP`` got a zero flat gradient for it), the same incompatibility as reentrant
   checkpointing with ``autograd.grad``.

So :class:`_TiledRows` takes the weights as explicit inputs of the Function (the bound views, so the
gradient flows back into the slot region through the views) and returns their gradients; its
backward rebinds the very tensors the forward saw (parameters and buffers) onto the module while it
recomputes. Weight gradients are summed over the chunks in fp32 when the weights are in a lower
precision (then cast once), so bf16 training does not round once per chunk.

Semantics: the tiled module must be row-wise (each output row depends only on the same input row),
which holds for dense MLPs and norms. Mixture-of-experts blocks are left alone (routing with
capacity, auxiliary outputs), as are modules with an active dropout (chunking changes which random
numbers a row draws). Forward hooks of the tiled module run once per call, as before; hooks on its
submodules (the linears) run once per chunk, and again for each chunk in the backward's recompute.
Results equal the untiled module's up to the order of the weight gradient's sum over rows (and the
matmul kernels' choice for a different row count): not bit-exact, within fp32 rounding
(tests/unit/test_tiling.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.function import once_differentiable

# "auto": tile a call when its largest intermediate ([rows, width] in its dtype) exceeds this many
# bytes (bf16: Qwen2.5-3B from 195K tokens per micro-batch, 7B from 113K, 14B from 155K). Tiling
# costs one more MLP forward per layer and step (+25% of the MLP's FLOPs: negligible at 512K tokens,
# where attention dominates, but an estimated 10-19% of a step at 64K-96K tokens of 1K sequences,
# not measured); at 4 GiB none of the README's headline rows changes (3B up to 128K tokens, 7B 16K,
# 14B up to 96K). The untiled MLP's peak there is ~5 such tensors (~20 GiB) per layer.
AUTO_THRESHOLD_BYTES = 4 << 30
# ... in chunks whose largest intermediate is about this many bytes (Qwen2.5-3B: 24,320 rows; 7B:
# 14,080)
TARGET_CHUNK_BYTES = 512 << 20
ROW_MULTIPLE = 256  # chunk rows are a multiple of this (GEMM-friendly); at least this many
MLP_NAMES = ("mlp", "feed_forward", "ffn")  # a decoder layer's child holding its MLP (HF naming)


def validate_setting(value, key: str = "megatrain.tiled_mlp") -> None:
    """``"auto"``, true, false or a row count >= 1; raises ValueError naming ``key`` otherwise."""
    if value in ("auto",) or isinstance(value, bool):
        return
    if isinstance(value, int) and value >= 1:
        return
    raise ValueError(
        f"{key} must be \"auto\", true, false or rows per chunk (an integer >= 1), got {value!r}"
    )


def chunk_rows(setting, rows: int, row_bytes: int) -> int | None:
    """Rows per chunk for a call over ``rows`` rows whose largest intermediate takes ``row_bytes``
    bytes per row, or None (run the module as it is). ``setting``: see :func:`validate_setting`; an
    int is taken as given; true tiles whatever the size; "auto" tiles above
    :data:`AUTO_THRESHOLD_BYTES`."""
    if setting is False:
        return None
    if isinstance(setting, int) and not isinstance(setting, bool):
        return int(setting)
    auto = max(
        ROW_MULTIPLE, TARGET_CHUNK_BYTES // max(int(row_bytes), 1) // ROW_MULTIPLE * ROW_MULTIPLE
    )
    if setting is True:
        return auto
    return auto if rows * row_bytes > AUTO_THRESHOLD_BYTES else None


def apply_tiling(templates: list[nn.Module], setting) -> list[str]:
    """Install the tiled forward on each template's dense MLP (and, where liger's is not patched in,
    its RMSNorms). Returns the tiled modules as "template index:module path" (empty for ``setting``
    false). The decision to tile (and the chunk size) is taken per call from the call's rows, see
    :func:`chunk_rows`."""
    validate_setting(setting)
    if setting is False:
        return []
    tiled: list[str] = []
    for t, template in enumerate(templates):
        done: list[str] = []
        for path, module in template.named_modules():
            if not path or any(path.startswith(p + ".") for p in done):
                continue  # the template itself; inside a module already tiled
            kind = _kind(path, module)
            if kind is None:
                continue
            module.forward = TiledForward(
                module, module.forward, kind, setting, _width(module, kind)
            )
            done.append(path)
            tiled.append(f"{t}:{path}")
    return tiled


def _kind(path: str, module: nn.Module) -> str | None:
    if isinstance(module.forward, TiledForward) or _has_dropout(module):
        return None
    if "." not in path and path in MLP_NAMES and not _is_moe(module):
        return "mlp"
    if type(module).__name__.endswith("RMSNorm") and not _is_liger(module):
        return "norm"
    return None


def _is_moe(module: nn.Module) -> bool:
    """Experts or a router anywhere inside (Qwen2-MoE, OLMoE, Mixtral, ... sparse blocks)."""
    for name, sub in module.named_modules():
        kind = type(sub).__name__
        if (
            hasattr(sub, "experts")
            or hasattr(sub, "num_experts")
            or "expert" in name.split(".")[-1].lower()
            or any(word in kind for word in ("Sparse", "Expert", "Router", "MoeBlock", "MoEBlock"))
        ):
            return True
    return False


def _has_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def _is_liger(module: nn.Module) -> bool:
    """liger-kernel's instance patching binds its forward on the module
    (``_bind_method_to_module``)."""
    fn = module.__dict__.get("forward")
    fn = getattr(fn, "__func__", fn)
    return (
        "liger_kernel" in (getattr(fn, "__module__", "") or "") or "Liger" in type(module).__name__
    )


def _width(module: nn.Module, kind: str) -> int | None:
    """Elements per row of the module's largest intermediate: the MLP's intermediate size (its
    config's, or its widest weight dimension); None for a norm (the input's width, read per
    call)."""
    if kind != "mlp":
        return None
    width = getattr(module, "intermediate_size", None)
    if isinstance(width, int) and width > 0:
        return width
    dims = [max(p.shape) for p in module.parameters() if p.dim() == 2]
    return max(dims) if dims else None


class TiledForward:
    """The tiled module's ``forward`` (set on the instance, so ``module.__call__`` and its hooks are
    unchanged)."""

    def __init__(self, module: nn.Module, inner, kind: str, setting, width: int | None) -> None:
        self.module, self.inner, self.kind, self.setting, self.width = (
            module,
            inner,
            kind,
            setting,
            width,
        )

    def __call__(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() < 2
            or not x.is_floating_point()
            or x.numel() == 0
        ):
            return self.inner(*args, **kwargs)
        n = x.numel() // x.shape[-1]
        # the norm's intermediate is its fp32 upcast of the input; the MLP's is [rows, intermediate]
        # in x's dtype
        row_bytes = (
            (x.shape[-1] * 4)
            if self.kind == "norm"
            else (self.width or x.shape[-1]) * x.element_size()
        )
        rows = chunk_rows(self.setting, n, row_bytes)
        if rows is None:
            return self.inner(x)
        entries, params, buffers = _state(self.module)
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _TiledRows.apply(self.inner, entries, buffers, rows, x, *params)
        return _chunked(self.inner, x, rows)


def _state(module: nn.Module):
    """The tensors bound on ``module`` now (inside the executor's ``functional_call``: views of the
    slot): (entries: (submodule, name, index into params), params: each tensor once, buffers:
    (submodule, name, t))."""
    entries, params, index = [], [], {}
    buffers = []
    for sub in module.modules():
        for name, t in sub._parameters.items():
            if t is None:
                continue
            k = index.setdefault(id(t), len(params))
            if k == len(params):
                params.append(t)
            entries.append((sub, name, k))
        buffers += [(sub, name, t) for name, t in sub._buffers.items() if t is not None]
    return entries, params, buffers


@contextlib.contextmanager
def _bound(entries, tensors, buffers):
    """Bind ``tensors`` (by ``entries``) and ``buffers`` onto their submodules, as
    ``functional_call`` does; restore what was there on exit."""
    saved = []
    try:
        for sub, name, k in entries:
            saved.append((sub._parameters, name, sub._parameters[name]))
            sub._parameters[name] = tensors[k]
        for sub, name, t in buffers:
            saved.append((sub._buffers, name, sub._buffers[name]))
            sub._buffers[name] = t
        yield
    finally:
        for store, name, old in reversed(saved):
            store[name] = old


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """[..., width] -> [1, rows, width] (a view when ``t`` is contiguous)."""
    return t.reshape(1, -1, t.shape[-1])


def _chunked(run, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``run`` over ``x`` in chunks of ``rows`` rows, into one output; whole when it is one
    chunk."""
    x3 = _rows_view(x)
    n = x3.shape[1]
    if n <= rows:
        return run(x)
    out = None
    for start in range(0, n, rows):
        y = run(x3[:, start : start + rows])
        if (
            not isinstance(y, torch.Tensor)
            or y.dim() != 3
            or y.shape[:2] != (1, min(rows, n - start))
        ):
            raise TypeError(
                f"megatrain.tiled_mlp: the tiled module returned "
                f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__} for "
                f"{min(rows, n - start)} rows; only row-wise modules returning one tensor can be "
                "tiled "
                "(set megatrain.tiled_mlp to false)"
            )
        if out is None:
            out = y.new_empty((1, n, y.shape[-1]))
        out[:, start : start + rows] = y
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


class _TiledRows(torch.autograd.Function):
    """A row-wise module over ``x`` in row chunks: saves ``x`` (and references the weights),
    recomputes each chunk in backward with the saved weights bound, returns the input gradient and
    the weights' gradients (explicit inputs: see the module docstring for why this is not
    DeepSpeed's TiledMLP)."""

    @staticmethod
    def forward(ctx, run, entries, buffers, rows, x, *params):
        ctx.run, ctx.entries, ctx.buffers, ctx.rows = run, entries, buffers, rows
        ctx.save_for_backward(x, *params)
        return _chunked(run, x, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        need_x, need_p = ctx.needs_input_grad[4], ctx.needs_input_grad[5:]
        leaves = [p.detach().requires_grad_(need) for p, need in zip(params, need_p)]
        acc = [
            torch.zeros(p.shape, dtype=_accumulation_dtype(p), device=p.device) if need else None
            for p, need in zip(params, need_p)
        ]
        x3, g3 = _rows_view(x), _rows_view(grad)
        grad_x = torch.empty_like(x3) if need_x else None
        n, rows = x3.shape[1], ctx.rows
        wanted = [leaf for leaf, need in zip(leaves, need_p) if need]
        with torch.enable_grad(), _bound(ctx.entries, leaves, ctx.buffers):
            for start in range(0, n, rows):
                xc = x3[:, start : start + rows].detach().requires_grad_(need_x)
                yc = ctx.run(xc)
                wrt = ([xc] if need_x else []) + wanted
                grads = (
                    list(
                        torch.autograd.grad(yc, wrt, g3[:, start : start + rows], allow_unused=True)
                    )
                    if wrt and yc.requires_grad
                    else [None] * len(wrt)
                )
                if need_x:
                    g = grads.pop(0)
                    if g is None:
                        grad_x[:, start : start + rows].zero_()
                    else:
                        grad_x[:, start : start + rows] = g
                for a in acc:
                    if a is not None:
                        g = grads.pop(0)
                        if g is not None:
                            a.add_(g)
                del yc, grads
        out_x = grad_x.reshape(x.shape) if need_x else None
        out_p = [a.to(p.dtype) if a is not None else None for a, p in zip(acc, params)]
        return (None, None, None, None, out_x, *out_p)
