"""The GPU side of ``megatrain-ds plan`` (plan.py): what one step's working set takes, measured
without a GPU.

Each distinct decoder layer runs on the meta device the way the executor runs it (the template, the
saved input, recompute + backward), under ``_LiveBytes``, a dispatch mode that tracks every tensor
allocated and freed; the live total at each moment is linear in the micro-batch, so runs at
micro-batch 1 and 2 give the peak at any micro-batch (``LayerTimeline``). Kernels that allocate
differently on a GPU than their meta twins are emulated from shapes: flash attention (output and
log-sum-exp saved, an fp32 accumulator in its backward), liger-kernel's RMSNorm, SwiGLU and RoPE,
autograd's in-place gradient accumulation, and liger's fused loss by its chunking rule.
``ActivationModel`` puts the layers, the final norm and the loss together for
capacity.check_capacity.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import types
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..model import LayerLayout

MiB = 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_size(name: str) -> int:
    return 4 if name == "fp32" else 2


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


# -------------------------------------------------------------------------------- measuring on meta
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1: not in a backward


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of tensor storage alive now and at the peak, for every storage an op creates while the
    mode is on (meta tensors included): a storage counts from the op that made it until the last
    tensor viewing it is gone. Storages of ``existing`` tensors (inputs made before) never count.

    Autograd adds a second gradient into the first in place (``InputBuffer::accumulate``) on real
    devices but not on meta: such an add (in a backward, grad mode off, same shape and dtype) is
    counted as in place."""

    def __init__(self, existing=()) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.ignored = {t.untyped_storage()._cdata for t in existing if isinstance(t, torch.Tensor)}
        self.now = self.peak = 0
        # ``now`` after each new storage: the peak is at one of these moments
        self.timeline: list[int] = []

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes or key in self.ignored:
            return
        n = storage.nbytes()
        self.sizes[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        self.timeline.append(self.now)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten.add.Tensor
            and not torch.is_grad_enabled()
            and _graph_task_id() != -1
            and isinstance(args[1], torch.Tensor)
            and args[0].shape == args[1].shape == out.shape
            and args[0].dtype == out.dtype
        ):
            first = args[0].untyped_storage()._cdata
            if first in self.sizes:  # the sum takes the first gradient's place: stop counting it
                self.now -= self.sizes.pop(first)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in torch.utils._pytree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class _FlashLike(torch.autograd.Function):
    """What flash attention allocates (shapes only): forward output + fp32 log-sum-exp, saved with
    q, k, v; backward dq, dk, dv (per query head first, then summed, with grouped KV heads) and its
    fp32 dq accumulator."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, s, _ = q.shape
        # (b, s, h, d) underneath, as flash writes it
        out = q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(b, h, s, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, s, d = q.shape
        rounded = -(-s // 128) * 128
        accum = q.new_empty(b, rounded, h, -(-d // 8) * 8, dtype=torch.float32)  # dq accumulator
        softmax_d = q.new_empty(b, h, rounded, dtype=torch.float32)
        dq = q.new_empty(b, s, h, d).transpose(1, 2)
        if k.shape[1] != h:  # grouped KV heads: per query head, then summed over the group
            dk = (
                q.new_empty(b, k.shape[2], h, k.shape[3])
                .view(b, k.shape[2], k.shape[1], -1, k.shape[3])
                .sum(3)
                .transpose(1, 2)
            )
            dv = (
                q.new_empty(b, v.shape[2], h, v.shape[3])
                .view(b, v.shape[2], v.shape[1], -1, v.shape[3])
                .sum(3)
                .transpose(1, 2)
            )
        else:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
        del accum, softmax_d
        return dq, dk, dv


class _RmsNormLike(torch.autograd.Function):
    """liger-kernel's RMSNorm: saves its input and fp32 1/rms per row; backward writes dX into dY
    (in place) and reduces dW from per-SM fp32 partials."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        # one row per SM (H100: 132)
        partial = weight.new_empty(132, weight.numel(), dtype=torch.float32)
        return dy, partial.sum(0).to(weight.dtype).view(weight.shape)


class _SiluMulLike(torch.autograd.Function):
    """liger-kernel's SwiGLU: saves a and b; backward writes da, db into them (nothing new)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        return a, b


class _RopeLike(torch.autograd.Function):
    """liger-kernel's RoPE: rotates q and k in place (views come back, nothing new); so does its
    backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, dq, dk):
        return dq, dk, None, None, None, None


