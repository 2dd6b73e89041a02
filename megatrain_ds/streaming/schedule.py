"""One owner of the per-layer schedule state: what the executor, the host optimizer and the engine
agree on.

Each streamed layer i moves through one cycle per optimizer step:

    rewritten(v) --load--> on the device (slot.version == v)
        --forward/backward--> landed (gradient in host memory, squared norm known)
        --close_window--> rewritten(v+1) by the optimizer task ...

``LayerSchedule`` holds every field of that cycle and is the only place they change:

| field              | written by (method)              | read by                                  |
|--------------------|----------------------------------|------------------------------------------|
| ``version[i]``     | ``rewrite`` (optimizer enqueues  | executor: a slot holding an older        |
|                    | i's update), ``invalidate``      | version is stale and is reloaded         |
|                    | (weights written outside it:     |                                          |
|                    | rollback, load, set_*)           |                                          |
| ``wire_ready[i]``  | ``rewrite``                      | ``wait_rewritten`` before the H2D of     |
|                    |                                  | wire i                                   |
| ``wire_read[i]``   | ``loaded`` (the H2D event)       | ``wait_read`` before the optimizer       |
|                    |                                  | rewrites i                               |
| ``device_ready``   | ``updated_on_device`` (GPU-held  | the H2D stream, before casting i's       |
|                    | state)                           | master                                   |
| ``has_grad[i]``,   | ``landing`` (a gradient of i     | ``close_window`` (the optimizer's norm   |
| ``sq_norm[i]``     | went to the host worker)         | and update tasks), engine/surface reads  |
| ``forward_calls``  | ``forward`` /                    | the engine's speculation check (one      |
|                    | ``backward_finished``            | forward)                                 |
| ``backward_calls`` | ``backward`` /                   | the engine's check that a script's own   |
|                    | ``backward_finished``            | loss.backward() reached every layer      |
| ``moments_due[i]`` | ``defer_moments`` (the           | ``wait_moments`` before a new gradient   |
|                    | optimizer's moments pass of i,   | of i is written; engine.synchronize      |
|                    | queued at the step)              |                                          |

Invariants (asserted where cheap): a version only grows; wire i is rewritten only by the task in
``wire_ready[i]``, which waits ``wire_read[i]`` first (the last H2D of the old bytes has finished);
the H2D of wire i starts only after ``wire_ready[i]`` has run; ``has_grad[i]`` iff a landing of i
was queued in the open window. The device side of the same cycle (events between streams) is [Note:
stream and event ordering] in streams.py.
"""

from __future__ import annotations

from concurrent.futures import Future

from .timing import traced


