"""The pipelined, double-buffered layer executor.

Every streamed layer's ``forward`` is rerouted here. In training, a layer call becomes one node of
an ``autograd.Function`` (layer_call.py) whose forward runs the layer on streamed weights without
building a graph (saving only the layer input, the boundary activation) and whose backward re-runs
the layer from that input and takes a local ``autograd.grad`` with respect to [the slot's trainable
region, the input]. So no autograd graph spans layers, each layer crosses PCIe at most twice per
step (forward, backward recompute), and the layer gradient leaves the GPU as one flat tensor: one
D2H burst per layer (landing.py).

Slots are flat device buffers sized for the largest layer. While layer i computes in one slot, the
next layer of the current direction (i+1 in forward, i-1 in backward) loads into another. The last
layers of a forward are still in their slots when backward starts and are reused, not reloaded. See
[Note: stream and event ordering] in streams.py for every record and wait below.

[Note: kept layers] Recompute costs a quarter of a step's FLOPs. When GPU memory allows
(``set_keep``, sized by the engine from the first step's measured peak and the largest layer graph a
recompute built), the last ``n`` layers skip it: their training forward runs with grad on, into a
weight buffer of their own, and the Function keeps that graph (``LayerCall.graph``) for its
backward, which takes ``autograd.grad`` through it. The last layers because their backward comes
first: a graph is held for the shortest time and no weights are reloaded (their buffers still hold
them). A kept buffer is rewritten only when the layer's version changes, i.e. after the backward
that consumed its graph (``slot.free`` orders the H2D after that backward's kernels). Results equal
the recompute's: the same kernels on the same inputs, RNG consumed once.

[Note: weight cache] A layer whose graph does not fit may still keep its *weights* from its forward
to its backward (``set_weight_cache``): a buffer of its own in the compute dtype, a kept layer's
without the graph. Its recompute then reads them there, so it crosses PCIe once a step instead of
twice, for one layer's weights of GPU memory (a kept layer costs its graph as well). Which layers:
the trailing ones below the kept layers, less the last ``len(slots)`` of them (their backward finds
them still in the rotating slots), not the GPU-held ones (their load is a device cast); a count
set at initialize is chosen again when "auto" keeps layers or moves their state. The buffer is
rewritten when the layer's version changes, as a kept one's.
"""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.func import functional_call

from ..host import LayerStates
from .landing import GradientLanding, LandingListener
from ..model import (
    RecomputeCheck,
    autocast_as,
    autocast_state,
    get_rng_state,
    install_recompute_skip,
    recomputing,
    replay_rng,
    HOOK_DICTS,
    LayerLayout,
    has_tied_tensors,
    make_template,
    per_layer_attributes,
    submodule_pairs,
)
from .schedule import LayerSchedule
from .inference import InferenceCache
from .layer_call import (
    LayerCall,
    fresh_collector,
    function_outputs,
    make_layer_forward,
    positional_names,
)
from .slot import Slot
from .timing import StepTimer
from .timing import layer_range as _range  # a profiler range naming the phase and layer


def weight_cache_layers(
    n_layers: int, keep: Collection[int], slots: int, held: Collection[int], n: int
) -> list[int]:
    """The ``n`` layers a weight cache holds ([Note: weight cache]), the order it takes them in:
    the trailing layers not in ``keep``, less the last ``slots`` of them (the backward finds them
    still in the rotating slots) and the ``held`` (GPU-held) ones. The executor places by it and
    the planner counts by it."""
    free = [i for i in range(n_layers) if i not in keep]
    free = free[: max(0, len(free) - slots)]
    return [i for i in reversed(free) if i not in held][: max(0, int(n))]


