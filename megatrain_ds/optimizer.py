"""The host optimizer: exact global-norm clipping, fused CPU AdamW per layer, overlapped with the GPU.

Why the update runs in forward order after ``step()`` (and not per layer during backward): exact
``clip_grad_norm_`` needs the norm over *all* gradients, which is known only once layer 0's gradient has
landed, at the very end of backward. So ``step()`` only enqueues work on the host worker: first the norm
task (it sums the per-layer squared norms that the gradient landings already computed during backward,
so it costs microseconds), then the resident parameters (embeddings are used first), then layer 0, 1, …
The next forward waits, layer by layer, only for the update of the layer it is about to load — so the
update of step t runs under the forward of step t+1. See [Note: stream and event ordering].

``HostAdamW`` is a ``torch.optim.Optimizer`` so external LR schedulers (torch's and DeepSpeed's) accept
it and mutate its ``param_groups``; hyperparameters are snapshotted when a step is enqueued.
"""
from __future__ import annotations

import math
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .host_memory import _release_all, host_buffer
from .host_update import adamw_scalars, fused_adam, native_adam_undo, update_segment
from .loss_scale import SKIP_MESSAGE, LossScaleAtMinimumError
from .speculation import Speculation, SpeculationPolicy, adamw_undo, same_hyperparameters


def _range(name: str):
    """A profiler range on the host worker (see timing.layer_range)."""
    return torch.profiler.record_function(f"megatrain.{name}")


