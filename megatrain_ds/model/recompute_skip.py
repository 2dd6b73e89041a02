"""The recompute skips the MLP's output projection (``megatrain.skip_recompute_down_proj``).

A recomputed layer runs its forward again only to rebuild the graph its backward needs. In a
decoder layer that ends ``hidden = residual + self.mlp(norm(hidden))`` with an MLP that ends
``return self.down_proj(...)``, nothing of the backward needs the value of ``down_proj``'s output:
its gradient is the layer's output gradient (the residual add passes it on unchanged), and its own
backward needs only its input and weight. So in the recompute ``down_proj`` returns a zero
placeholder of its output's shape, with a backward that is the linear's own (``_GradOnlyLinear``):
the same two matrix products autograd takes for ``F.linear``, in the same order. Saved: one matmul
of the recompute's seven (gate, up, down; q, k, v, o), a third of the MLP's forward; at the Qwen2.5
widths about 28% of a layer's forward FLOPs (1.5B: 27.5 of ~98 MFLOP per token; 7B: 29%), ~7% of a
recomputed layer's step (forward, recompute, backward: 4 forwards' worth). The layer's output in the
recompute is wrong (``residual + 0``) and nothing reads it; where something might, no skip:

- a layer whose source (``ast``) does not end in those three statements (Llama, Qwen2, Qwen3,
  Mistral, Gemma do; Gemma 2/3's post-MLP norm, Phi-3's dropout on the MLP output do not), an MLP
  whose forward does not return ``self.down_proj(...)`` (directly or through one name), or a
  ``down_proj`` that is not exactly ``nn.Linear`` (LoRA, quantized linears): decided once, when the
  templates are made (``install``);
- a call with forward hooks on the MLP or on ``down_proj`` (the user's, or a capture of their
  outputs: they would see the placeholder), a recompute the recompute check compares
  (recompute_check.py: it compares outputs), or with grad off: decided per call.

Exactness: the gradients are bit-identical to the full recompute's on CPU (tests/engine/
test_recompute_skip.py); the kept layers' forward and every no-grad forward are untouched.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap

import torch
from torch import nn

_active = [False]  # set by ``recomputing`` around the executor's recompute (one compute thread)
skipped_calls = [0]  # down_proj forwards skipped in this process (tests read it)


def validate_setting(value, key: str = "megatrain.skip_recompute_down_proj") -> None:
    if value not in ("auto", False):
        raise ValueError(f'{key} must be "auto" or false, got {value!r}')


@contextlib.contextmanager
def recomputing(enabled: bool):
    """Around one layer's recompute: installed ``down_proj`` forwards skip their matmul."""
    before = _active[0]
    _active[0] = enabled
    try:
        yield
    finally:
        _active[0] = before


def install(templates: list[nn.Module], setting) -> list[str]:
    """Put the skipping forward on each eligible template's ``mlp.down_proj`` (``setting``
    "auto"); returns them as "template index:mlp.down_proj"."""
    validate_setting(setting)
    if setting is False:
        return []
    done = []
    for t, template in enumerate(templates):
        mlp = getattr(template, "mlp", None)
        down = getattr(mlp, "down_proj", None)
        if type(down) is not nn.Linear or isinstance(down.forward, SkipInRecompute):
            continue
        if not (_layer_ends_in_mlp_residual(template) and _mlp_returns_down_proj(mlp)):
            continue
        down.forward = SkipInRecompute(mlp, down, down.forward)
        done.append(f"{t}:mlp.down_proj")
    return done


class SkipInRecompute:
    """``down_proj.forward`` (set on the instance: ``__call__`` and its hooks unchanged)."""

    def __init__(self, mlp: nn.Module, down: nn.Linear, inner) -> None:
        self.mlp, self.down, self.inner = mlp, down, inner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down
        if not (
            _active[0]
            and torch.is_grad_enabled()
            and isinstance(x, torch.Tensor)
            and x.dim() >= 2
            and not _hooked(self.mlp)
            and not _hooked(down)
        ):
            return self.inner(x)
        weight, bias = down.weight, down.bias
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # the casts F.linear makes under autocast, outside
            dtype = torch.get_autocast_dtype(kind)  # the Function so autograd takes them back
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        skipped_calls[0] += 1
        with torch.autocast(kind, enabled=False):
            return _GradOnlyLinear.apply(x, weight, bias)