@contextlib.contextmanager
def _meta_kernels(flash: bool):
    """While running on meta: sdpa without a mask as flash attention would run (``_FlashLike``), and
    liger-kernel's RoPE (a module-level patch of the model's code once an engine applied liger in
    this process) as ``_RopeLike``: its Triton kernel cannot run on meta."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if attn_mask is None:
            return _FlashLike.apply(query, key, value)
        return original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    rope_module = None
    if liger_installed():
        try:
            import liger_kernel.transformers.rope as rope_module
        except Exception:
            rope_module = None
    rope = getattr(rope_module, "LigerRopeFunction", None)
    # liger >= 0.8 dispatches its RoPE through a backend registry, not LigerRopeFunction: replace
    # the function the model's code calls (a module-level ``apply_rotary_pos_emb`` that liger's
    # patch pointed at its own)
    patched = []
    for module in list(sys.modules.values()):
        fn = getattr(module, "apply_rotary_pos_emb", None) if module is not None else None
        if callable(fn) and str(getattr(fn, "__module__", "")).startswith("liger_kernel"):
            patched.append((module, fn))
            module.apply_rotary_pos_emb = _meta_rope
    if flash:
        F.scaled_dot_product_attention = sdpa
    if rope is not None:
        rope_module.LigerRopeFunction = _RopeLike
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        if rope is not None:
            rope_module.LigerRopeFunction = rope
        for module, fn in patched:
            module.apply_rotary_pos_emb = fn


def _meta_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, **kwargs):
    """liger's RoPE on meta (in place on q and k, as its Triton kernel: nothing new is
    allocated)."""
    return _RopeLike.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


def _liger_norm_forward(self, x):
    return _RmsNormLike.apply(x, self.weight)


def _liger_swiglu_forward(self, x):
    return self.down_proj(_SiluMulLike.apply(self.gate_proj(x), self.up_proj(x)))


# they say they are liger's, so tiling.py leaves these norms alone as it leaves liger's
# (tiling._is_liger)
_liger_norm_forward.__module__ = _liger_swiglu_forward.__module__ = (
    "liger_kernel (as emulated by megatrain_ds.plan)"
)


def _liger_like(root: nn.Module, everywhere: bool = True) -> None:
    """Give ``root``'s RMSNorm and SwiGLU MLP submodules liger-kernel's memory behaviour, bound on
    each instance as liger binds its forwards (a deep copy, such as the executor's template, rebinds
    them to the copy). ``everywhere`` False: only modules that are liger's already (liger also
    replaces the model's classes, so models built after an engine applied it in this process have
    them; their Triton kernels cannot run on meta)."""
    for module in root.modules():
        name = type(module).__name__
        if not everywhere and not name.startswith("Liger"):
            continue
        if name.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor):
            module.forward = types.MethodType(_liger_norm_forward, module)
        elif all(hasattr(module, k) for k in ("gate_proj", "up_proj", "down_proj")) and (
            "SwiGLU" in name
            or type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        ):
            module.forward = types.MethodType(_liger_swiglu_forward, module)


def _as_engine_runs_it(layer: nn.Module, liger: bool, tiled_mlp) -> nn.Module:
    """The executor's template of ``layer`` (model_map.make_template: a copy, parameters on meta),
    with liger-kernel's kernels (engine_build.apply_liger_kernels patches the model before the
    templates are made) and the tiled MLP (engine: tiling.apply_tiling on the templates)."""
    from ..model import make_template

    template = make_template(layer, torch.device("meta"))
    if liger:
        _liger_like(template)
    if tiled_mlp is not False and tiled_mlp is not None:
        try:
            from ..model import apply_tiling
        except ImportError:  # a checkout without tiling.py
            return template
        apply_tiling([template], tiled_mlp)
    return template


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device (weights are never copied: each parameter is
    pre-seeded in the memo with a meta tensor, as model_map.make_template does); the same parameter
    order, the same ties."""
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo).to("meta")


class _Stop(Exception):
    pass


