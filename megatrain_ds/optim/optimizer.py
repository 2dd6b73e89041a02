"""The host optimizer: exact global-norm clipping, fused CPU AdamW per layer, overlapped with the
GPU.

Why the update runs in forward order after ``step()`` (and not per layer during backward): exact
``clip_grad_norm_`` needs the norm over *all* gradients, which is known only once layer 0's gradient
has landed, at the very end of backward. So ``step()`` only enqueues work on the host threads: first
the norm task (it sums the per-layer squared norms that the gradient landings already computed
during backward, so it costs microseconds, and decides the step: a ``StepDecision``), then the
resident parameters (embeddings are used first), then layer 0, 1, … The next forward waits, layer by
layer, only for the update of the layer it is about to load — so the update of step t runs under the
forward of step t+1. See [Note: stream and event ordering] in streams.py for the device side, and
[Note: host threads] below for the host threads'.

``HostAdamW`` is a ``torch.optim.Optimizer`` so external LR schedulers (torch's and DeepSpeed's)
accept it and mutate its ``param_groups``; hyperparameters are snapshotted when a step is enqueued.

[Note: host threads]

Three threads touch the optimizer: the main thread (the script's: backward, step, forward), the
landing thread (``worker``, "megatrain-host": gradient folds, squared norms, the norm task) and the
AdamW thread (``opt_worker``, "megatrain-adamw": speculative updates, then each step's update tasks,
then its close task, then its deferred moments passes). Each host thread is FIFO. What one of them
writes and another reads goes through one of these hand-offs (a future, the order of a FIFO submit,
or a flag named here); everything else of HostAdamW is the main thread's:

| hand-off                   | produced by (thread)    | waited / read by       | orders /         |
|                            |                         | (thread)               | protects         |
|----------------------------|-------------------------|------------------------|------------------|
| landing future             | main submits the fold;  | the norm task (landing | the window's     |
| (``schedule.landing``,     | the landing thread      | thread, FIFO after     | gradient sum is  |
| ``res.sq_norm``)           | returns its sq-norm     | them); engine after a  | in its host      |
|                            |                         | failed backward        | home, its norm   |
|                            |                         |                        | known            |
| ``LandingListener`` calls  | landing thread, inside  | HostAdamW on the       | a speculative    |
| (landing.py)               | the landing task        | landing thread: it     | update reads a   |
|                            |                         | submits the            | gradient only    |
|                            |                         | speculative update to  | after its final  |
|                            |                         | the AdamW thread       | fold             |
| ``_unspeculate`` (a second | landing thread submits  | AdamW thread           | the undo uses    |
| final landing of a layer)  | it and waits            |                        | the gradient the |
|                            | (``.result()``) before  |                        | step used, not   |
|                            | the fold                |                        | the sum the fold |
|                            |                         |                        | writes           |
| ``_landing_spec``          | main:                   | landing thread (the    | each landing's   |
|                            | ``begin_speculation``   | listener calls)        | submit orders    |
|                            | (before the backward    |                        | the write before |
|                            | queues its landings),   |                        | its reads        |
|                            | ``abandon_speculation`` |                        |                  |
| ``Speculation``:           | landing thread          | AdamW thread, before   | a cancel flag:   |
| ``stopped``, ``closed``    | (listener, norm task);  | each speculative       | updates not      |
|                            | main (abandon, after    | update                 | started are left |
|                            | the landings ran)       |                        | to the plain     |
|                            |                         |                        | update           |
| ``Speculation``: ``done``, | AdamW thread            | AdamW tasks queued     | which layers a   |
| ``resident_done``          | (speculative updates)   | after them (FIFO);     | settle or an     |
|                            |                         | main after             | undo treats      |
|                            |                         | ``undo_all``; the norm |                  |
|                            |                         | task (a read-ahead     |                  |
|                            |                         | hint)                  |                  |
| decision future (the norm  | landing thread, after   | the step's AdamW tasks | no update before |
| task's ``StepDecision``)   | every landing of the    | (``.result()``); main: | the norm; skip,  |
|                            | window (FIFO)           | engine.step waits the  | coefficient,     |
|                            |                         | norm future made from  | Adam step,       |
|                            |                         | it, then               | verdict,         |
|                            |                         | ``_decided()``         | message, error:  |
|                            |                         |                        | one immutable    |
|                            |                         |                        | value            |
| loss scaler                | landing thread (the     | main, after the norm   | the scale of the |
| (``scaler.update``)        | norm task)              | future: the next       | next backward    |
|                            |                         | backward,              |                  |
|                            |                         | ``cur_scale``          |                  |
| update futures             | main submits the AdamW  | main:                  | a wire copy is   |
| (``schedule.rewrite``,     | tasks                   | ``wait_rewritten(i)``  | rewritten before |
| ``res.rewrite``)           |                         | before the H2D of wire | an H2D reads it; |
|                            |                         | i; ``res.upload`` (the | a GPU-held       |
|                            |                         | result: an opt event)  | resident update  |
|                            |                         |                        | is done          |
| ``wire_read[i]``           | main, when it issues    | the AdamW tasks queued | the H2D reading  |
| (schedule),                | the H2D                 | after it               | the old bytes    |
| ``res.wire_read`` (events) |                         | (``synchronize``       | has finished     |
|                            |                         | before a rewrite)      |                  |
| moments futures            | main submits the        | main:                  | the moments pass |
| (``schedule.moments_due``) | moments tasks after the | ``wait_moments(i)``    | has read         |
|                            | close task (last layer  | before the D2H into    | gradient i and   |
|                            | first); the AdamW       | grad i; landing thread | written the      |
|                            | thread runs them        | before a fold into     | moments before a |
|                            |                         | grad i; engine.        | new gradient of  |
|                            |                         | synchronize            | i lands or       |
|                            |                         |                        | anyone reads the |
|                            |                         |                        | moments          |
| ``_closing`` (the close    | main submits it after   | main:                  | the policy's     |
| task)                      | the step's update       | ``begin_speculation``, | record of the    |
|                            | tasks; the AdamW thread | ``engine.synchronize`` | step is in       |
|                            | writes ``policy``       |                        | before the next  |
|                            |                         |                        | speculation      |
| abandon: a no-op landing   | main                    | main waits for each in | the landings     |
| task, then ``undo_all``    |                         | turn                   | have run (no     |
|                            |                         |                        | more speculative |
|                            |                         |                        | updates queued), |
|                            |                         |                        | then they are    |
|                            |                         |                        | undone           |

Adam's step count is the main thread's: the norm task receives it (``enqueue_step`` waits for the
previous decision) and returns the advanced one in its decision (``step_count`` reads it).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .host_update import (
    PHASE_MOMENTS,
    PHASE_WEIGHTS,
    PHASE_WHOLE,
    can_defer,
    native_adam_undo,
    update_segment,
    update_tensor,
)
from .loss_scale import SKIP_MESSAGE, LossScaleAtMinimumError
from .resident import ResidentParams
from .speculation import (
    Speculation,
    SpeculationPolicy,
    adamw_undo,
    await_decision,
    same_hyperparameters,
)
from ..streaming import traced

if TYPE_CHECKING:
    from ..streaming import StreamedLayers
    from ..host import HostLayerStore
    from ..host import LayerStates
    from .loss_scale import LossScaler
    from ..streaming import LayerSchedule
    from ..streaming import StepTimer

# ResidentParams: resident.py's
__all__ = ["HostAdamW", "HostAdamWParts", "ResidentParams", "StepDecision"]


def _range(name: str):
    """A profiler range on the host worker (see timing.layer_range)."""
    return traced(f"megatrain.{name}")


@dataclass(frozen=True, slots=True, eq=False)
class HostAdamWParts:
    """The host optimizer's collaborators, built by the engine before it (one of each per
    engine)."""

    # the last backward's ``backward_done`` event; read on the main and AdamW threads
    executor: StreamedLayers
    # which layers' state is GPU-held now (placed at build or after step 2), the gradient hold
    states: LayerStates
    # the streamed layers' host state: masters, wire copies, gradients, moments
    store: HostLayerStore
    # the per-layer cycle (schedule.py): the window's landings, rewrite, wait_read
    schedule: LayerSchedule
    streams: object  # CudaStreams / CpuStreams (streams.py): the opt stream of GPU-held updates
    timer: StepTimer  # the breakdown's host spans
    resident: ResidentParams  # embeddings, final norm, LM head
    worker: ThreadPoolExecutor  # the landing thread: folds, squared norms, the norm task
    # the AdamW thread: speculative updates, the step's update and close tasks
    opt_worker: ThreadPoolExecutor
    clip: float = 0.0  # gradient_clipping (0: off)
    scaler: LossScaler | None = None  # fp16: gradients arrive multiplied by its scale
    # DataParallel (dp.py) when active: the norm is summed over ranks; None: one process
    dp: object = None
    # the streamed layers' host update: "native" or "torch" (host_update.resolve_kernel)
    kernel: str = "torch"
    # the update after the norm in two passes ([Note: deferred moments], host_update.py)
    defer_moments: bool = False
    # also in a step whose speculation was open (deferred_moments true; "auto": one pass there,
    # [Note: deferred moments])
    defer_when_speculating: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class StepDecision:
    """What the norm task decided for one step. Made on the landing thread and handed on only
    through its future: the step's update tasks and the main thread read it there ([Note: host
    threads])."""

    # pre-clip global norm of the unscaled gradients; inf when skipped (as DeepSpeed reports it)
    norm: float
    skip: bool  # non-finite gradients (every precision; fp16 overflow): nothing is updated
    coef: float  # what the updates multiply the landed gradients by: clip coefficient / loss scale
    # clipping fired or the step is skipped (the speculation policy backs off)
    clipped_or_skipped: bool
    # per param group: the enqueued hyperparameters with the Adam step this step applies
    hp: list[dict]
    step_count: int  # Adam's step count after this step (a skipped step leaves it)
    # the open speculation's verdict: keep its updates as they are (None: none was open)
    commit: bool | None
    message: str | None  # what engine.step() logs for a skipped step (the loss scaler's line)
    error: BaseException | None  # fp16 overflow at the minimum loss scale: engine.step() raises it
    # whose gradients were non-finite (this rank's): streamed layer indices, resident parameter
    # indices
    nonfinite: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())


class HostAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2 when ``adam_w_mode`` is False) over host fp32 master weights.

    Its fields are the main thread's unless said otherwise; the host threads get what they need as
    task arguments and return what they decide through futures ([Note: host threads])."""

    def __init__(
        self,
        param_groups: list[dict],
        defaults: dict,
        parts: HostAdamWParts,
        adam_w_mode: bool = True,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        super().__init__(param_groups, defaults)
        self.adam_w_mode = adam_w_mode  # read by every thread, never changed
        self.parts = parts  # collaborators (immutable); their own threads' rules are in the Note
        self.clip = float(parts.clip)  # the clip ``step()`` applies
        self.kernel = parts.kernel
        # AdamW thread: layers whose weights pass ran and whose moments pass is due, with the (hp,
        # coef) it used ([Note: deferred moments] in host_update.py; the moments task queued behind
        # the step's tasks pops it)
        self._moments_due: dict[int, tuple[list[dict], float]] = {}
        # data parallel: norms summed
        self.dp = parts.dp if parts.dp is not None and parts.dp.active else None
        # main reads the scale; the norm task (landing thread) updates it
        self.scaler = parts.scaler
        # when to speculate (main: allows(), abandon's count; AdamW thread: the close task's record
        # and counts, which main reads after waiting ``_closing``)
        self.policy = policy if policy is not None else SpeculationPolicy(enabled=False, backoff=0)
        self.last_norm: Future | None = None  # the last step's norm future (main)
        self.skipped_steps = 0
        self._step_count = 0  # Adam's step count as of ``_last`` (main; see ``step_count``)
        # the last decision the main thread collected (``_decided``)
        self._last: StepDecision | None = None
        # the last step's decision future, until collected (main)
        self._decision: Future | None = None
        # the speculation that decision closes (main)
        self._decision_spec: Speculation | None = None
        # the last step's close task (speculation accounting; engine waits it)
        self._closing: Future | None = None
        # the open speculation as the main thread sees it (``spec``)
        self._spec: Speculation | None = None
        # main writes it before queueing the landings that read it
        self._landing_spec: Speculation | None = None
        # AdamW thread scratch: one layer's gradient in fp32 for the fused kernel, and in
        # bf16-master mode its master
        store = parts.store
        self._tmp = torch.empty(store.max_train, dtype=torch.float32)
        self._tmp_master = torch.empty(
            store.max_train if store.master_dtype != torch.float32 else 0, dtype=torch.float32
        )
        # the landing thread tells the speculative step of each final landing ([Note: host threads])
        parts.executor.listen(self)
        parts.resident.listen(self)

    # --- what the main thread reads of the last step (DeepSpeed's optimizer attributes among them:
    # accelerate's DeepSpeedOptimizerWrapper.step_was_skipped reads ``overflow``, DeepSpeed-Chat and
    # BingBertSquad ``cur_scale``)
    def _decided(self) -> StepDecision | None:
        """Main thread: the last step's decision once its norm task has run (without waiting for
        it); before that, and when it failed, the one before (and the speculation it would have
        closed stays open)."""
        fut = self._decision
        if fut is not None and fut.done():
            self._decision = None
            if not fut.cancelled() and fut.exception() is None:
                self._last = fut.result()
                self._step_count = self._last.step_count
                if self._spec is self._decision_spec:  # the norm task closed it
                    self._spec = None
            self._decision_spec = None
        return self._last

    @property
    def step_count(self) -> int:
        """Adam's step count (bias correction): advanced by each applied step's norm task, not by a
        skipped one; current once the step's norm future is done (``engine.step()`` waits for
        it)."""
        self._decided()
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:  # main thread, between steps: a checkpoint's count
        self._decided()
        self._step_count = int(value)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped on non-finite gradients (current once its norm future
        is done)."""
        decision = self._decided()
        return decision is not None and decision.skip

    @property
    def step_error(self) -> BaseException | None:
        """fp16: the last step overflowed at the minimum loss scale (``engine.step()`` raises
        it)."""
        decision = self._decided()
        return None if decision is None else decision.error

    @property
    def skip_message(self) -> str | None:
        """The line ``engine.step()`` logs for a skipped step."""
        decision = self._decided()
        return None if decision is None else decision.message

    @property
    def nonfinite_gradients(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Whose gradients were non-finite in the last step (this rank's): streamed layers, resident
        parameters."""
        decision = self._decided()
        return ((), ()) if decision is None else decision.nonfinite

    @property
    def spec(self) -> Speculation | None:
        """The open boundary's speculative updates, as the main thread sees them: from
        ``begin_speculation`` until abandoned or decided by the step's norm task (a forward,
        zero_grad or read of the masters before that rolls them back: ``abandon_speculation``)."""
        self._decided()
        return self._spec

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped on non-finite gradients (every precision; fp16
        overflow). Decided by the norm task: current once ``engine.step()`` has returned (it waits
        for that task)."""
        return self.last_step_skipped

    @property
    def cur_scale(self) -> float:
        """The fp16 loss scale the next backward multiplies the loss by; 1.0 without fp16."""
        return float(self.scaler.scale) if self.scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's ZeRO optimizers' other name for ``cur_scale``."""
        return self.cur_scale

    # --- speculative stepping (see speculation.py) ------------------------------------------------
    def _hyperparameters(self, step) -> list[dict]:
        return [
            dict(
                lr=float(g["lr"]),
                beta1=float(g["betas"][0]),
                beta2=float(g["betas"][1]),
                eps=float(g["eps"]),
                weight_decay=float(g["weight_decay"]),
                step=step,
            )
            for g in self.param_groups
        ]

    def wait_for_close(self) -> None:
        """Main thread: wait for the last step's close task (the speculation's accounting and the
        policy's record of the step; it runs after every update task of the step)."""
        if self._closing is not None:
            self._closing.result()

    def begin_speculation(self, allowed: bool = True) -> None:
        """Main thread, before the backward that closes an accumulation window: open a speculation
        when the policy allows (the previous step's norm task has run: engine.step() waited for it).
        ``allowed``: the engine's check that no layer is loaded again after its gradient lands (one
        forward per layer)."""
        self._spec = self._landing_spec = None
        self.wait_for_close()  # the previous step's accounting (policy) is in
        if allowed and self.policy.allows():
            scale = self.scaler.scale if self.scaler is not None else 1.0
            spec = Speculation(hp=self._hyperparameters(self.step_count + 1), coef=1.0 / scale)
            # before the backward queues the landings that read it
            self._spec = self._landing_spec = spec
            # the layers' gradients land last layer first, and each is stepped as it lands: read
            # ahead that way
            self.parts.store.expect_moments(reversed(range(len(self.parts.store.layouts))))

    # LandingListener (landing.py): the landing thread, inside a landing task. See [Note: host
    # threads].
    def before_final_fold(self, i: int) -> None:
        """A second final gradient for layer i (two forwards into one loss): a layer already stepped
        is undone now (after its queued update, on the AdamW thread), while its gradient is still
        the one the step used; it is updated with the sum after the norm."""
        spec = self._landing_spec
        if spec is None or spec.closed:
            return
        if i in spec.landed:
            spec.stale.add(i)
            self.parts.opt_worker.submit(self._unspeculate, i, spec).result()

    def final_landing(self, i: int, sq) -> None:
        """Right after layer i's final gradient landed: queue its update with coefficient 1 on the
        AdamW thread."""
        spec = self._landing_spec
        if (
            spec is None
            or spec.closed
            or spec.stopped
            or i in spec.stale
            or self.parts.states.on_gpu(i)
        ):
            return
        spec.landed.add(i)
        if sq is None or not math.isfinite(sq):
            # the step will be skipped (or this layer's norm is unknown): stop here
            spec.stopped = True
            return
        spec.pending.append(i)
        # taken newest first ([Note: newest landing first]), but on the NVMe tier (its read-ahead
        # is in landing order)
        self.parts.opt_worker.submit(
            self._speculate_next,
            spec,
            not self.parts.states.has_disk_tier(),
        )

    def final_resident_landing(self, k: int, sq) -> None:
        """After resident parameter k's gradient landed (after the backward): queue its update now,
        so the update the next forward waits for first (the embedding's) is under way before the
        norm."""
        spec, res = self._landing_spec, self.parts.resident
        if (
            spec is None
            or spec.closed
            or spec.stopped
            or res.on_device
            or k in spec.resident_landed
        ):
            return
        spec.resident_landed.add(k)
        if sq is None or not math.isfinite(sq):
            spec.stopped = True
        else:
            self.parts.opt_worker.submit(self._speculative_resident_update, k, spec)

    def _speculative_update(self, i: int, spec: Speculation) -> None:
        """AdamW thread: layer i's update with the speculation's coefficient, unless the norm is
        already known (then the plain update after the norm does it, in forward order) or the step
        is doomed."""
        if spec.closed or spec.stopped or i in spec.stale:
            return
        with self.parts.timer.host_span("speculative_s") as span, _range(f"speculate.L{i}"):
            span["updated_params"] = self._update_layer(i, spec.hp, spec.coef)
        spec.done.append(i)

    def _speculate_next(self, spec: Speculation, newest: bool) -> None:
        """AdamW thread: the speculative update of the newest (else the oldest) landing not yet
        taken (a task each)."""
        if spec.pending:
            self._speculative_update(spec.pending.pop(-1 if newest else 0), spec)

    def _unspeculate(self, i: int, spec: Speculation) -> None:
        if i in spec.done:
            self._undo_layer(i, spec)
            spec.done.remove(i)

    def _speculative_resident_update(self, k: int, spec: Speculation) -> None:
        if spec.closed or spec.stopped:
            return
        res = self.parts.resident
        if res.wire_read is not None:
            res.wire_read.synchronize()  # the last upload has read the wire copy
        with self.parts.timer.host_span("speculative_s") as span, _range(f"speculate.resident{k}"):
            span["updated_params"] = self._update_resident_one(k, spec.hp, spec.coef)
        spec.resident_done.append(k)

    def _undo_resident(self, k: int, spec: Speculation) -> None:
        with self.parts.timer.host_span("rollback_s"):
            self.parts.resident.undo_one(k, spec.hp, spec.coef, self.adam_w_mode)

    def abandon_speculation(self) -> None:
        """Main thread: the speculated updates must not be seen (a forward, zero_grad, a read of the
        masters between backward() and step()): wait for the landings, roll every speculated layer
        back."""
        spec = self.spec
        self._spec = self._landing_spec = None
        if spec is None:
            return

        def undo_all():
            for i in spec.done:
                self._undo_layer(i, spec)
            for k in spec.resident_done:
                self._undo_resident(k, spec)

        # the landings queued so far have run (and queued updates)
        self.parts.worker.submit(lambda: None).result()
        spec.closed = True  # updates queued but not started are dropped
        self.parts.opt_worker.submit(undo_all).result()
        # a slot loaded meanwhile would hold the rolled-forward weights; data parallel: every layer
        # on every rank (the ranks' slots stay in step, and the owners' broadcasts bring the
        # rolled-back bytes; dp.py)
        for i in spec.done if self.dp is None else range(len(self.parts.store.layouts)):
            self.parts.schedule.invalidate(i)
        if spec.done or spec.resident_done:
            self.policy.rolled_back += 1

    def _undo_layer(self, i: int, spec: Speculation) -> None:
        store = self.parts.store
        # See [Note: host threads]: the last H2D of wire i has finished
        self.parts.schedule.wait_read(i)
        layout = store.layouts[i]
        grad = store.grad_of(i)
        master, m, v = self._state(i)
        try:
            with self.parts.timer.host_span("rollback_s"), _range(f"rollback.L{i}"):
                # [Note: native rollback]: one pass, the wire copy written in it (the segments
                # cover the trainable region [0, n_train), model_map.build_layout)
                if self.kernel == "native":
                    wire = None if store.wire_is_master else store.wire_of(i)
                    for group, a, b in layout.segments:
                        native_adam_undo(
                            master[a:b],
                            grad[a:b],
                            m[a:b],
                            v[a:b],
                            spec.hp[group],
                            spec.coef,
                            self.adam_w_mode,
                            None if wire is None else wire[a:b],
                        )
                else:
                    if grad.dtype != torch.float32:
                        grad = self._tmp[: layout.n_train].copy_(grad)
                    for group, a, b in layout.segments:
                        adamw_undo(
                            master[a:b],
                            grad[a:b],
                            m[a:b],
                            v[a:b],
                            spec.hp[group],
                            spec.coef,
                            self.adam_w_mode,
                        )
                    store.refresh_wire(i, master)
        finally:
            store.release_moments(i)

    def _state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's master and Adam moments, acquired for an update (RAM views, or the NVMe tier's
        staging buffer: the time spent waiting for its read is the breakdown's ``nvme_wait_s``). The
        caller releases them (``release_moments``)."""
        store = self.parts.store
        if not self.parts.states.moments_on_disk(i):
            return store.acquire_state(i)
        with self.parts.timer.host_span("nvme_wait_s"), _range(f"nvme_read.L{i}"):
            return store.acquire_state(i)

    def _settle(self, i: int, decision: StepDecision, spec: Speculation):
        """Layer i was stepped speculatively: keep it (the norm task committed), or undo it and step
        it again with the true coefficient (or leave it rolled back, when the step is skipped)."""
        if decision.commit:
            return
        self._undo_layer(i, spec)
        if not decision.skip:
            with self.parts.timer.host_span("optimizer_s") as span:
                span["updated_params"] = self._update_layer(i, decision.hp, decision.coef)

    # --- the step ---------------------------------------------------------------------------------
    def step(self, closure=None) -> Future:
        """Queue clip + update of every parameter (the engine calls this at accumulation boundaries;
        going through ``step`` lets torch's LR schedulers see that the optimizer stepped). Returns
        the future of the pre-clip global norm."""
        if closure is not None:
            raise NotImplementedError("HostAdamW.step(closure): closures are not supported")
        return self.enqueue_step(self.clip)

    def host_state_dict(self) -> dict:
        """Adam moments (flat host buffers, no copy), step count and group hyperparameters. The
        caller has run ``engine.sync_masters_to_host()``."""
        store, res = self.parts.store, self.parts.resident
        cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
        return {
            "step_count": self.step_count,
            "adam_w_mode": self.adam_w_mode,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
            "exp_avg": store.exp_avg,
            "exp_avg_sq": store.exp_avg_sq,
            "resident_exp_avg": [cpu(t) for t in res.exp_avg],
            "resident_exp_avg_sq": [cpu(t) for t in res.exp_avg_sq],
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients accumulated since the last step (the next landing overwrites)."""
        self.parts.schedule.reset_window()
        self.parts.resident.reset_window()

    def enqueue_step(self, clip: float) -> Future:
        """Queue norm + clipping + AdamW for every parameter; return the future of the pre-clip norm
        (inf when the step is skipped). Adam's step count is not known yet: the norm task advances
        it (and writes it into its decision's ``hp``) only when the step is applied, so a skipped
        step leaves bias correction as it was (DeepSpeed's). See [Note: host threads]."""
        parts = self.parts
        hp = self._hyperparameters(step=None)
        # the step count this one advances (engine.step() waited for it already)
        if self._decision is not None:
            wait_futures([self._decision])
        # (the previous decision collected: its speculation is no longer open)
        step_count = self.step_count
        # This boundary's speculation stays open while landings are still queued on the worker (they
        # keep speculating); the norm task, which runs after all of them (FIFO), closes it.
        spec = self._spec
        ex, res, store, schedule = parts.executor, parts.resident, parts.store, parts.schedule
        layer_sq, layer_has = schedule.close_window()
        res_sq, res_has = res.close_window()
        scale = self.scaler.scale if self.scaler is not None else 1.0  # the scale the backward used
        decided = parts.worker.submit(
            self._norm_task,
            layer_sq,
            res_sq,
            layer_has,
            res_has,
            scale,
            float(clip),
            hp,
            spec,
            step_count,
        )
        self._decision, self._decision_spec = decided, spec
        # FIFO order of the AdamW thread: the resident parameters first (the embedding is used
        # first; held on the GPU, its update also heads the opt stream), then the GPU-held layers
        # (they only launch kernels), then the host layers in forward order.
        n = len(store.layouts)
        on_device = [i for i in range(n) if self.parts.states.on_gpu(i)]
        host = [i for i in range(n) if i not in set(on_device)]
        defer = parts.defer_moments and (spec is None or parts.defer_when_speculating)
        states = parts.states  # the order the layer tasks below take their gradients in
        states.expect_grad_takes([i for i in host if layer_has[i]], ex.backward_done)
        res.rewrite(
            parts.opt_worker.submit(self._resident_task, res_has, decided, ex.backward_done, spec)
        )
        for i in on_device:
            if layer_has[i]:
                schedule.rewrite(
                    i, parts.opt_worker.submit(self._device_task, i, decided, ex.backward_done)
                )
        for i in host:
            if layer_has[i] and not states.holds(i):  # another rank updates it: the slot goes stale
                # (its owner's broadcast, after its update, brings the new bytes)
                schedule.rewrite(i, decided)
            elif layer_has[i]:
                schedule.rewrite(
                    i, parts.opt_worker.submit(self._layer_task, i, decided, spec, defer)
                )
        # after every update task (FIFO)
        self._closing = parts.opt_worker.submit(self._close_task, decided, spec)
        if defer:  # [Note: deferred moments]: after the close task (the next step's speculation
            # waits for that one, not for these); last layer first, the order the next backward
            # lands gradients in
            for i in reversed(host):
                if layer_has[i] and states.holds(i):
                    schedule.defer_moments(i, parts.opt_worker.submit(self._moments_task, i))
        self.last_norm = _norm_of(decided)
        return self.last_norm

    def _norm_task(
        self, layer_sq, res_sq, layer_has, res_has, scale, clip, hp, spec, step_count
    ) -> StepDecision:
        """Landing thread: the global norm, and the decision every update task of this step reads
        (they wait for this task's future): skip the step when the norm is not finite -- in every
        precision, as DeepSpeed (its bf16 optimizer, ZeRO, fp16 loss scaling) -- or apply it with
        this clip coefficient and Adam step."""
        with _range("norm"):
            return self._norm(
                layer_sq, res_sq, layer_has, res_has, scale, clip, hp, spec, step_count
            )

    def _norm(
        self, layer_sq, res_sq, layer_has, res_has, scale, clip, hp, spec, step_count
    ) -> StepDecision:
        # One entry per layer, then per resident parameter, added in that order whatever the ranks:
        # data parallel, each entry is filled by its canonical holder only and the vector
        # all-reduced (exact: one term each), so the sum is one process's and every topology's
        # ([Note: data parallel] in dp.py)
        dp, squares = self.dp, []
        for futures, has, resident in ((layer_sq, layer_has, False), (res_sq, res_has, True)):
            for k, fut in enumerate(futures):
                mine = dp is None or dp.rank == (dp.resident_owner(k) if resident else dp.owner(k))
                if not has[k] or not mine:
                    squares.append(0.0)
                    continue
                sq = fut.result()
                if sq is None:  # the window's boundary was moved after its backward: norm it now
                    g = self.parts.resident.grad_of(k) if resident else self.parts.states.grad(k)
                    # rare: slow is ok
                    sq = float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
                squares.append(sq)
        if dp is not None:  # one all-reduce of the vector (gloo, this thread's group)
            squares = dp.sum_norms(squares)
        total = 0.0
        for sq in squares:
            total += sq
        # non-finite squared norms (every rank sees the reduced vector): layers, residents
        n_layers = len(layer_sq)
        bad = (
            [k for k in range(n_layers) if not math.isfinite(squares[k])],
            [k - n_layers for k in range(n_layers, len(squares)) if not math.isfinite(squares[k])],
        )
        norm = math.sqrt(total) / scale  # of the unscaled gradients
        overflow = not math.isfinite(norm)
        message, error = (SKIP_MESSAGE if overflow else None), None
        if self.scaler is not None:
            try:
                message = self.scaler.update(overflow)
            # raised to the script by engine.step(); the tasks skip
            except LossScaleAtMinimumError as exc:
                error = exc
        if not overflow:
            step_count += 1
        hp = [dict(group, step=step_count) for group in hp]
        coef = 1.0
        if clip > 0 and not overflow:
            coef = min(1.0, clip / (norm + 1e-6))
        commit = None
        # every landing ran before this task; speculative updates may still be running on the
        # AdamW thread: those not started are left to the plain update
        if spec is not None:
            spec.closed = True
            commit = (
                not overflow and coef / scale == spec.coef and same_hyperparameters(hp, spec.hp)
            )
        # DeepSpeed reports a skipped step's norm as inf
        decision = StepDecision(
            norm=math.inf if overflow else norm,
            # the updates multiply the landed gradients by it
            skip=overflow,
            coef=coef / scale,
            clipped_or_skipped=overflow or coef < 1.0,
            hp=hp,
            step_count=step_count,
            commit=commit,
            message=message,
            error=error,
            nonfinite=(tuple(bad[0]), tuple(bad[1])),
        )
        self._expect_updates(layer_has, decision, spec)
        return decision

    def _expect_updates(self, layer_has, decision: StepDecision, spec: Speculation | None) -> None:
        """Tell the NVMe tier which layers the update tasks queued behind this norm will touch, in
        their (forward) order, so their moments are read ahead: a layer stepped speculatively is
        done when the speculation commits, and needs its undo (and redo) otherwise; the other layers
        are updated unless the step is skipped."""
        store = self.parts.store
        if not self.parts.states.has_disk_tier():
            return
        # a hint: speculative updates may still be running
        done = set(spec.done) if spec is not None else set()
        commit, skip = bool(decision.commit), decision.skip
        store.expect_moments(
            [
                i
                for i, has in enumerate(layer_has)
                if has and ((i not in done and not skip) or (i in done and not commit))
            ]
        )

    def _close_task(self, decided: Future, spec: Speculation | None) -> None:
        """AdamW thread, after the step's update tasks: the speculation's final accounting (which
        layers were stepped during the backward is known only now) and the policy's record of this
        step."""
        decision = decided.result()
        rolled_back = False
        # data parallel: whether this rank stepped a layer early is its own timing; the policy
        # (which decides the next speculation, hence which slots a rollback invalidates) must agree
        # across ranks: any open one counts
        if spec is not None and (spec.done or spec.resident_done or self.dp is not None):
            self.policy.speculated += 1
            rolled_back = not decision.commit
            self.policy.rolled_back += int(rolled_back)
        self.policy.record(clipped_or_skipped=decision.clipped_or_skipped, rolled_back=rolled_back)

    def _resident_task(self, has, decided: Future, backward_done, spec: Speculation | None = None):
        """AdamW thread: the resident parameters' update. Returns the opt-stream event after it when
        their state is GPU-held, else None. The head of the step's tasks: it steps landings until
        the norm (await_decision)."""
        newest = not self.parts.states.has_disk_tier()  # (_speculate_next)
        decision = await_decision(decided, spec, lambda s: self._speculate_next(s, newest))
        # stepped after the backward: keep them, or undo them (the plain update below then
        # redoes them, unless the step is skipped)
        if spec is not None and spec.resident_done:
            if decision.commit:
                has = [h and k not in spec.resident_done for k, h in enumerate(has)]
            else:
                for k in spec.resident_done:
                    self._undo_resident(k, spec)
        if decision.skip:  # non-finite gradients: this step is skipped
            return None
        res, st = self.parts.resident, self.parts.streams
        if res.on_device:  # launch on the opt stream; upload()'s casts wait for the event after it
            st.wait(st.opt, backward_done)
            with st.on(st.opt):
                self._update_resident(decision.hp, has, decision.coef)
            return st.record(st.opt)
        if res.wire_read is not None:
            res.wire_read.synchronize()  # the last upload has read the wire copies
        with self.parts.timer.host_span("optimizer_s") as span, _range("adamw.resident"):
            span["updated_params"] = self._update_resident(decision.hp, has, decision.coef)
        return None

    def _update_resident(self, hp, has, coef: float) -> int:
        """The parameters updated: the breakdown's Gparam/s counts them with their time (3B's tied
        embedding: 10%)."""
        # data parallel: the parameters this rank holds (another's owner updates the rest)
        res = self.parts.resident
        return sum(
            self._update_resident_one(k, hp, coef)
            for k in range(len(res.params))
            if has[k] and res.holds(k)
        )

    def _update_resident_one(self, k: int, hp, coef: float) -> int:
        # host: one native pass that writes the wire too; GPU-held: torch's fused kernel
        res = self.parts.resident
        update_tensor(
            res.master[k],
            res.grad_of(k, fp32=self.kernel != "native"),
            res.exp_avg[k],
            res.exp_avg_sq[k],
            hp[res.group_of.get(id(res.params[k]), 0)],
            coef,
            self.adam_w_mode,
            res.wire[k],
            self.kernel,
        )
        return res.master[k].numel()

    def _device_task(self, i: int, decided: Future, backward_done):
        """Launch layer i's update on the GPU, on the opt stream; the cast that reads the device
        master for the next forward waits for the event recorded after it
        (``schedule.device_ready``)."""
        decision = decided.result()
        if decision.skip:
            return
        st = self.parts.streams
        st.wait(st.opt, backward_done)  # the gradient accumulators are complete
        master, grad, m, v = self.parts.states.device_update_state(i)
        with st.on(st.opt), _range(f"adamw_gpu.L{i}"):
            for group, a, b in self.parts.store.layouts[i].segments:
                update_tensor(
                    master[a:b],
                    grad[a:b],
                    m[a:b],
                    v[a:b],
                    decision.hp[group],
                    decision.coef,
                    # GPU tensors: torch's fused kernel
                    self.adam_w_mode,
                    None,
                    self.kernel,
                )
        self.parts.schedule.updated_on_device(i, st.record(st.opt))

    def _layer_task(
        self, i: int, decided: Future, spec: Speculation | None = None, defer: bool = True
    ):
        decision = decided.result()
        if spec is not None and i in spec.done:  # final: the norm task ran after every landing
            return self._settle(i, decision, spec)
        if decision.skip:
            return
        with self.parts.timer.host_span("optimizer_s") as span, _range(f"adamw.L{i}"):
            span["updated_params"] = self._update_layer(i, decision.hp, decision.coef, defer=defer)

    def _can_defer(self, i: int, hp) -> bool:
        """Layer i's update may leave its moments to a later pass ([Note: deferred moments]): on,
        the layer's state in RAM (the NVMe tier writes a region back whole), AdamW or no weight
        decay in each of its groups."""
        store = self.parts.store
        return (
            self.parts.defer_moments
            and not self.parts.states.moments_on_disk(i)
            and all(
                can_defer(self.adam_w_mode, hp[group]) for group, _, _ in store.layouts[i].segments
            )
        )

    def _update_layer(self, i: int, hp, coef: float, defer: bool = False) -> int:
        """Layer i's AdamW, each segment in one pass of the native kernel ([Note: native host
        update]) or in cache-sized blocks of torch's ([Note: blocked host update]); both
        bit-identical to torch's fused AdamW. ``defer``: the weights pass only when the layer allows
        it, its moments pass left to ``_moments_task``."""
        store = self.parts.store
        # the last H2D reading wire i has finished. See [Note: host threads]
        self.parts.schedule.wait_read(i)
        layout = store.layouts[i]
        grad = self.parts.states.take_grad(i)  # (held on the device: a pinned slab, grad_hold.py)
        phase = PHASE_WEIGHTS if defer and self._can_defer(i, hp) else PHASE_WHOLE
        master, m, v = self._state(i)  # RAM views, or an NVMe layer's staged copies
        wire = None if store.wire_is_master else store.wire_of(i)
        try:
            for group, a, b in layout.segments:
                update_segment(
                    master,
                    grad,
                    m,
                    v,
                    a,
                    b,
                    hp[group],
                    coef,
                    self.adam_w_mode,
                    wire,
                    self._tmp,
                    self._tmp_master,
                    kernel=self.kernel,
                    phase=phase,
                )
            if phase == PHASE_WEIGHTS:
                self._moments_due[i] = (hp, coef)
            # the caller's span counts it: the breakdown's Gparam/s of the host update
            return layout.n_train
        finally:
            # a disk layer's region is written back behind the next updates
            store.release_moments(i)
            self.parts.states.give_grad(i)

    def _moments_task(self, i: int) -> None:
        """AdamW thread, after the step's update tasks: layer i's moments pass if its weights pass
        ran ([Note: deferred moments]; not for a skipped step, a speculated layer, a failed or whole
        update): the same moments."""
        due, store = self._moments_due.pop(i, None), self.parts.store
        # RAM views: a deferred layer is never on the NVMe tier (no release needed)
        if due is not None:
            (master, m, v), grad = store.acquire_state(i), store.grad_of(i)
            with self.parts.timer.host_span("moments_s"), _range(f"adamw_moments.L{i}"):
                for group, a, b in store.layouts[i].segments:
                    update_segment(
                        master,
                        grad,
                        m,
                        v,
                        a,
                        b,
                        due[0][group],
                        due[1],
                        self.adam_w_mode,
                        None,
                        self._tmp,
                        self._tmp_master,
                        kernel=self.kernel,
                        phase=PHASE_MOMENTS,
                    )


def _norm_of(decided: Future) -> Future:
    """The future of ``decided``'s pre-clip norm (what ``step()`` returns and
    ``get_global_grad_norm`` reads): done, on the landing thread, right after the decision; its
    error, if the norm task failed."""
    norm: Future = Future()

    def done(fut: Future) -> None:
        if fut.cancelled():
            norm.cancel()
        elif fut.exception() is not None:
            norm.set_exception(fut.exception())
        else:
            norm.set_result(fut.result().norm)

    decided.add_done_callback(done)
    return norm