# torch's registries of ``register_module_forward_(pre_)hook``'s hooks (private names)
GLOBAL_HOOK_REGISTRIES = ("_global_forward_hooks", "_global_forward_pre_hooks")


def _hooked(module: nn.Module) -> bool:
    """Forward hooks on ``module``, or on every module (``register_module_forward_hook``). A torch
    without the global registries cannot say whether every module is hooked: hooked then (the
    recompute runs the linear, as without the skip; tests/drift.py fails on such a torch)."""
    from torch.nn.modules import module as torch_module

    if module._forward_hooks or module._forward_pre_hooks:
        return True
    return any(getattr(torch_module, name, True) for name in GLOBAL_HOOK_REGISTRIES)


class _GradOnlyLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``'s backward with a placeholder for its value."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        # as ATen's mm backward for linear's flattened mm(x2, weight.t()) (mm_mat1_backward,
        # mm_mat2_backward's branch for a column-major mat2): grad.mm(weight), grad.t().mm(x2)
        if ctx.needs_input_grad[0]:
            gx = g2.mm(weight).view(*x.shape)
        if ctx.needs_input_grad[1]:
            gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def _function_ast(fn) -> ast.FunctionDef | None:
    fn = getattr(fn, "inner", fn)  # tiling.TiledForward keeps the module's own forward
    fn = getattr(fn, "__func__", fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, ast.FunctionDef) else None


def _is_docstring(node) -> bool:
    """A string on its own (any other bare expression, an in-place op, counts as a statement)."""
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_self_call(node, attr: str) -> bool:
    """``self.<attr>(...)``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _layer_ends_in_mlp_residual(layer: nn.Module) -> bool:
    """The layer's forward ends ``h = self.mlp(h); h = residual + h; return h`` (any names)."""
    fn = _function_ast(type(layer).forward)
    body = [s for s in fn.body if not _is_docstring(s)] if fn else []
    if len(body) < 3:
        return False
    mlp, add, ret = body[-3:]
    if not (
        isinstance(mlp, ast.Assign)
        and len(mlp.targets) == 1
        and isinstance(mlp.targets[0], ast.Name)
        and _is_self_call(mlp.value, "mlp")
    ):
        return False
    h = mlp.targets[0].id
    return (
        isinstance(add, ast.Assign)
        and len(add.targets) == 1
        and isinstance(add.targets[0], ast.Name)
        and isinstance(add.value, ast.BinOp)
        and isinstance(add.value.op, ast.Add)
        and {type(add.value.left), type(add.value.right)} == {ast.Name}
        and h in (add.value.left.id, add.value.right.id)
        and add.value.left.id != add.value.right.id
        and isinstance(ret, ast.Return)
        and isinstance(ret.value, ast.Name)
        and ret.value.id == add.targets[0].id
    )


def _mlp_returns_down_proj(mlp: nn.Module) -> bool:
    """The MLP's forward (liger's when patched onto the instance) returns ``self.down_proj(...)``,
    directly or through one name assigned from it."""
    fn = _function_ast(mlp.forward)
    if fn is None or not fn.body or not isinstance(fn.body[-1], ast.Return):
        return False
    ret = fn.body[-1].value
    if _is_self_call(ret, "down_proj"):
        return True
    if not isinstance(ret, ast.Name) or len(fn.body) < 2:
        return False
    prev = fn.body[-2]
    return (
        isinstance(prev, ast.Assign)
        and [getattr(t, "id", None) for t in prev.targets] == [ret.id]
        and _is_self_call(prev.value, "down_proj")
    )