def _capture_layer_calls(
    model: nn.Module, layers: nn.ModuleList, batch: int, seq: int, need: set[int] | None = None
) -> dict[int, tuple]:
    """Run the (meta) model's forward on (batch, seq) token ids without grad, recording what each
    streamed layer is called with: index -> (hidden states, other positional args, kwargs). Stops
    once the layers in ``need`` (default: all) are recorded."""
    need = set(range(len(layers))) if need is None else set(need)
    try:
        import transformers.masking_utils as masking
    except ImportError:  # an older transformers (or a plain model without it)
        masking = None
    calls: dict[int, tuple] = {}
    # instance forwards there before: put back after
    own = [layer.__dict__.get("forward") for layer in layers]
    for i, layer in enumerate(layers):
        original = own[i] or type(layer).forward.__get__(layer)

        def record(*args, _i=i, _original=original, **kwargs):
            hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
            calls[_i] = (hidden, rest, kwargs)
            if need <= calls.keys():
                raise _Stop
            return _original(hidden, *rest, **kwargs)

        layer.forward = record
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # transformers checks the position ids for packed sequences with a data-dependent .all(): not on
    # meta
    packed = getattr(masking, "find_packed_sequence_indices", None) if masking is not None else None
    if packed is not None:
        masking.find_packed_sequence_indices = lambda *a, **k: None
    try:
        with torch.no_grad(), _meta_kernels(True):
            try:
                model(input_ids=ids, use_cache=False)
            except TypeError as exc:
                if "unexpected keyword" not in str(exc):
                    raise
                model(ids)
    except _Stop:
        pass
    finally:
        if packed is not None:
            masking.find_packed_sequence_indices = packed
        for layer, forward in zip(layers, own):
            layer.__dict__.pop("forward", None)
            if forward is not None:
                layer.forward = forward
    if not need <= calls.keys():
        raise RuntimeError(
            f"the model's forward did not call streamed layer(s) {sorted(need - calls.keys())}"
        )
    return calls


@dataclass(slots=True)
class LayerCosts:
    """Measured device bytes of one layer call at one micro-batch (see ``_measure_layer``)."""

    forward: int  # peak of a no-grad forward (its output included)
    graph: int  # alive after a grad forward (the graph a kept layer holds, its output included)
    # peak of the recompute + autograd.grad w.r.t. [trainable slot region, shared, input]
    backward: int
    # alive when autograd.grad returned (the gradients, the outputs): when the executor evacuates
    after: int


@dataclass(slots=True)
class LayerTimeline:
    """Live bytes after each allocation of a layer's no-grad forward and of its recompute +
    backward, and the bytes alive after the grad forward and after the backward."""

    forward: list[int]
    graph: int
    backward: list[int]
    after: int

    def costs(self) -> LayerCosts:
        return LayerCosts(
            max(self.forward, default=0), self.graph, max(self.backward, default=0), self.after
        )


def _peak_at(one: list[int], two: list[int], steps: int) -> int | None:
    """The peak ``steps`` micro-batches past the run of ``one``, from the timelines of two runs one
    micro-batch apart: every tensor's size is a + b * c (batch-sized or not), so is the live total
    at each moment; the peak is the largest moment. None when the two runs allocated differently
    (then measure)."""
    if len(one) != len(two):
        return None
    return max((x + steps * (y - x) for x, y in zip(one, two)), default=0)