class LayerSchedule:
    def __init__(self, n_layers: int) -> None:
        self.n = n_layers
        self.version = [0] * n_layers
        self.wire_ready: list[Future | None] = [None] * n_layers
        self.wire_read: list[object] = [None] * n_layers
        self.has_grad = [False] * n_layers
        self.sq_norm: list[Future | None] = [None] * n_layers
        # grad-enabled forwards of each layer since the last backward
        self.forward_calls = [0] * n_layers
        # backwards through each layer since then (autograd's thread)
        self.backward_calls = [0] * n_layers
        # GPU-held state: event after i's update (opt stream)
        self.device_ready: list[object] = [None] * n_layers
        # i's deferred moments pass (host_update.py's [Note: deferred moments]): it reads gradient
        # i, so no new gradient of i is written before it has run
        self.moments_due: list[Future | None] = [None] * n_layers

    # --- weights ----------------------------------------------------------------------------------
    def rewrite(self, i: int, task: Future) -> None:
        """The optimizer queued ``task``, which rewrites layer i's weights: slots holding them go
        stale and the next H2D of wire i waits for it."""
        self.version[i] += 1
        self.wire_ready[i] = task

    def invalidate(self, i: int | None = None) -> None:
        """Layer i's weights (all layers': None) were written outside an optimizer task: stale slots
        reload."""
        for j in range(self.n) if i is None else (i,):
            self.version[j] += 1

    def wait_rewritten(self, i: int, timer) -> None:
        """Main thread, before the H2D of wire i: the optimizer's update of i has run (or re-raise
        its error)."""
        pending = self.wire_ready[i]
        if pending is None:
            return
        if not pending.done():
            with timer.host_span("wait_for_optimizer_s"), traced(f"megatrain.wait_optimizer.L{i}"):
                # the only place the GPU can wait on the CPU (see streams.py's Note)
                pending.result()
        else:
            pending.result()

    def updated_on_device(self, i: int, event) -> None:
        """Layer i's GPU-held master was updated by kernels that ``event`` follows (the opt
        stream)."""
        self.device_ready[i] = event

    def loaded(self, i: int, event) -> None:
        """The H2D of wire i was issued; ``event`` completes when it has read the bytes."""
        self.wire_read[i] = event

    def wait_read(self, i: int) -> None:
        """Host worker, before rewriting wire i: the last H2D reading it has finished."""
        if self.wire_read[i] is not None:
            self.wire_read[i].synchronize()

    # --- gradients --------------------------------------------------------------------------------
    def defer_moments(self, i: int, task: Future) -> None:
        """The optimizer queued ``task``, layer i's moments pass, which reads gradient i as the step
        left it."""
        self.moments_due[i] = task

    def moments_of(self, i: int) -> Future | None:
        """Layer i's moments pass as queued now. A landing takes it when it is queued (main thread),
        not when its fold runs on the landing thread: by then step() may have queued the next pass
        of i, behind the norm task, which runs behind that very fold (waiting for it would
        deadlock)."""
        return self.moments_due[i]

    def wait_moments(self, i: int, pending: Future | None, timer) -> None:
        """Before a new gradient of layer i is written into its home (the main thread's D2H, the
        landing thread's fold): ``pending``, i's moments pass as ``moments_of(i)`` gave it when the
        landing was queued, has run (or re-raise its error). Normally long done: the pass runs last
        layer first from the end of the forward, ahead of the backward's landings; a wait shows as
        ``wait_for_moments_s``."""
        if pending is None:
            return
        if not pending.done():
            with timer.host_span("wait_for_moments_s"), traced(f"megatrain.wait_moments.L{i}"):
                pending.result()
        else:
            pending.result()

    def pending_moments(self) -> list[Future]:
        return [f for f in self.moments_due if f is not None]

    def first_landing(self, i: int) -> bool:
        return not self.has_grad[i]

    def landing(self, i: int, task: Future) -> None:
        """A gradient of layer i was handed to the host worker; ``task`` returns its squared norm
        (final landing of the window) or None."""
        self.has_grad[i] = True
        self.sq_norm[i] = task

    def close_window(self) -> tuple[list, list[bool]]:
        """The accumulation window ends (optimizer step): its landings, then a fresh window."""
        out = list(self.sq_norm), list(self.has_grad)
        self.reset_window()
        return out

    def reset_window(self) -> None:
        self.has_grad = [False] * self.n
        self.sq_norm = [None] * self.n

    # --- forwards ---------------------------------------------------------------------------------
    def forward(self, i: int) -> None:
        self.forward_calls[i] += 1

    def backward(self, i: int) -> None:
        self.backward_calls[i] += 1

    def backward_finished(self) -> None:
        self.forward_calls = [0] * self.n
        self.backward_calls = [0] * self.n

    def backward_missed(self) -> list[int]:
        """Layers that ran a grad-enabled forward since the last backward but no backward: the
        backward stopped before them (it raised), when it reached any layer at all."""
        if not any(self.backward_calls):
            return []
        return [i for i in range(self.n) if self.forward_calls[i] and not self.backward_calls[i]]

    def one_forward_each(self) -> bool:
        """Every layer ran exactly one grad-enabled forward since the last backward (speculation
        needs it)."""
        return all(n == 1 for n in self.forward_calls)
