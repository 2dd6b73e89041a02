"""The pipelined, double-buffered layer executor.

Every streamed layer's ``forward`` is rerouted here. In training, a layer call becomes one node of an
``autograd.Function`` whose forward runs the layer on streamed weights without building a graph (saving
only the layer input, the boundary activation) and whose backward re-runs the layer from that input and
takes a local ``autograd.grad`` with respect to [the slot's trainable region, the input]. So no autograd
graph spans layers, each layer crosses PCIe at most twice per step (forward, backward recompute), and the
layer gradient leaves the GPU as one flat tensor: one D2H burst per layer.

Slots are flat device buffers sized for the largest layer. While layer i computes in one slot, the next
layer of the current direction (i+1 in forward, i-1 in backward) loads into another. The last layers of a
forward are still in their slots when backward starts and are reused, not reloaded.
See [Note: stream and event ordering] in streams.py for every record and wait below.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from .host_state import HostLayerStore
from .model_map import LayerLayout, has_active_dropout, make_template, per_layer_attributes
from .timing import StepTimer


@dataclass(slots=True, eq=False)  # identity, not tensor comparison
class Slot:
    """A device buffer holding one layer's wire weights, with the events that guard it."""

    buf: torch.Tensor  # compute dtype; the templates' parameters are views of it
    stage: torch.Tensor | None = None  # wire dtype, when it differs (fp32 master streamed, cast on GPU)
    layer: int = -1
    version: int = -1
    ready: object = None  # recorded on h2d after the copy into buf
    free: object = None  # recorded on compute after the last kernel reading buf
    last_use: int = 0


@dataclass(slots=True)
class LayerCall:
    """What a layer call needs to be replayed in backward (non-tensor payload of the Function)."""

    index: int
    args: tuple
    kwargs: dict
    rng_state: tuple | None = None
    extras: tuple = field(default_factory=tuple)  # non-primary outputs of the layer, if it returns a tuple