class StreamedLayers(GradientLanding):
    """Runs the streamed layers of one model. Owns the slots, the templates and the gradient landing
    (its methods are landing.py's ``GradientLanding``)."""

    def __init__(
        self,
        layers: nn.ModuleList,
        layouts: list[LayerLayout],
        states: LayerStates,
        device: torch.device,
        streams,
        worker: ThreadPoolExecutor,
        num_slots: int = 2,
        compute_dtype: torch.dtype | None = None,
        dp=None,
        check: RecomputeCheck | None = None,
        timer: StepTimer | None = None,
        trace: bool = False,
        inference_cache: bool | str = "auto",
        inference_cache_memory: float = 0.5,
        activations=None,
        open_implicit_backward=None,
        recompute_skip: bool | str = False,
    ) -> None:
        if num_slots < 2:
            raise ValueError(
                f"megatrain.num_slots must be >= 2 for double buffering, got {num_slots}"
            )
        self.layouts, self.store, self.device = layouts, states.store, device
        # where each layer's state lives (layer_state.py): asked, never written here
        self.states = states
        self.streams, self.worker = streams, worker
        # data parallel (dp.py); None: one process
        self.dp = dp if dp is not None and dp.active else None
        self.templates: list[nn.Module] = []
        self.template_of: list[int] = []
        by_signature: dict[tuple, int] = {}
        for layer, layout in zip(layers, layouts):
            key = (type(layer), layout.signature())
            if key not in by_signature:
                by_signature[key] = len(self.templates)
                self.templates.append(make_template(layer, device))
            self.template_of.append(by_signature[key])
        # "template:mlp.down_proj" of each template whose recompute skips that matmul
        # (megatrain.skip_recompute_down_proj, recompute_skip.py)
        self.recompute_skips = install_recompute_skip(self.templates, recompute_skip)
        # functional_call's tie search only where a template shares a tensor between two names
        # (model_map.py)
        self.tie_weights = [has_tied_tensors(t) for t in self.templates]
        # the model's own modules: their train/eval flag drives the templates
        self.layers = list(layers)
        # per-layer scalar attributes set on the template
        self.overlays: list[list] = [[] for _ in layers]
        for t, template in enumerate(self.templates):
            members = [i for i, g in enumerate(self.template_of) if g == t]
            for i, overlay in zip(
                members, per_layer_attributes(template, [self.layers[i] for i in members])
            ):
                self.overlays[i] = overlay
        # Each layer's buffers on the device, and the module holds the same tensors: what the layer
        # updates in place (BatchNorm statistics) is what ``state_dict()`` and checkpoints see.
        self.buffers = [_buffers_to_device(layer, device) for layer in layers]
        # Names of the buffers a training forward of layer i mutates (None until its first training
        # forward, which snapshots them all and compares): their pre-forward values are kept for the
        # recompute, so the recompute sees what the forward saw and its own in-place updates are
        # discarded (one update per forward, as without recompute). A buffer the first forward
        # leaves unchanged is assumed constant.
        self.mutated: list[set[str] | None] = [None] * len(layers)
        # Hooks the model (Hugging Face's output capturing, the user) puts on a layer's submodules
        # run on the template's submodules while that layer runs: pairs of (template submodule,
        # layer submodule).
        self.hook_pairs = [
            submodule_pairs(self.templates[self.template_of[i]], layer)
            for i, layer in enumerate(layers)
        ]
        # Parameters a layer shares with another layer or with the rest of the model stay resident
        # (one device copy, its gradient accumulated into ``param.grad``): name in layer -> the
        # model's parameter.
        self.shared = [
            {
                name: p
                for name, p in layer.named_parameters(remove_duplicate=False)
                if name in layout.shared
            }
            for layer, layout in zip(layers, layouts)
        ]
        # each layer's positional argument names after the hidden states
        self.arg_names = [positional_names(type(layer))[1:] for layer in layers]
        # every recompute compared with its forward while on ([Note: recompute check] in
        # recompute_check.py)
        self.check = (
            check if check is not None else RecomputeCheck(False, "auto", torch.float32, "", False)
        )
        self._last_call: LayerCall | None = None
        # between begin_backward() and end_backward(); other backwards are refused
        self.in_engine_backward = False
        # the engine's: called (on autograd's thread) by a backward through the streamed layers
        # outside engine.backward(loss), e.g. a script's loss.backward(); it opens the backward or
        # raises why it cannot
        self.open_implicit_backward = open_implicit_backward
        # told of each final landing, on the landing thread (landing.py); set once, by ``listen``
        self.landing_listener: LandingListener | None = None
        max_numel = max(l.numel for l in layouts)
        compute_dtype = compute_dtype or self.store.wire_dtype
        staged = compute_dtype != self.store.wire_dtype
        self.slots = [
            Slot(
                torch.empty(max_numel, dtype=compute_dtype, device=device),
                torch.empty(max_numel, dtype=self.store.wire_dtype, device=device)
                if staged
                else None,
            )
            for _ in range(min(num_slots, len(layouts)))
        ]
        # Kept layers (``set_keep``): the trailing layers whose forward builds its graph and keeps
        # it until the backward, in a weight buffer of their own (no recompute, no reload): [Note:
        # kept layers] below.
        self.keep: frozenset[int] = frozenset()
        self.keep_slots: dict[int, Slot] = {}
        # layers whose weights stay in a buffer of their own from forward to backward
        # (``set_weight_cache``): [Note: weight cache]
        self.cached: frozenset[int] = frozenset()
        self.cache_slots: dict[int, Slot] = {}
        self.cache_asked = 0  # the count asked for: chosen again when the kept layers change
        # the largest layer graph a recompute built (CUDA): what keeping one layer costs
        self.graph_bytes = 0
        # versions, optimizer tasks, H2D reads, landings, forward counts: one owner (schedule.py)
        self.schedule = LayerSchedule(len(layouts))
        # mark_backward_done(): event on compute after the last backward (device-state updates wait
        # on it)
        self.backward_done = None
        self.activations = activations  # HostActivations when layer inputs are kept in host memory
        # per-layer gradient norms taken on the GPU (GA 1, device-state layers) and their pinned
        # host landing
        self.norm_dev = torch.zeros(len(layouts), dtype=torch.float32, device=device)
        self.norm_host = torch.zeros(len(layouts), dtype=torch.float32)
        if device.type == "cuda":
            self.norm_host = self.norm_host.pin_memory()
        self.final_micro = True  # begin_backward(): this backward closes the accumulation window
        # (op, layer, slot) when tracing is on
        self.trace: list[tuple] | None = [] if trace else None
        # H2D layer loads, per direction ("forward", "backward", "cache": uploads into the inference
        # cache)
        self.h2d_loads = {d: [0] * len(layouts) for d in ("forward", "backward", "cache")}
        # no-grad forwards on device-resident weights (inference.py; megatrain.inference_cache and
        # _memory)
        self.inference = InferenceCache(self, inference_cache, inference_cache_memory)
        self._direction = "forward"
        # the engine's breakdown
        self.timer = timer if timer is not None else StepTimer(streams, enabled=False)
        self._tick = 0
        # the Function's first input: its outputs require grad whatever the hidden states
        # (layer_call.py)
        self.anchor = torch.zeros((), requires_grad=True)
        for i, layer in enumerate(layers):
            layer.forward = make_layer_forward(self, i)

    # --- what the engine tells it -----------------------------------------------------------------
    def listen(self, listener: LandingListener) -> None:
        """Main thread, before any backward: ``listener`` is told of every final landing, on the
        landing thread (``LandingListener``; the host optimizer's speculative step)."""
        self.landing_listener = listener

    def begin_backward(self, final: bool) -> None:
        """Main thread, ``engine.backward`` before autograd runs: a backward through the streamed
        layers is allowed until ``end_backward``; ``final``: it closes the accumulation window (its
        landings are the final ones)."""
        self.final_micro = final
        self.in_engine_backward = True

    def end_backward(self) -> None:
        """Main thread, once autograd returned or raised: backwards are refused again; forward
        counts restart."""
        self.in_engine_backward = False
        self.schedule.backward_finished()

    def mark_backward_done(self) -> None:
        """Main thread, after the backward's last kernels (the resident folds too) are queued on
        compute: the event the GPU-held updates wait for (``backward_done`` in [Note: stream and
        event ordering])."""
        self.backward_done = self.streams.record(self.streams.compute())

    # --- slots ------------------------------------------------------------------------------------
    def _find(self, i: int) -> Slot | None:
        own = self.own_slot(i)
        if own is not None:
            return own if own.layer == i and own.version == self.version[i] else None
        for slot in self.slots:
            if slot.layer == i and slot.version == self.version[i]:
                return slot
        return None

    def own_slot(self, i: int) -> Slot | None:
        """Layer i's buffer of its own: a kept layer's or a weight-cached one's (None: it streams
        through the rotating slots)."""
        if i in self.keep:
            return self.keep_slots[i]
        return self.cache_slots.get(i) if i in self.cached else None

    def set_weight_cache(self, n: int | None = None) -> list[int]:
        """Hold the weights of ``n`` layers (``weight_cache_layers``) from their forward to their
        backward, each in a buffer of its own (between steps); returns them. ``None``: the count
        asked last, chosen again for the kept and GPU-held layers as they are now (an explicit
        count placed at initialize, before "auto" kept layers or moved their state)."""
        n = self.cache_asked if n is None else n
        self.cache_asked = n
        # the GPU-held range, not this rank's share of it: every rank must load the same layers
        # (data parallel broadcasts each load)
        held = self.states.gpu_layers() or range(0)
        chosen = weight_cache_layers(len(self.layouts), self.keep, len(self.slots), held, n)
        for i in list(self.cache_slots):
            if i not in chosen:
                del self.cache_slots[i]
        stage = self.slots[0].stage  # used on the h2d stream only, in order: shareable
        for i in chosen:
            if i not in self.cache_slots:
                self.cache_slots[i] = Slot(
                    torch.empty(
                        self.layouts[i].numel, dtype=self.slots[0].buf.dtype, device=self.device
                    ),
                    stage,
                )
        self.cached = frozenset(chosen)
        return chosen

    def set_keep(self, n: int) -> None:
        """Keep the graphs of the last ``n`` layers (between steps: no graph may be pending). Each
        gets a weight buffer of its own; see [Note: kept layers]."""
        n = max(0, min(int(n), len(self.layouts)))
        keep = frozenset(range(len(self.layouts) - n, len(self.layouts)))
        for i in list(self.keep_slots):
            if i not in keep:
                del self.keep_slots[i]
        # the staging buffer is only used on the h2d stream, in order: shareable
        stage = self.slots[0].stage
        for i in keep:
            if i not in self.keep_slots:
                numel = self.layouts[i].numel
                self.keep_slots[i] = Slot(
                    torch.empty(numel, dtype=self.slots[0].buf.dtype, device=self.device), stage
                )
        self.keep = keep
        if self.cache_asked:  # the layers below the kept ones now
            self.set_weight_cache()

    def _load(
        self, i: int, busy: Slot | None, slot: Slot | None = None, direction: str | None = None
    ) -> Slot:
        """Issue the H2D copy of layer i into ``slot`` when given (the inference cache's), else its
        own buffer (a kept layer) or the least recently used slot other than ``busy``."""
        if slot is None:
            slot = self.own_slot(i) or min(
                (s for s in self.slots if s is not busy), key=lambda s: s.last_use
            )
        # (the direction of the current _acquire)
        self.h2d_loads[direction or self._direction][i] += 1
        # the slot holds no layer until its new one is in: an exception (a Ctrl-C) between the copy
        # and the identity below left it named after its old layer with the new one's weights, and
        # the next forward used them (found by tests/fault_driver.py)
        slot.layer, slot.version = -1, -1
        st = self.streams
        st.wait(st.h2d, slot.free)  # do not overwrite weights a kernel may still read
        n = self.layouts[i].numel
        if self.states.holds(i):  # data parallel: the owner's copy, then broadcast (below)
            # CPU-side wait for the optimizer's update of layer i
            self.schedule.wait_rewritten(i, self.timer)
            wire = self.store.wire_of(i)
            owned = self.states.on_gpu(i)
            if owned:
                # its GPU-side update (opt stream) is done
                st.wait(st.h2d, self.schedule.device_ready[i])
            with st.on(st.h2d), self.timer.span("h2d", st.h2d), _range("h2d", i):
                # device master: a cast, no PCIe (a compact store's frozen region: from the wire)
                if owned:
                    master = self.states.device_master(i)
                    m = master.numel()
                    slot.buf[:m].copy_(master)
                    if m < n:
                        slot.buf[m:n].copy_(wire[m:], non_blocking=True)
                elif slot.stage is None:
                    slot.buf[:n].copy_(wire, non_blocking=True)
                # fp32 master over PCIe, cast to the compute dtype on the GPU (same stream: ordered)
                else:
                    slot.stage[:n].copy_(wire, non_blocking=True)
                    slot.buf[:n].copy_(slot.stage[:n])
        # NCCL's stream runs it after h2d's queued work; h2d waits for it (dp.py)
        if self.dp is not None:
            with st.on(st.h2d), self.timer.span("comm", st.h2d), _range("broadcast", i):
                self.dp.broadcast_layer(slot.buf[:n], i)
        slot.ready = st.record(st.h2d)
        self.schedule.loaded(i, slot.ready)
        slot.layer, slot.version, slot.free = i, self.version[i], None
        self._tick += 1
        slot.last_use = self._tick
        self._log("h2d", i, slot)
        return slot

    def _acquire(self, i: int, step: int) -> Slot:
        """Slot holding layer i, ready for compute; also prefetches layer i+step into another
        slot."""
        self._direction = "forward" if step > 0 else "backward"  # counted by _load (h2d_loads)
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

    def _bind(
        self,
        i: int,
        slot: Slot,
        trainable_leaf: torch.Tensor | None,
        buffers: dict | None = None,
        shared: dict | None = None,
    ) -> dict[str, torch.Tensor]:
        """Parameter views of layer i into ``slot`` (zero-copy), the shared (resident) parameters,
        and the layer's buffers (``buffers`` overrides some: the recompute's pre-forward copies)."""
        layout = self.layouts[i]
        buf = slot.buf
        # the same views of the same buffer (a decode step calls each layer once per token):
        # built once per layer held, not per call
        if trainable_leaf is None and slot.views is not None and slot.views[0] == i:
            params = dict(slot.views[1])
        else:
            train = trainable_leaf if trainable_leaf is not None else buf[: layout.n_train]
            frozen = buf[layout.n_train : layout.numel]
            params = {
                s.name: (train if s.trainable else frozen)[s.offset : s.offset + s.numel].view(
                    s.shape
                )
                for s in layout.slots
            }
            if trainable_leaf is None:
                slot.views = (i, dict(params))
        params.update(shared if shared is not None else self.shared[i])
        params.update(self.buffers[i])
        if buffers:
            params.update(buffers)
        return params

    def _log(self, op: str, i: int, slot: Slot | None) -> None:
        if self.trace is not None:
            # a slot's index, or a buffer of its own: a kept layer's, the inference cache's
            where = next((k for k, s in enumerate(self.slots) if s is slot), None)
            if where is None and slot is not None:
                where = (
                    "keep"
                    if self.keep_slots.get(i) is slot
                    else "weights"
                    if self.cache_slots.get(i) is slot
                    else "cache"
                )
            self.trace.append((op, i, where))

    # --- forward / backward -----------------------------------------------------------------------
    def _template(self, i: int) -> nn.Module:
        template = self.templates[self.template_of[i]]
        # engine.train()/eval() reach the model's layers
        if template.training != self.layers[i].training:
            template.train(self.layers[i].training)
        for module, name, value in self.overlays[i]:  # e.g. layer_idx, sliding_window of layer i
            setattr(module, name, value)
        # layer i's submodule hooks, by reference (no copy)
        for mirror, original in self.hook_pairs[i]:
            for attr in HOOK_DICTS:
                mirror.__dict__[attr] = original.__dict__[attr]
        return template

    def chain(self, call: LayerCall) -> None:
        """A training call about to run (layer_call.py): ``call.prev`` is the previous layer's call
        of the same forward (its input loads next in backward), and ``call`` the last call."""
        last = self._last_call
        call.prev = last if last is not None and last.index == call.index - 1 else None
        self._last_call = call

    def run_forward(self, call: LayerCall, hidden: torch.Tensor, training: bool):
        """Layer ``call.index`` on streamed weights, without a graph. ``training`` (a grad-enabled
        call, made by the autograd Function): also record what the recompute must replay (RNG,
        buffers it mutates)."""
        i = call.index
        # no-grad: the inference cache's device-resident copy when its policy allows (None: stream
        # as ever); a grad-enabled call frees the cache first (inference.py)
        slot = self.inference.acquire(i, training)
        slot = slot or self._acquire(i, step=+1)
        template = self._template(i)
        if training and i in self.keep:
            return self._run_forward_kept(call, hidden, slot, template)
        # the RNG state of every training forward, as torch.utils.checkpoint preserves it: random
        # draws outside dropout modules (MoE router jitter) replay too
        if training and template.training:
            call.rng_state = get_rng_state(self.device)
        # the script's torch.autocast around the forward (the backward's thread has none): replayed
        if training:
            call.autocast = autocast_state(self.device)
        if training and self.buffers[i] and self.mutated[i] != set():
            names = self.mutated[i] if self.mutated[i] is not None else self.buffers[i].keys()
            call.buffers = {n: self.buffers[i][n].clone() for n in names}
            versions = {n: b._version for n, b in self.buffers[i].items()}
        own = None if training else self.inference.bound(i, slot)
        with self.timer.span("compute", self.streams.compute()), _range("fwd", i):
            # a layer of the inference cache: its own module, bound once (inference.py)
            if own is not None:
                out = own(hidden, *call.args, **call.kwargs)
            else:
                out = functional_call(
                    template,
                    self._bind(i, slot, None),
                    (hidden, *call.args),
                    call.kwargs,
                    tie_weights=self.tie_weights[self.template_of[i]],
                )
        # which buffers the forward mutates, learnt once per layer from the values: kernels that
        # update running statistics in place (batch_norm) do not bump the version counter
        if training and self.buffers[i] and self.mutated[i] is None:
            self.mutated[i] = {
                n
                for n, b in self.buffers[i].items()
                if b._version != versions[n] or not torch.equal(b, call.buffers[n])
            }
            call.buffers = {n: t for n, t in call.buffers.items() if n in self.mutated[i]}
        self._release(slot)
        self._log("fwd", i, slot)
        return out

    def run_backward(
        self, call: LayerCall, hidden: torch.Tensor, grad_outs: tuple, need_input_grad: bool
    ) -> torch.Tensor | None:
        """Recompute layer ``call.index`` from its saved input with a local graph and take the
        gradient of its outputs (``grad_outs``: one per Function output, None where the loss did not
        use it) with respect to [the slot's trainable region, shared parameters, the input]. The
        trainable gradient leaves as one flat D2H burst; shared parameters accumulate into
        ``param.grad``; the input gradient is returned."""
        i, layout = call.index, self.layouts[call.index]
        slot = self._acquire(i, step=-1)
        if self.activations is not None and call.prev is not None and call.prev.graph is None:
            # the next backward layer's input loads while i recomputes
            self.activations.prefetch(call.prev)
        with (
            torch.enable_grad(),
            self.timer.span("compute", self.streams.compute()),
            _range("bwd", i),
        ):
            if call.graph is not None:  # a kept layer: the forward's graph, no recompute
                outputs, train_leaf, shared, x = call.graph
                call.graph = None
            else:
                with self.timer.span("recompute", self.streams.compute()):
                    outputs, train_leaf, shared, x = self._recompute(call, hidden, slot)
            # the previous layer's forward output: its recompute's reference
            self.check.give_input(call, x)
            wrt = [train_leaf] if train_leaf is not None else []
            shared_leaves = list(dict.fromkeys(shared.values()))  # a tied name appears once
            wrt += shared_leaves
            if need_input_grad:
                wrt.append(x)
            pairs = [
                (o, g)
                for o, g in zip(outputs, grad_outs)
                if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
            ]
            grads = (
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    wrt,
                    [g for _, g in pairs],
                    allow_unused=True,
                    materialize_grads=True,
                )
                if (wrt and pairs)
                else [None] * len(wrt)
            )
        self._release(slot)
        self._log("bwd", i, slot)
        grads = list(grads)
        if layout.n_train:
            flat = grads.pop(0)
            self._evacuate(i, flat if flat is not None else torch.zeros_like(train_leaf))
        for leaf in shared_leaves:
            g = grads.pop(0)
            param = next(p for n, p in self.shared[i].items() if shared.get(n) is leaf)
            if g is not None:
                param.grad = g if param.grad is None else param.grad + g
        if not need_input_grad:
            return None
        g = grads.pop(0)
        return g if g is not None else torch.zeros_like(x)

    def _leaves(self, i: int, slot: Slot, hidden: torch.Tensor):
        """The recorded inputs of layer i's local graph: the slot's trainable region, the shared
        parameters that require grad, the input."""
        n_train = self.layouts[i].n_train
        train_leaf = slot.buf[:n_train].detach().requires_grad_(True) if n_train else None
        # one leaf per parameter: a name tied to another gets the same leaf (functional_call's tie
        # search then binds both; the grad sums both uses)
        leaves: dict[int, torch.Tensor] = {}
        for p in self.shared[i].values():
            if p.requires_grad and id(p) not in leaves:
                leaves[id(p)] = p.detach().requires_grad_(True)
        shared = {n: leaves[id(p)] for n, p in self.shared[i].items() if p.requires_grad}
        x = hidden.detach().requires_grad_(hidden.is_floating_point())
        return train_leaf, shared, x

    def _recompute(self, call: LayerCall, hidden: torch.Tensor, slot: Slot):
        """Re-run layer ``call.index`` from its saved input, building its local graph (grad mode
        on)."""
        i = call.index
        template = self._template(i)
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        # raises if the forward changed an argument in place
        self.check.check_inputs(call, self.arg_names[i])
        train_leaf, shared, x = self._leaves(i, slot, hidden)
        bind = self._bind(i, slot, train_leaf, call.buffers, {**self.shared[i], **shared})
        with (
            replay_rng(call.rng_state, self.device),
            fresh_collector(call.capture_keys) as collector,
            autocast_as(call.autocast, self.device),
            # the MLP's output projection only for its backward (recompute_skip.py), unless the
            # recompute check compares this call's outputs
            recomputing(call.check is None),
        ):
            out = functional_call(
                template,
                bind,
                (x, *call.args),
                call.kwargs,
                tie_weights=self.tie_weights[self.template_of[i]],
            )
        outputs = function_outputs(call, out, collector, recompute=True)
        # queued on the compute stream; read at the step (no sync here)
        self.check.compare(call, outputs)
        if self.device.type == "cuda":  # what keeping this layer's graph would cost (sizes "auto")
            self.graph_bytes = max(
                self.graph_bytes, torch.cuda.memory_allocated(self.device) - before
            )
        return outputs, train_leaf, shared, x

    def _run_forward_kept(
        self, call: LayerCall, hidden: torch.Tensor, slot: Slot, template: nn.Module
    ):
        """A kept layer's training forward: build the graph now and hold it (with the weights in the
        layer's own buffer) until the backward. Returns the layer's graph-carrying output: the
        autograd Function keeps those (and the captured ones) in ``call.graph`` and returns detached
        aliases as its own outputs."""
        i = call.index
        with (
            torch.enable_grad(),
            self.timer.span("compute", self.streams.compute()),
            _range("fwd", i),
        ):
            train_leaf, shared, x = self._leaves(i, slot, hidden)
            out = functional_call(
                template,
                self._bind(i, slot, train_leaf, None, {**self.shared[i], **shared}),
                (x, *call.args),
                call.kwargs,
                tie_weights=self.tie_weights[self.template_of[i]],
            )
        # the outputs: set by the Function (they include captured ones)
        call.graph = (None, train_leaf, shared, x)
        self._release(slot)
        self._log("fwd", i, slot)
        return out

    # --- gradient landing: landing.py (GradientLanding._evacuate, called by run_backward) ---------
    def reset_window(self) -> None:
        self.schedule.reset_window()

    # read-only views of the schedule's fields (tests, surface.py); changes go through
    # ``self.schedule``
    version = property(lambda self: self.schedule.version)
    wire_ready = property(lambda self: self.schedule.wire_ready)
    wire_read = property(lambda self: self.schedule.wire_read)
    has_grad = property(lambda self: self.schedule.has_grad)
    sq_norm = property(lambda self: self.schedule.sq_norm)
    forward_calls = property(lambda self: self.schedule.forward_calls)


def _buffers_to_device(layer: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Move ``layer``'s buffers to ``device`` inside the module itself; name -> tensor, as bound per
    call."""
    out = {}
    for path, module in layer.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            module._buffers[name] = buf.to(device)
            out[f"{path}.{name}" if path else name] = module._buffers[name]
    return out