class ResidentParams:
    """Parameters outside the streamed layers (embeddings, final norm, LM head). Tied parameters appear once.

    The module's parameter holds the compute-dtype copy on the device. Its fp32 master, moments and
    gradient live on the host, or on the device when ``state_on_device`` (``offload_optimizer.ratio`` < 1,
    see device_state.py): the embedding is the first thing a forward needs, so its update must not queue behind
    host work. A frozen parameter (in no optimizer group: a LoRA model's embeddings and head) is never updated:
    its ``master`` is the device copy itself, in the compute dtype, with no host copy (as the streamed layers'
    frozen weights, host_state.py).
    """

    def __init__(self, params: list[torch.nn.Parameter], group_of: dict[int, int], device: torch.device,
                 compute_dtype: torch.dtype, streams, pin: bool, state_on_device: bool = False, dp=None) -> None:
        self.params, self.group_of, self.device, self.streams = params, group_of, device, streams
        self.dp = dp if dp is not None and dp.active else None  # data parallel: replicated, gradients averaged
        self.on_device = state_on_device
        state = device if state_on_device else torch.device("cpu")
        self.master, self.exp_avg, self.exp_avg_sq, self.grad, self.wire, self.landing = [], [], [], [], [], []
        # pinned in mappings of their own (host_memory.HostRegion): torch's pinned allocator would round each up to a
        # power of two (a 7B model's 1.1 GB embedding wire and landing copies would take 2 GB each)
        self.regions: list = []

        def pinned(t: torch.Tensor) -> torch.Tensor:
            if not pin or state_on_device:
                return t
            return host_buffer(t.numel(), t.dtype, True, self.regions).view(t.shape).copy_(t)
        for p in params:
            trainable = id(p) in group_of  # in an optimizer group; others are never updated
            if not trainable:
                p.data = p.detach().to(device, compute_dtype, copy=True)
                for kind in (self.master, self.wire, self.exp_avg, self.exp_avg_sq, self.grad, self.landing):
                    kind.append(p.data if kind is self.master else None)
                continue
            master = p.detach().to(state, torch.float32, copy=True)
            self.master.append(master)
            self.wire.append(None if state_on_device else pinned(master.to(compute_dtype, copy=True)))
            self.exp_avg.append(torch.zeros_like(master) if trainable else None)
            self.exp_avg_sq.append(torch.zeros_like(master) if trainable else None)
            self.grad.append(torch.zeros_like(master) if trainable else None)
            landing = trainable and not state_on_device
            self.landing.append(pinned(torch.empty_like(master, dtype=compute_dtype)) if landing else None)
            p.data = master.to(device, compute_dtype, copy=True)
        weakref.finalize(self, _release_all, self.regions)
        self.norm_dev = torch.zeros(len(params), dtype=torch.float32, device=device)
        self.norm_host = torch.zeros(len(params), dtype=torch.float32)
        if device.type == "cuda":
            self.norm_host = self.norm_host.pin_memory()
        self.has_grad = [False] * len(params)
        self.sq_norm: list[Future | None] = [None] * len(params)
        self.update: Future | None = None  # optimizer task that rewrote the wire copies
        self.uploaded = True
        self.wire_read = None  # last H2D event reading the wire copies (host state)
        self.device_updated = None  # GPU-held state: event after its last update (opt stream)
        self.on_final_landing = None  # worker thread, after a final gradient landed: (index, sq-norm)

    def device_bytes(self) -> int:
        """GPU bytes ``move_state_to_device`` takes: fp32 master, moments and gradient of the trained parameters
        (16 bytes each; a frozen one is on the device already, as its compute-dtype copy)."""
        return sum(16 * m.numel() for m, g in zip(self.master, self.grad) if g is not None)

    def move_state_to_device(self) -> None:
        """From now on keep the fp32 master, moments and gradient on the device (between steps, nothing queued:
        the state so far comes along; the host wire and landing buffers are dropped)."""
        if self.on_device:
            return
        dev = self.device
        move = lambda t: None if t is None else t.to(dev, copy=True)  # noqa: E731
        # a frozen parameter's master is its device copy already
        self.master = [move(t) if g is not None else t for t, g in zip(self.master, self.grad)]
        self.exp_avg = [move(t) for t in self.exp_avg]
        self.exp_avg_sq = [move(t) for t in self.exp_avg_sq]
        self.grad = [move(t) for t in self.grad]
        self.wire = [None] * len(self.params)
        self.landing = [None] * len(self.params)
        _release_all(self.regions)  # their pinned host copies (unregistered; freed with the last view)
        self.wire_read = None
        self.on_device = True

    def evacuate(self, worker: ThreadPoolExecutor, final: bool) -> None:
        """After autograd: fold each resident ``.grad`` into its fp32 gradient (D2H + host worker, or in
        place on the device) and queue its squared norm."""
        for k, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.grad[k] is None:  # requires grad but not in any optimizer group: not trained
                p.grad = None
                continue
            if self.dp is not None:  # every rank holds the same gradient from here on: the mean (dp.py)
                self.dp.mean_grad(p.grad)
            first = not self.has_grad[k]
            self.has_grad[k] = True
            if self.on_device:
                self.sq_norm[k] = self._accumulate_on_device(k, p.grad, first, final, worker)
            else:
                self.sq_norm[k] = self._send_to_host(k, p.grad, first, final, worker)
            p.grad = None

    def _send_to_host(self, k, grad, first, final, worker) -> Future:
        st = self.streams
        if self.sq_norm[k] is not None:
            self.sq_norm[k].result()  # the landing buffer is free once the previous landing ran
        st.wait(st.d2h, st.record(st.compute()))
        with st.on(st.d2h):
            self.landing[k].copy_(grad, non_blocking=True)
        st.hand_over(grad, st.d2h)
        return worker.submit(self._land, k, st.record(st.d2h), first, final)

    def _accumulate_on_device(self, k, grad, first, final, worker) -> Future:
        st = self.streams
        if first:
            self.grad[k].copy_(grad)
        else:
            self.grad[k].add_(grad)
        if not final:
            return worker.submit(lambda: None)
        torch.linalg.vector_norm(self.grad[k], out=self.norm_dev[k])
        st.wait(st.d2h, st.record(st.compute()))
        with st.on(st.d2h):
            self.norm_host[k:k + 1].copy_(self.norm_dev[k:k + 1], non_blocking=True)
        landed = st.record(st.d2h)
        return worker.submit(lambda: (landed.synchronize(), float(self.norm_host[k]) ** 2)[1])

    def _land(self, k: int, landed, first: bool, final: bool):
        landed.synchronize()
        if first:
            self.grad[k].copy_(self.landing[k])
        else:
            self.grad[k].add_(self.landing[k])
        sq = float(torch.dot(self.grad[k].view(-1), self.grad[k].view(-1))) if final else None
        if final and self.on_final_landing is not None:  # speculative step of this parameter (speculation.py)
            self.on_final_landing(k, sq)
        return sq

    def upload(self) -> None:
        """Before a forward: wait for the optimizer, then refresh the device copies (H2D of the host wire
        copies, or a cast of the device masters), ordered before the forward's first kernel."""
        if self.uploaded:
            return
        with _range("wait_resident_update"):
            self.update.result()
        st = self.streams
        # The copies overwrite the parameters in place: wait for every kernel queued on compute so far (a
        # backward may still read them when an eval forward runs between backward() and step()).
        # See [Note: stream and event ordering]: ``params_read``.
        st.wait(st.h2d, st.record(st.compute()))
        if self.on_device:
            st.wait(st.h2d, self.device_updated)  # the GPU-side update (opt stream) is done
        with st.on(st.h2d):
            for p, master, wire, grad in zip(self.params, self.master, self.wire, self.grad):
                if grad is not None:  # frozen ones never change (their master is p.data)
                    p.data.copy_(master if self.on_device else wire, non_blocking=True)
        self.wire_read = st.record(st.h2d)
        st.wait(st.compute(), self.wire_read)
        self.uploaded = True


class HostAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2 when ``adam_w_mode`` is False) over host fp32 master weights."""

    def __init__(self, param_groups: list[dict], defaults: dict, adam_w_mode: bool = True) -> None:
        super().__init__(param_groups, defaults)
        self.adam_w_mode = adam_w_mode
        self.last_norm: Future | None = None
        self.step_count = 0
        self.skipped_steps = 0

    # --- DeepSpeed's optimizer attributes (accelerate's DeepSpeedOptimizerWrapper.step_was_skipped reads
    # ``overflow``, only when it exists; DeepSpeed-Chat and BingBertSquad read ``cur_scale``)
    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped on non-finite gradients (every precision; fp16 overflow). Set by the
        norm task: current once ``engine.step()`` has returned (it waits for that task)."""
        return getattr(self, "last_step_skipped", False)

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale the next backward multiplies the loss by; 1.0 without fp16."""
        scaler = getattr(self, "scaler", None)
        return float(scaler.scale) if scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's ZeRO optimizers' other name for ``cur_scale``."""
        return self.cur_scale

    def bind(self, executor, resident: ResidentParams, worker: ThreadPoolExecutor, clip: float,
             scaler=None, optimizer_worker: ThreadPoolExecutor | None = None, dp=None, kernel: str = "torch") -> None:
        """``worker``: the landing thread (gradient folds, squared norms, the norm task); ``optimizer_worker``:
        the AdamW thread (speculative updates, then the step's update tasks). Two threads so the norm is known
        as soon as the last gradient lands, not after the speculative updates queued before it (the host
        AdamW of a 3B step takes longer than its backward without recompute)."""
        self.executor, self.resident, self.worker, self.clip = executor, resident, worker, float(clip)
        self.kernel = kernel  # the streamed layers' host update: "native" or "torch" (host_update.resolve_kernel)
        self.dp = dp if dp is not None and dp.active else None  # data parallel: the norm is summed over ranks
        self.opt_worker = optimizer_worker or worker
        self._closing: Future | None = None  # the last step's close task (speculation accounting)
        self.scaler = scaler  # fp16 LossScaler: grads arrive multiplied by its scale
        self.last_step_skipped = False
        self._tmp = torch.empty(executor.store.max_train, dtype=torch.float32)
        # bf16-master mode: one layer's master in fp32 for the update (the fused kernel wants one dtype)
        self._tmp_master = torch.empty(executor.store.max_train if executor.store.master_dtype != torch.float32
                                       else 0, dtype=torch.float32)
        self.policy = SpeculationPolicy(enabled=False, backoff=0)  # the engine configures it (speculation.py)
        self.spec: Speculation | None = None  # the open boundary's speculative updates
        executor.on_final_landing = self._speculate
        resident.on_final_landing = self._speculate_resident

    # --- speculative stepping (see speculation.py) -------------------------------------------------------
    def _hyperparameters(self, step) -> list[dict]:
        return [dict(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
                     eps=float(g["eps"]), weight_decay=float(g["weight_decay"]), step=step)
                for g in self.param_groups]

    def begin_speculation(self, allowed: bool = True) -> None:
        """Main thread, before the backward that closes an accumulation window: open a speculation when the
        policy allows (the previous step's norm task has run: engine.step() waited for it). ``allowed``: the
        engine's check that no layer is loaded again after its gradient lands (one forward per layer)."""
        self.spec = None
        if self._closing is not None:
            self._closing.result()  # the previous step's accounting (policy) is in
        if allowed and self.policy.allows():
            scale = self.scaler.scale if self.scaler is not None else 1.0
            self.spec = Speculation(hp=self._hyperparameters(self.step_count + 1), coef=1.0 / scale)
            # the layers' gradients land last layer first, and each is stepped as it lands: read ahead that way
            self.executor.store.expect_moments(reversed(range(len(self.executor.layouts))))

    def _speculate(self, i: int, sq, before_fold: bool = False) -> None:
        """Landing thread, right after layer i's final gradient landed: queue its update with coefficient 1 on
        the AdamW thread. ``before_fold``: called before a landing is folded in; a layer already stepped gets a
        second gradient (two forwards into one loss): undo it now (after its queued update, on the AdamW
        thread), while its gradient is still the one the step used; it is updated with the sum after the norm."""
        spec, ex = self.spec, self.executor
        if spec is None:
            return
        if before_fold:
            if i in spec.landed:
                spec.stale.add(i)
                self.opt_worker.submit(self._unspeculate, i, spec).result()
            return
        if spec.stopped or i in spec.stale or (ex.device_state is not None and ex.device_state.owns(i)):
            return
        spec.landed.add(i)
        if sq is None or not math.isfinite(sq):
            spec.stopped = True  # the step will be skipped (or this layer's norm is unknown): stop here
            return
        self.opt_worker.submit(self._speculative_update, i, spec)

    def _speculative_update(self, i: int, spec: Speculation) -> None:
        """AdamW thread: layer i's update with the speculation's coefficient, unless the norm is already known
        (then the plain update after the norm does it, in forward order) or the step is doomed."""
        if spec.closed or spec.stopped or i in spec.stale:
            return
        with self.executor.timer.host_span("speculative_s") as span, _range(f"speculate.L{i}"):
            span["updated_params"] = self._update_layer(i, spec.hp, spec.coef)
        spec.done.append(i)

    def _unspeculate(self, i: int, spec: Speculation) -> None:
        if i in spec.done:
            self._undo_layer(i, spec)
            spec.done.remove(i)

    def _speculate_resident(self, k: int, sq) -> None:
        """Landing thread, after resident parameter k's gradient landed (after the backward): queue its update
        now, so the update the next forward waits for first (the embedding's) is under way before the norm."""
        spec, res = self.spec, self.resident
        if spec is None or spec.stopped or res.on_device or k in spec.resident_landed:
            return
        spec.resident_landed.add(k)
        if sq is None or not math.isfinite(sq):
            spec.stopped = True
            return
        self.opt_worker.submit(self._speculative_resident_update, k, spec)

    def _speculative_resident_update(self, k: int, spec: Speculation) -> None:
        if spec.closed or spec.stopped:
            return
        res = self.resident
        if res.wire_read is not None:
            res.wire_read.synchronize()  # the last upload has read the wire copy
        with self.executor.timer.host_span("speculative_s"), _range(f"speculate.resident{k}"):
            self._update_resident_one(k, spec.hp, spec.coef)
        spec.resident_done.append(k)

    def _undo_resident(self, k: int, spec: Speculation) -> None:
        res = self.resident
        if res.wire_read is not None:
            res.wire_read.synchronize()
        with self.executor.timer.host_span("rollback_s"):
            adamw_undo(res.master[k].view(-1), res.grad[k].view(-1), res.exp_avg[k].view(-1),
                       res.exp_avg_sq[k].view(-1), spec.hp[res.group_of.get(id(res.params[k]), 0)], spec.coef,
                       self.adam_w_mode)
            if res.wire[k] is not None:
                res.wire[k].copy_(res.master[k])

    def abandon_speculation(self) -> None:
        """Main thread: the speculated updates must not be seen (a forward, zero_grad, a read of the masters
        between backward() and step()): wait for the landings, roll every speculated layer back."""
        spec, self.spec = self.spec, None
        if spec is None:
            return
        def undo_all():
            for i in spec.done:
                self._undo_layer(i, spec)
            for k in spec.resident_done:
                self._undo_resident(k, spec)
        self.worker.submit(lambda: None).result()  # the landings queued so far have run (and queued their updates)
        spec.closed = True  # updates queued but not started are dropped
        self.opt_worker.submit(undo_all).result()
        # a slot loaded meanwhile would hold the rolled-forward weights; data parallel: every layer on every rank
        # (the ranks' slots stay in step, and the owners' broadcasts bring the rolled-back bytes; dp.py)
        for i in (spec.done if self.dp is None else range(len(self.executor.layouts))):
            self.executor.schedule.invalidate(i)
        if spec.done or spec.resident_done:
            self.policy.rolled_back += 1

    def _undo_layer(self, i: int, spec: Speculation) -> None:
        ex, store = self.executor, self.executor.store
        ex.schedule.wait_read(i)
        layout = store.layouts[i]
        grad = store.grad_of(i)
        master, m, v = self._state(i)
        try:
            with ex.timer.host_span("rollback_s"), _range(f"rollback.L{i}"):
                if self.kernel == "native":  # [Note: native rollback]: one pass, the wire copy written in it
                    wire = None if store.wire_is_master else store.wire_of(i)
                    for group, a, b in layout.segments:
                        native_adam_undo(master[a:b], grad[a:b], m[a:b], v[a:b], spec.hp[group], spec.coef,
                                         self.adam_w_mode, None if wire is None else wire[a:b])
                    if wire is not None and layout.segments and layout.segments[-1][2] != layout.n_train:
                        store.refresh_wire(i, master)  # segments not ending at n_train: the rest as before
                else:
                    if grad.dtype != torch.float32:
                        grad = self._tmp[:layout.n_train].copy_(grad)
                    for group, a, b in layout.segments:
                        adamw_undo(master[a:b], grad[a:b], m[a:b], v[a:b], spec.hp[group], spec.coef,
                                   self.adam_w_mode)
                    store.refresh_wire(i, master)
        finally:
            store.release_moments(i)

    def _state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's master and Adam moments, acquired for an update (RAM views, or the NVMe tier's staging buffer:
        the time spent waiting for its read is the breakdown's ``nvme_wait_s``). The caller releases them
        (``release_moments``)."""
        store = self.executor.store
        if not store.on_disk(i):
            return store.acquire_state(i)
        with self.executor.timer.host_span("nvme_wait_s"), _range(f"nvme_read.L{i}"):
            return store.acquire_state(i)

    def _settle(self, i: int, hp, spec: Speculation):
        """Layer i was stepped speculatively: keep it (the norm task committed), or undo it and step it
        again with the true coefficient (or leave it rolled back, when the step is skipped)."""
        if spec.commit:
            return
        self._undo_layer(i, spec)
        if not self._skip:
            with self.executor.timer.host_span("optimizer_s") as span:
                span["updated_params"] = self._update_layer(i, hp)

    def step(self, closure=None) -> Future:
        """Queue clip + update of every parameter (the engine calls this at accumulation boundaries; going
        through ``step`` lets torch's LR schedulers see that the optimizer stepped). Returns the future of
        the pre-clip global norm."""
        if closure is not None:
            raise NotImplementedError("HostAdamW.step(closure): closures are not supported")
        return self.enqueue_step(self.clip)

    def host_state_dict(self) -> dict:
        """Adam moments (flat host buffers, no copy), step count and group hyperparameters. The caller has
        run ``engine.sync_masters_to_host()``."""
        store, res = self.executor.store, self.resident
        cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
        return {"step_count": self.step_count, "adam_w_mode": self.adam_w_mode,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "exp_avg": store.exp_avg, "exp_avg_sq": store.exp_avg_sq,
                "resident_exp_avg": [cpu(t) for t in res.exp_avg],
                "resident_exp_avg_sq": [cpu(t) for t in res.exp_avg_sq]}

    def load_host_state_dict(self, state: dict) -> None:
        ds, store, res = self.executor.device_state, self.executor.store, self.resident
        if state["exp_avg"].numel() != store.exp_avg.numel() or len(state["param_groups"]) != len(self.param_groups):
            raise RuntimeError("optimizer state in the checkpoint does not match this model/optimizer "
                               f"({state['exp_avg'].numel()} vs {store.exp_avg.numel()} trainable elements, "
                               f"{len(state['param_groups'])} vs {len(self.param_groups)} param groups)")
        store.exp_avg.copy_(state["exp_avg"])
        store.exp_avg_sq.copy_(state["exp_avg_sq"])
        for dst, src in zip(res.exp_avg + res.exp_avg_sq, state["resident_exp_avg"] + state["resident_exp_avg_sq"]):
            if dst is not None:
                dst.copy_(src)
        if ds is not None:
            ds.exp_avg.copy_(store.exp_avg[ds.train0:ds.train1])
            ds.exp_avg_sq.copy_(store.exp_avg_sq[ds.train0:ds.train1])
        self.step_count = state["step_count"]
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients accumulated since the last step (the next landing overwrites)."""
        self.executor.reset_window()
        self.resident.has_grad = [False] * len(self.resident.params)
        self.resident.sq_norm = [None] * len(self.resident.params)

    def enqueue_step(self, clip: float) -> Future:
        """Queue norm + clipping + AdamW for every parameter; return the future of the pre-clip norm (inf when
        the step is skipped). Adam's step count is not known yet: the norm task advances it (and writes it into
        ``hp``) only when the step is applied, so a skipped step leaves bias correction as it was (DeepSpeed's)."""
        hp = self._hyperparameters(step=None)
        # This boundary's speculation stays open while landings are still queued on the worker (they keep
        # speculating); the norm task, which runs after all of them (FIFO), closes it.
        spec = self.spec
        self._clip = float(clip)
        ex, res = self.executor, self.resident
        layer_sq, layer_has = ex.schedule.close_window()
        res_sq, res_has = list(res.sq_norm), list(res.has_grad)
        scale = self.scaler.scale if self.scaler is not None else 1.0  # the scale the backward used
        norm = self.worker.submit(self._norm_task, layer_sq, res_sq, layer_has, res_has, scale, hp, spec)
        # FIFO order of the AdamW thread: the resident parameters first (the embedding is used first; held on the
        # GPU, its update also heads the opt stream), then the GPU-held layers (they only launch kernels), then
        # the host layers in forward order.
        on_device = [i for i in range(len(ex.layouts)) if ex.device_state is not None and ex.device_state.owns(i)]
        host = [i for i in range(len(ex.layouts)) if i not in set(on_device)]
        res.update = self.opt_worker.submit(self._resident_task, hp, res_has, norm, ex.backward_done, spec)
        res.uploaded = False
        for i in on_device:
            if layer_has[i]:
                ex.schedule.rewrite(i, self.opt_worker.submit(self._device_task, i, hp, norm, ex.backward_done))
        for i in host:
            if layer_has[i] and not ex.store.owned[i]:  # another rank updates it: the slot copy goes stale
                ex.schedule.rewrite(i, norm)  # (its owner's broadcast, after its update, brings the new bytes)
            elif layer_has[i]:
                ex.schedule.rewrite(i, self.opt_worker.submit(self._layer_task, i, hp, norm, spec))
        self._closing = self.opt_worker.submit(self._close_task, norm, spec)  # after every update task (FIFO)
        res.has_grad = [False] * len(res.params)
        res.sq_norm = [None] * len(res.params)
        self.last_norm = norm
        return norm

    def _norm_task(self, layer_sq, res_sq, layer_has, res_has, scale, hp, spec=None):
        """The global norm, and the decision every update task of this step reads (they run after it, FIFO on
        the one host worker): skip the step when the norm is not finite -- in every precision, as DeepSpeed
        (its bf16 optimizer, ZeRO, fp16 loss scaling) -- or apply it with this clip coefficient and Adam step."""
        with _range("norm"):
            return self._norm(layer_sq, res_sq, layer_has, res_has, scale, hp, spec)

    def _norm(self, layer_sq, res_sq, layer_has, res_has, scale, hp, spec):
        total = 0.0
        owned = self.executor.store.owned
        counted = self.dp is None or self.dp.rank == 0  # replicated resident gradients: counted once
        for futures, has, grads in ((layer_sq, layer_has, None), (res_sq, res_has, self.resident.grad)):
            for k, fut in enumerate(futures):
                if not has[k] or (grads is None and not owned[k]) or (grads is not None and not counted):
                    continue
                sq = fut.result()
                if sq is None:  # the window's boundary was moved after its backward: norm it now
                    g = grads[k] if grads is not None else self._layer_grad(k)
                    sq = float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2  # rare: slow is ok
                total += sq
        if self.dp is not None:  # every rank's share: one all-reduce of a scalar (gloo, this thread's group)
            total = self.dp.sum_norm(total)
        norm = math.sqrt(total) / scale  # of the unscaled gradients
        overflow = not math.isfinite(norm)
        self.skip_message, self.step_error = (SKIP_MESSAGE if overflow else None), None
        if self.scaler is not None:
            try:
                self.skip_message = self.scaler.update(overflow)
            except LossScaleAtMinimumError as exc:  # raised to the script by engine.step(); the tasks skip
                self.step_error = exc
        self.last_step_skipped = self._skip = overflow
        if not overflow:
            self.step_count += 1
        for group in hp:
            group["step"] = self.step_count
        coef = 1.0
        if self._clip > 0 and not overflow:
            coef = min(1.0, self._clip / (norm + 1e-6))
        self._coef = coef / scale  # the updates multiply the landed gradients by this
        if spec is not None:  # every landing ran before this task; speculative updates may still be running
            spec.closed = True  # on the AdamW thread: those not started are left to the plain update
            if self.spec is spec:
                self.spec = None
            spec.commit = not overflow and self._coef == spec.coef and same_hyperparameters(hp, spec.hp)
        self._clipped_or_skipped = overflow or coef < 1.0
        self._expect_updates(layer_has, overflow, spec)
        return math.inf if overflow else norm  # DeepSpeed reports a skipped step's norm as inf

    def _expect_updates(self, layer_has, overflow: bool, spec: Speculation | None) -> None:
        """Tell the NVMe tier which layers the update tasks queued behind this norm will touch, in their (forward)
        order, so their moments are read ahead: a layer stepped speculatively is done when the speculation commits,
        and needs its undo (and redo) otherwise; the other layers are updated unless the step is skipped."""
        store = self.executor.store
        if store.tier is None:
            return
        done = set(spec.done) if spec is not None else set()
        commit = spec is not None and spec.commit
        store.expect_moments([i for i, has in enumerate(layer_has)
                              if has and ((i not in done and not overflow) or (i in done and not commit))])

    def _close_task(self, norm_future, spec: Speculation | None) -> None:
        """AdamW thread, after the step's update tasks: the speculation's final accounting (which layers were
        stepped during the backward is known only now) and the policy's record of this step."""
        norm_future.result()
        rolled_back = False
        # data parallel: whether this rank stepped a layer early is its own timing; the policy (which decides the
        # next speculation, hence which slots a rollback invalidates) must agree across ranks: any open one counts
        if spec is not None and (spec.done or spec.resident_done or self.dp is not None):
            self.policy.speculated += 1
            rolled_back = not spec.commit
            self.policy.rolled_back += int(rolled_back)
        self.policy.record(clipped_or_skipped=self._clipped_or_skipped, rolled_back=rolled_back)

    def _layer_grad(self, i: int) -> torch.Tensor:
        """Layer i's accumulated gradient, wherever it lives (GPU-held optimizer state or host store)."""
        ds = self.executor.device_state
        return ds.grad_of(i) if ds is not None and ds.owns(i) else self.executor.store.grad_of(i)

    def _adamw(self, params, grads, exp_avgs, exp_avg_sqs, hp, coef):
        # CPU (resident parameters) or the GPU (device-state layers): the same fused kernel; coef = clip
        # coefficient / loss scale
        step, scale = adamw_scalars(hp, coef, params[0].device)
        fused_adam(params, grads, exp_avgs, exp_avg_sqs, hp, step, scale, self.adam_w_mode)

    def _resident_task(self, hp, has, norm_future, backward_done, spec: Speculation | None = None):
        norm_future.result()
        if spec is not None and spec.resident_done:  # stepped after the backward: keep them, or undo them
            if spec.commit:  # (the plain update below then redoes them, unless the step is skipped)
                has = [h and k not in spec.resident_done for k, h in enumerate(has)]
            else:
                for k in spec.resident_done:
                    self._undo_resident(k, spec)
        if self._skip:  # non-finite gradients: this step is skipped
            return
        res, st = self.resident, self.executor.streams
        if res.on_device:  # launch on the opt stream; upload()'s casts wait for the event after it
            st.wait(st.opt, backward_done)
            with st.on(st.opt):
                self._update_resident(hp, has)
            res.device_updated = st.record(st.opt)
            return
        if res.wire_read is not None:
            res.wire_read.synchronize()  # the last upload has read the wire copies
        with self.executor.timer.host_span("optimizer_s"), _range("adamw.resident"):
            self._update_resident(hp, has)

    def _update_resident(self, hp, has):
        for k in range(len(self.resident.params)):
            if has[k]:
                self._update_resident_one(k, hp, self._coef)

    def _update_resident_one(self, k: int, hp, coef: float) -> None:
        res = self.resident
        self._adamw([res.master[k]], [res.grad[k]], [res.exp_avg[k]], [res.exp_avg_sq[k]],
                    hp[res.group_of.get(id(res.params[k]), 0)], coef)
        if res.wire[k] is not None:
            res.wire[k].copy_(res.master[k])

    def _device_task(self, i: int, hp, norm_future, backward_done):
        """Launch layer i's update on the GPU, on the opt stream; the cast that reads the device master for the
        next forward waits for the event recorded after it (``schedule.device_ready``)."""
        norm_future.result()
        if self._skip:
            return
        ex, st = self.executor, self.executor.streams
        st.wait(st.opt, backward_done)  # the gradient accumulators are complete
        master, grad = ex.device_state.master_of(i), ex.device_state.grad_of(i)
        m, v = ex.device_state.moments_of(i)
        with st.on(st.opt), _range(f"adamw_gpu.L{i}"):
            for group, a, b in ex.store.layouts[i].segments:
                self._adamw([master[a:b]], [grad[a:b]], [m[a:b]], [v[a:b]], hp[group], self._coef)
        ex.schedule.updated_on_device(i, st.record(st.opt))

    def _layer_task(self, i: int, hp, norm_future, spec: Speculation | None = None):
        norm_future.result()
        if spec is not None and i in spec.done:  # final: the norm task ran after every landing
            return self._settle(i, hp, spec)
        if self._skip:
            return
        with self.executor.timer.host_span("optimizer_s") as span, _range(f"adamw.L{i}"):
            span["updated_params"] = self._update_layer(i, hp)

    def _update_layer(self, i: int, hp, coef: float | None = None) -> int:
        """Layer i's AdamW, each segment in one pass of the native kernel ([Note: native host update]) or in
        cache-sized blocks of torch's ([Note: blocked host update]); both bit-identical to torch's fused AdamW."""
        ex, store = self.executor, self.executor.store
        coef = self._coef if coef is None else coef
        ex.schedule.wait_read(i)  # the last H2D reading wire i has finished
        layout = store.layouts[i]
        grad = store.grad_of(i)
        master, m, v = self._state(i)  # RAM views, or an NVMe layer's staged copies
        wire = None if store.wire_is_master else store.wire_of(i)
        try:
            for group, a, b in layout.segments:
                update_segment(master, grad, m, v, a, b, hp[group], coef, self.adam_w_mode, wire, self._tmp,
                               self._tmp_master, kernel=self.kernel)
            return layout.n_train  # the caller's span counts it: the breakdown's Gparam/s of the host update
        finally:
            store.release_moments(i)  # a disk layer's region is written back behind the next updates