class StreamedLayers:
    """Runs the streamed layers of one model. Owns the slots, the templates and the gradient landing."""

    def __init__(self, layers: nn.ModuleList, layouts: list[LayerLayout], store: HostLayerStore,
                 device: torch.device, streams, worker: ThreadPoolExecutor, num_slots: int = 2,
                 compute_dtype: torch.dtype | None = None) -> None:
        if num_slots < 2:
            raise ValueError(f"megatrain.num_slots must be >= 2 for double buffering, got {num_slots}")
        self.layouts, self.store, self.device = layouts, store, device
        self.streams, self.worker = streams, worker
        self.templates: list[nn.Module] = []
        self.template_of: list[int] = []
        by_signature: dict[tuple, int] = {}
        for layer, layout in zip(layers, layouts):
            key = (type(layer), layout.signature())
            if key not in by_signature:
                by_signature[key] = len(self.templates)
                self.templates.append(make_template(layer, device))
            self.template_of.append(by_signature[key])
        self.layers = list(layers)  # the model's own modules: their train/eval flag drives the templates
        self.overlays: list[list] = [[] for _ in layers]  # per-layer scalar attributes set on the template
        for t, template in enumerate(self.templates):
            members = [i for i, g in enumerate(self.template_of) if g == t]
            for i, overlay in zip(members, per_layer_attributes(template, [self.layers[i] for i in members])):
                self.overlays[i] = overlay
        self.buffers = [{n: b.to(device) for n, b in layer.named_buffers()} for layer in layers]
        self.dropout = [has_active_dropout(layer) for layer in layers]
        max_numel = max(l.numel for l in layouts)
        compute_dtype = compute_dtype or store.wire_dtype
        staged = compute_dtype != store.wire_dtype
        self.slots = [Slot(torch.empty(max_numel, dtype=compute_dtype, device=device),
                           torch.empty(max_numel, dtype=store.wire_dtype, device=device) if staged else None)
                      for _ in range(min(num_slots, len(layouts)))]
        self.version = [0] * len(layouts)  # bumped when the optimizer rewrites a layer's wire copy
        self.wire_ready: list[Future | None] = [None] * len(layouts)  # optimizer task of the layer
        self.wire_read: list[object] = [None] * len(layouts)  # last H2D event reading the wire copy
        self.has_grad = [False] * len(layouts)
        self.sq_norm: list[Future | None] = [None] * len(layouts)
        self.device_state = None  # DeviceOptimizerState: leading layers whose optimizer state lives on the GPU
        self.backward_done = None  # event on compute after the last backward (device-state updates wait on it)
        self.activations = None  # HostActivations when layer inputs are kept in host memory
        # per-layer gradient norms taken on the GPU (GA 1, device-state layers) and their pinned host landing
        self.norm_dev = torch.zeros(len(layouts), dtype=torch.float32, device=device)
        self.norm_host = torch.zeros(len(layouts), dtype=torch.float32)
        if device.type == "cuda":
            self.norm_host = self.norm_host.pin_memory()
        self.final_micro = True  # set by the engine: this backward closes the accumulation window
        self.trace: list[tuple] | None = None  # (op, layer, slot) when tracing is on
        self.timer = StepTimer(streams, enabled=False)  # the engine installs its own
        self._tick = 0
        self._anchor = torch.zeros((), requires_grad=True)
        for i, layer in enumerate(layers):
            layer.forward = _make_layer_forward(self, i)

    # --- slots -------------------------------------------------------------------------------------
    def _find(self, i: int) -> Slot | None:
        for slot in self.slots:
            if slot.layer == i and slot.version == self.version[i]:
                return slot
        return None

    def _load(self, i: int, busy: Slot | None) -> Slot:
        """Issue the H2D copy of layer i into the least recently used slot other than ``busy``."""
        slot = min((s for s in self.slots if s is not busy), key=lambda s: s.last_use)
        pending = self.wire_ready[i]
        if pending is not None and not pending.done():
            with self.timer.host_span("wait_for_optimizer_s"):
                pending.result()  # CPU-side wait for the optimizer's update of layer i (see the Note)
        elif pending is not None:
            pending.result()  # re-raises an optimizer error, if any
        wire = self.store.wire_of(i)
        st = self.streams
        st.wait(st.h2d, slot.free)  # do not overwrite weights a kernel may still read
        n = wire.numel()
        with st.on(st.h2d), self.timer.span("h2d", st.h2d):
            if self.device_state is not None and self.device_state.owns(i):  # device master: a cast, no PCIe
                slot.buf[:n].copy_(self.device_state.master_of(i))
            elif slot.stage is None:
                slot.buf[:n].copy_(wire, non_blocking=True)
            else:  # fp32 master over PCIe, cast to the compute dtype on the GPU (same stream: ordered)
                slot.stage[:n].copy_(wire, non_blocking=True)
                slot.buf[:n].copy_(slot.stage[:n])
        slot.ready = st.record(st.h2d)
        self.wire_read[i] = slot.ready
        slot.layer, slot.version, slot.free = i, self.version[i], None
        self._tick += 1
        slot.last_use = self._tick
        self._log("h2d", i, slot)
        return slot

    def _acquire(self, i: int, step: int) -> Slot:
        """Slot holding layer i, ready for compute; also prefetches layer i+step into another slot."""
        slot = self._find(i) or self._load(i, busy=None)
        self._tick += 1
        slot.last_use = self._tick
        nxt = i + step
        if 0 <= nxt < len(self.layouts) and self._find(nxt) is None:
            self._load(nxt, busy=slot)
        self.streams.wait(self.streams.compute(), slot.ready)
        return slot

    def _release(self, slot: Slot) -> None:
        slot.free = self.streams.record(self.streams.compute())

    def _bind(self, i: int, slot: Slot, trainable_leaf: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Parameter views of layer i into ``slot`` (zero-copy), plus the layer's buffers."""
        layout = self.layouts[i]
        buf = slot.buf
        train = trainable_leaf if trainable_leaf is not None else buf[:layout.n_train]
        frozen = buf[layout.n_train:layout.numel]
        params = {s.name: (train if s.trainable else frozen)[s.offset:s.offset + s.numel].view(s.shape)
                  for s in layout.slots}
        params.update(self.buffers[i])
        return params

    def _log(self, op: str, i: int, slot: Slot | None) -> None:
        if self.trace is not None:
            self.trace.append((op, i, None if slot is None else self.slots.index(slot)))

    # --- forward / backward ------------------------------------------------------------------------
    def _template(self, i: int) -> nn.Module:
        template = self.templates[self.template_of[i]]
        if template.training != self.layers[i].training:  # engine.train()/eval() reach the model's layers
            template.train(self.layers[i].training)
        for module, name, value in self.overlays[i]:  # e.g. layer_idx, sliding_window of layer i
            setattr(module, name, value)
        return template

    def run_forward(self, call: LayerCall, hidden: torch.Tensor, save_rng: bool):
        i = call.index
        slot = self._acquire(i, step=+1)
        template = self._template(i)
        if save_rng and self.dropout[i] and template.training:
            call.rng_state = _get_rng_state(self.device)
        with self.timer.span("compute", self.streams.compute()):
            out = functional_call(template, self._bind(i, slot, None), (hidden, *call.args), call.kwargs)
        self._release(slot)
        self._log("fwd", i, slot)
        return out

    def run_backward(self, call: LayerCall, hidden: torch.Tensor, grad_out: torch.Tensor,
                     need_input_grad: bool) -> torch.Tensor | None:
        i, layout = call.index, self.layouts[call.index]
        slot = self._acquire(i, step=-1)
        if self.activations is not None:
            self.activations.prefetch(i - 1)  # the next backward layer's input loads while i recomputes
        template = self._template(i)
        with torch.enable_grad(), self.timer.span("compute", self.streams.compute()):
            train_leaf = None
            wrt = []
            if layout.n_train:
                train_leaf = slot.buf[:layout.n_train].detach().requires_grad_(True)
                wrt.append(train_leaf)
            x = hidden.detach().requires_grad_(need_input_grad)
            if need_input_grad:
                wrt.append(x)
            with _replay_rng(call.rng_state, self.device):
                out = functional_call(template, self._bind(i, slot, train_leaf), (x, *call.args), call.kwargs)
            primary = out if isinstance(out, torch.Tensor) else out[0]
            grads = torch.autograd.grad(primary, wrt, grad_out) if wrt else ()
        self._release(slot)
        self._log("bwd", i, slot)
        if layout.n_train:
            self._evacuate(i, grads[0])
        return grads[-1] if need_input_grad else None

    # --- gradient landing --------------------------------------------------------------------------
    def _evacuate(self, i: int, flat_grad: torch.Tensor) -> None:
        """D2H layer i's flat gradient; the host worker accumulates it and (if final) takes its norm."""
        st, store = self.streams, self.store
        first, final = not self.has_grad[i], self.final_micro
        slab = None  # a landing slab of the ring (GA > 1), returned to the ring by the fold
        if self.device_state is not None and self.device_state.owns(i):
            return self._accumulate_on_device(i, flat_grad, first, final)
        if store.grad_direct:
            if not first:
                raise RuntimeError(
                    "a second backward() before step() with gradient_accumulation_steps=1: set "
                    "gradient_accumulation_steps in the config so gradients are accumulated in fp32")
            dest = store.grad_of(i)
            if final:  # GA 1: the gradient is final as it leaves the GPU, so its norm is taken there
                torch.linalg.vector_norm(flat_grad, dtype=torch.float32, out=self.norm_dev[i])
            if dest.dtype != flat_grad.dtype:
                flat_grad = flat_grad.to(dest.dtype)  # fp32 landing: convert on the GPU, not the host
        else:
            slab = store.ring.get()  # blocks only if the worker is 4 layers behind
            dest = slab[:flat_grad.numel()]
        grad_ready = st.record(st.compute())
        st.wait(st.d2h, grad_ready)
        with st.on(st.d2h), self.timer.span("d2h", st.d2h):
            dest.copy_(flat_grad, non_blocking=True)
            if store.grad_direct and final:
                self.norm_host[i:i + 1].copy_(self.norm_dev[i:i + 1], non_blocking=True)
        st.hand_over(flat_grad, st.d2h)
        landed = st.record(st.d2h)
        self.has_grad[i] = True
        self._log("d2h", i, None)
        self.sq_norm[i] = self.worker.submit(self._land, i, landed, dest, slab, first, final)

    def _accumulate_on_device(self, i: int, flat_grad: torch.Tensor, first: bool, final: bool) -> None:
        """Tail layer: the gradient stays on the GPU (fp32 accumulator); only its norm goes to the host."""
        st, grad = self.streams, self.device_state.grad_of(i)
        if first:
            grad.copy_(flat_grad)
        else:
            grad.add_(flat_grad)
        self.has_grad[i] = True
        self._log("acc", i, None)
        if not final:
            self.sq_norm[i] = self.worker.submit(lambda: None)
            return
        torch.linalg.vector_norm(grad, out=self.norm_dev[i])
        st.wait(st.d2h, st.record(st.compute()))
        with st.on(st.d2h):
            self.norm_host[i:i + 1].copy_(self.norm_dev[i:i + 1], non_blocking=True)
        landed = st.record(st.d2h)
        self.sq_norm[i] = self.worker.submit(self._land_norm, i, landed)

    def _land_norm(self, i: int, landed) -> float:
        landed.synchronize()
        return float(self.norm_host[i]) ** 2

    def _land(self, i: int, landed, dest: torch.Tensor, slab, first: bool, final: bool):
        """Worker thread: wait for the D2H, fold the bytes into the layer's gradient, return its sq-norm."""
        landed.synchronize()
        with self.timer.host_span("landing_s"):
            sq = self._fold(i, dest, first, final)
        if slab is not None:
            self.store.ring.put(slab)  # only now may a later D2H overwrite it
        return sq

    def _fold(self, i: int, dest: torch.Tensor, first: bool, final: bool):
        store = self.store
        if store.grad_direct:
            return float(self.norm_host[i]) ** 2 if final else None
        grad = store.grad_of(i)
        if first:
            grad.copy_(dest)
        else:  # bf16 + fp32 in one add_ is 5x slower than a converting copy and an fp32 add on the CPU
            grad.add_(store.scratch[:grad.numel()].copy_(dest) if dest.dtype != grad.dtype else dest)
        return float(torch.dot(grad, grad)) if final else None

    def reset_window(self) -> None:
        self.has_grad = [False] * len(self.layouts)
        self.sq_norm = [None] * len(self.layouts)


def _make_layer_forward(executor: StreamedLayers, index: int):
    def forward(hidden_states, *args, **kwargs):
        return _layer_forward(executor, index, hidden_states, args, kwargs)
    return forward


def _layer_forward(executor: StreamedLayers, i: int, hidden: torch.Tensor, args: tuple, kwargs: dict):
    call = LayerCall(i, args, kwargs)
    if not torch.is_grad_enabled():
        return executor.run_forward(call, hidden, save_rng=False)
    for value in (*args, *kwargs.values()):
        leaves = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            raise NotImplementedError(
                f"layer {i} was called with an extra tensor argument that requires grad; megatrain_ds "
                "propagates gradients only through the hidden states of a streamed block")
    out = _StreamedLayerFn.apply(executor._anchor, hidden, executor, call)
    return out if not call.extras else (out, *call.extras)


class _StreamedLayerFn(torch.autograd.Function):
    """One streamed layer as one autograd node: saves its input, recomputes in backward."""

    @staticmethod
    def forward(ctx, anchor, hidden, executor, call):
        out = executor.run_forward(call, hidden, save_rng=True)
        if not isinstance(out, torch.Tensor):
            call.extras = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in out[1:])
            out = out[0]
        ctx.executor, ctx.call = executor, call
        if executor.activations is not None:  # the input goes to pinned host memory (activations.py)
            executor.activations.save(call.index, hidden)
        else:
            ctx.save_for_backward(hidden)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.executor.activations is not None:
            hidden = ctx.executor.activations.load(ctx.call.index)
        else:
            (hidden,) = ctx.saved_tensors
        grad_in = ctx.executor.run_backward(ctx.call, hidden, grad_out, ctx.needs_input_grad[1])
        return None, grad_in, None, None


def _get_rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _replay_rng:
    """Context manager: run with the RNG state captured at forward time, then restore the current one."""

    def __init__(self, state: tuple | None, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self):
        if self.state is None:
            return
        self.saved = _get_rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc):
        if self.state is None:
            return
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)