def _measure_layer(
    layer: nn.Module,
    layout: LayerLayout,
    call: tuple,
    dtype: torch.dtype,
    flash: bool,
    liger: bool,
    tiled_mlp=False,
) -> LayerTimeline:
    """One layer as the executor runs it (its template, ``_bind``/``_leaves``/``run_backward``), on
    meta, under ``_LiveBytes``."""
    from torch.func import functional_call

    hidden, args, kwargs = call
    if liger or tiled_mlp is not False:  # else ``layer`` is the template already
        layer = _as_engine_runs_it(layer, liger, tiled_mlp)
    flat = torch.empty(layout.numel, dtype=dtype, device="meta")
    by_name = dict(layer.named_parameters(remove_duplicate=False))
    buffers = dict(layer.named_buffers())

    def bind(train_leaf, shared):
        train = train_leaf if train_leaf is not None else flat[: layout.n_train]
        frozen = flat[layout.n_train : layout.numel]
        params = {
            s.name: (train if s.trainable else frozen)[s.offset : s.offset + s.numel].view(s.shape)
            for s in layout.slots
        }
        params.update(shared)
        params.update(buffers)
        return params

    x0 = torch.empty(hidden.shape, dtype=dtype, device="meta")
    grad_out = torch.empty_like(x0)
    existing = [
        flat,
        x0,
        grad_out,
        *by_name.values(),
        *buffers.values(),
        *torch.utils._pytree.tree_leaves((args, kwargs)),
    ]
    shared0 = {n: by_name[n] for n in layout.shared}
    with _meta_kernels(flash):
        live = _LiveBytes(existing)
        with torch.no_grad(), live:
            out = functional_call(layer, bind(None, shared0), (x0, *args), kwargs)
            del out
        forward = live.timeline
        live = _LiveBytes(existing)
        with torch.enable_grad(), live:
            train_leaf = (
                flat[: layout.n_train].detach().requires_grad_(True) if layout.n_train else None
            )
            shared = {
                n: p.detach().requires_grad_(True) for n, p in shared0.items() if p.requires_grad
            }
            x = x0.detach().requires_grad_(True)
            out = functional_call(
                layer, bind(train_leaf, {**shared0, **shared}), (x, *args), kwargs
            )
            primary = out if isinstance(out, torch.Tensor) else out[0]
            graph = live.now
            wrt = (
                ([train_leaf] if train_leaf is not None else [])
                + list(dict.fromkeys(shared.values()))
                + [x]
            )
            grads = torch.autograd.grad(
                [primary], wrt, [grad_out], allow_unused=True, materialize_grads=True
            )
            # run_backward still holds the outputs and the gradients while it evacuates
            after = live.now
            del out, primary, grads
        return LayerTimeline(forward, graph, live.timeline, after)


def liger_loss_bytes(
    tokens: int, hidden: int, vocab: int, c: int, head_trainable: bool
) -> tuple[int, int, int]:
    """(forward peak, saved after forward, backward peak) of liger-kernel's fused linear
    cross-entropy: the input gradient (compute dtype) and an fp32 head-gradient accumulator made in
    forward, the loss per token (fp32) and one chunk of logits (chunk rows x vocab, compute dtype;
    chunk = next power of two of tokens / ceil(vocab / hidden)); backward hands autograd the fp32
    head gradient, which it casts to the compute dtype."""
    inc = -(-vocab // hidden)
    chunk = min(_pow2(-(-tokens // inc)), tokens)
    saved = tokens * hidden * c + (4 * vocab * hidden if head_trainable else 0)
    # + loss_1d + target mask + logits chunk
    forward = saved + 4 * tokens + tokens + chunk * vocab * c
    backward = saved + (c * vocab * hidden if head_trainable else 0)
    return forward, saved, backward


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


class ActivationModel:
    """The step's device working set as a function of the micro-batch, for one model at one sequence
    length.

    ``model``: a copy on the meta device (``meta_twin``), which this changes (dtype, liger's
    forwards). The streamed layers' call arguments are captured from a meta forward, and each
    distinct layer (type + layout) is measured as the executor runs it. Every tensor has the batch
    as a dimension or none, so the live total at each moment of a layer call is linear in the
    micro-batch (within one tiling regime: tiling.py's chunk count): the timelines at the first two
    micro-batches of the regime give the peak at any micro-batch. The final norm is measured at each
    micro-batch; torch's chunked loss at two chunk-aligned token counts (every further chunk
    allocates alike); liger's fused loss is computed."""

    chunk_rows = 0  # megatrain.loss_chunk_rows (set by the planner)

    def __init__(
        self,
        model: nn.Module,
        block_name: str,
        layouts: list[LayerLayout],
        seq: int,
        compute: str,
        *,
        gpu: bool,
        liger_kernels: bool,
        loss: str,
        fused_parts,
        trainable_ids: set[int],
        tiled_mlp=False,
    ) -> None:
        self.seq, self.compute = seq, compute
        self.dtype = DTYPES[compute]
        self.c = dtype_size(compute)
        self.gpu, self.liger_kernels, self.loss, self.tiled_mlp = (
            gpu,
            liger_kernels,
            loss,
            tiled_mlp,
        )
        self.layouts = layouts
        meta = model.to(self.dtype).train()  # the engine trains the model in train mode
        # engine_build.apply_liger_kernels patches the model instance
        _liger_like(meta, everywhere=liger_kernels)
        self.model = meta
        layers = meta.get_submodule(block_name)
        self.layers = layers
        # flash attention on a GPU in bf16/fp16; fp32 with grouped KV heads falls back to the math
        # kernel there
        self.flash = not (compute == "fp32" and gpu and _grouped_kv(meta))
        groups: dict[tuple, list[int]] = {}
        for i, (layer, layout) in enumerate(zip(layers, layouts)):
            groups.setdefault((type(layer), layout.signature()), []).append(i)
        self.groups = list(groups.values())
        self.templates = [_as_engine_runs_it(layers[g[0]], False, tiled_mlp) for g in self.groups]
        self._calls: dict[int, dict] = {}
        self._timelines: dict[tuple[int, int], LayerTimeline] = {}
        one = self.calls(1)[0]
        self.hidden_numel = one[0].numel()  # one sequence's layer input (tokens x hidden)
        self.hidden_size = one[0].shape[-1]
        self.norm = _final_norm(meta, block_name)
        self.head, self.embedding = fused_parts if fused_parts else (None, None)
        self.head_trainable = self.head is not None and id(self.head.weight) in trainable_ids
        self.embedding_trainable = (
            self.embedding is not None and id(self.embedding.weight) in trainable_ids
        )
        self.tied = (
            self.head is not None
            and self.embedding is not None
            and self.head.weight is self.embedding.weight
        )
        self._loss_cache: dict[int, tuple[int, int, int]] = {}
        self._norm_cache: dict[int, int] = {}

    def calls(self, b: int) -> dict[int, tuple]:
        if b not in self._calls:
            self._calls[b] = _capture_layer_calls(
                self.model, self.layers, b, self.seq, need={0, *(g[0] for g in self.groups)}
            )
        return self._calls[b]

    def _regime(self, g: int, b: int) -> tuple:
        """How tiling.py splits group ``g``'s calls at micro-batch ``b``: each tiled module's (rows
        per chunk, chunks) (None: whole). Within one regime every live total is linear in the
        micro-batch (the last chunk grows)."""
        try:
            from ..model import TiledForward, chunk_rows
        except ImportError:
            return ()
        rows = b * self.hidden_numel // self.hidden_size
        out = []
        for module in self.templates[g].modules():
            tf = module.__dict__.get("forward")
            if isinstance(tf, TiledForward):
                row_bytes = (
                    self.hidden_size * 4
                    if tf.kind == "norm"
                    else (tf.width or self.hidden_size) * self.c
                )
                chunk = chunk_rows(tf.setting, rows, row_bytes)
                out.append(None if chunk is None else (chunk, -(-rows // chunk)))
        return tuple(out)

    def _timeline(self, g: int, b: int) -> LayerTimeline:
        if (g, b) not in self._timelines:
            i = self.groups[g][0]
            self._timelines[g, b] = _measure_layer(
                self.templates[g],
                self.layouts[i],
                self.calls(b)[i],
                self.dtype,
                self.flash,
                False,
                False,
            )
        return self._timelines[g, b]

    def _group_cost(self, g: int, b: int) -> LayerCosts:
        """Group ``g``'s costs at micro-batch ``b``, from the timelines at the first two
        micro-batches of b's tiling regime (1 and 2 untiled) when they allocated alike, else
        measured at b."""
        regime = self._regime(g, b)
        first, hi = 1, b  # regimes are ordered: untiled, then tiled in 2, 3, ... chunks
        while first < hi:
            mid = (first + hi) // 2
            first, hi = (first, mid) if self._regime(g, mid) == regime else (mid + 1, hi)
        if b - first >= 2 and self._regime(g, first + 1) == regime:
            one, two = self._timeline(g, first), self._timeline(g, first + 1)
            steps = b - first
            forward, backward = (
                _peak_at(one.forward, two.forward, steps),
                _peak_at(one.backward, two.backward, steps),
            )
            if forward is not None and backward is not None:
                return LayerCosts(
                    forward,
                    one.graph + steps * (two.graph - one.graph),
                    backward,
                    one.after + steps * (two.after - one.after),
                )
        return self._timeline(g, b).costs()

    def layer_costs(self, b: int) -> list[LayerCosts]:
        """Per streamed layer, at micro-batch ``b``."""
        out: list[LayerCosts | None] = [None] * len(self.layouts)
        for g, members in enumerate(self.groups):
            cost = self._group_cost(g, b)
            for i in members:
                out[i] = cost
        return out

    def input_bytes(self, b: int) -> int:
        """One layer's saved input (compute dtype)."""
        return b * self.hidden_numel * self.c

    def call_arg_bytes(self, b: int) -> int:
        """The layer-call arguments the forward made (rotary tables, masks): alive for the step
        (LayerCall keeps them for the recompute). Linear in the micro-batch."""
        one, two = (_storage_bytes(self.calls(k)[0][1:]) for k in (1, 2))
        return one + (b - 1) * (two - one)

    def norm_graph(self, b: int) -> int:
        if self.norm is None:
            return 0
        if b not in self._norm_cache:
            x = torch.empty(
                b * self.hidden_numel // self.hidden_size,
                self.hidden_size,
                dtype=self.dtype,
                device="meta",
                requires_grad=True,
            )
            # (liger's, when it applies: see __init__)
            norm = _as_engine_runs_it(self.norm, False, False)
            weights = {n: torch.empty_like(p) for n, p in self.norm.named_parameters()}
            live = _LiveBytes([x, *weights.values()])
            with torch.enable_grad(), live:
                # alive while measured
                out = torch.func.functional_call(norm, weights, (x,))  # noqa: F841
                self._norm_cache[b] = live.now
                del out
        return self._norm_cache[b]

    def loss_bytes(self, b: int) -> tuple[int, int, int]:
        """(forward peak, saved after forward, backward peak) of the LM head + loss at micro-batch
        ``b``."""
        if self.head is None or self.loss == "none":
            return 0, 0, 0
        tokens = b * self.hidden_numel // self.hidden_size
        vocab, hidden = self.head.weight.shape
        if self.loss == "liger":
            f, s, k = liger_loss_bytes(tokens, hidden, vocab, self.c, self.head_trainable)
            targets = 8 * tokens  # the shifted labels (int64)
            return f + targets, s + targets, k + targets
        # loss.py's chunks: past one chunk, every chunk allocates alike and the rest is linear in
        # the tokens: two chunk-aligned runs give any count
        if self.loss == "torch":
            from ..model import default_chunk_rows

            rows = self.chunk_rows or default_chunk_rows(vocab)
            if tokens > 2 * rows:
                one, two = self._loss_at(2 * rows), self._loss_at(3 * rows)
                return tuple(x + (tokens - 2 * rows) * (y - x) // rows for x, y in zip(one, two))
        return self._loss_at(tokens)

    def _loss_at(self, tokens: int) -> tuple[int, int, int]:
        """The loss over ``tokens`` rows, measured on meta (the torch chunks of loss.py, or the
        model's own logits + ``ForCausalLMLoss``)."""
        if tokens in self._loss_cache:
            return self._loss_cache[tokens]
        vocab, hidden = self.head.weight.shape
        h = torch.empty(1, tokens, hidden, dtype=self.dtype, device="meta", requires_grad=True)
        w = torch.empty(
            vocab, hidden, dtype=self.dtype, device="meta", requires_grad=self.head_trainable
        )
        labels = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        live = _LiveBytes([h, w, labels])
        with torch.enable_grad(), live:
            if self.loss == "torch":
                from ..model import linear_cross_entropy

                loss = linear_cross_entropy(
                    h, w, None, labels, chunk_rows=self.chunk_rows, use_liger=False
                )
            else:  # the model's own forward: logits, then its loss function
                from transformers.loss.loss_utils import ForCausalLMLoss

                loss = ForCausalLMLoss(torch.nn.functional.linear(h, w), labels, vocab_size=vocab)
            forward, saved = live.peak, live.now
            grads = torch.autograd.grad(loss, [h, w] if self.head_trainable else [h])
            del grads, loss
        self._loss_cache[tokens] = (forward, saved, live.peak)
        return self._loss_cache[tokens]


def _grouped_kv(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads is not None and kv != heads


_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")


def _final_norm(model: nn.Module, block_name: str) -> nn.Module | None:
    """The decoder's final norm (a sibling of the block list with a usual name), or None."""
    parent_name = block_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    for name in _NORM_NAMES:
        module = getattr(parent, name, None)
        if isinstance(module, nn.Module):
            return module
    return None
