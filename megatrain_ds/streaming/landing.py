"""Gradient landing: where a streamed layer's flat gradient goes once its backward has made it (a
mixin of ``StreamedLayers``, executor.py; the backward calls ``_evacuate(i, flat_grad)``).

It owns the path from the GPU to the gradient's home and the layer's squared norm on the way:

- data parallel (dp.py): the mean over ranks, reduced onto layer i's owner on the ``d2h`` stream; a
  rank that does not own the layer lands nothing (its share of the norm is 0.0);
- a layer whose optimizer state lives on the GPU (device_state.py): accumulated there in fp32, only
  its norm goes to the host;
- otherwise one D2H burst: straight into the pinned gradient home (GA 1: its norm taken on the GPU),
  or into a slab of the landing ring (GA > 1), or into a temporary buffer for a second gradient of
  the window; then the host worker thread waits for the copy (``landed``), folds the bytes into the
  layer's gradient (``_fold``), takes its squared norm and tells the final landing to the
  speculative step (``landing_listener``, a ``LandingListener``).

Every record and wait (``grad_ready``, ``landed``) is in [Note: stream and event ordering] in
streams.py; the landing futures go to ``LayerSchedule.landing`` (schedule.py); what the landing
thread hands the other host threads is [Note: host threads] in optimizer.py.

What it reads of ``StreamedLayers``: ``streams``, ``schedule``, ``worker``, ``timer``, ``dp``,
``device``, ``states`` (layer_state.py: where each gradient lands, ``grad_home``, and the buffers
on its way), ``norm_dev``/``norm_host``, ``final_micro``, ``landing_listener`` and ``_log``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..host import GradHome
from .timing import layer_range as _range


def _done_zero():
    from ..parallel import done

    return done(0.0)


# a completed landing whose squared norm is 0.0 (a layer another rank owns)
_DONE_ZERO = _done_zero()


class LandingListener(Protocol):
    """Who is told of the final gradient landings of a window (the host optimizer's speculative
    step). Registered once, before any backward, with ``StreamedLayers.listen`` /
    ``ResidentParams.listen``; every call is made on the landing thread, in landing order, inside
    the landing task (the norm task, queued after it, sees its effects). See [Note: host threads] in
    optimizer.py."""

    def before_final_fold(self, i: int) -> None:
        """Layer i's final landing is about to be folded into its gradient home (which still holds
        what an earlier final landing of the window left: a layer stepped on it is undone now)."""

    def final_landing(self, i: int, sq_norm: float | None) -> None:
        """Layer i's final gradient is in its host home; its squared norm (None: not taken)."""

    def final_resident_landing(self, k: int, sq_norm: float | None) -> None:
        """Resident parameter k's final gradient is in its fp32 home; its squared norm."""


class GradientLanding:
    """The gradient landing of ``StreamedLayers`` (module docstring): D2H evacuation, accumulation,
    norms."""

    def _evacuate(self, i: int, flat_grad: torch.Tensor) -> None:
        """D2H layer i's flat gradient; the host worker accumulates it and (if final) takes its
        norm."""
        st = self.streams
        first, final = self.schedule.first_landing(i), self.final_micro
        # the mean over ranks, on layer i's owner (dp.py); d2h current: off compute
        if self.dp is not None:
            st.wait(st.d2h, st.record(st.compute()))
            with st.on(st.d2h), self.timer.span("comm", st.d2h), _range("reduce", i):
                self.dp.reduce_layer_grad(flat_grad, i)
            # d2h reads it from here on (the mean, the accumulate, the norm, the D2H): the caching
            # allocator must not hand its block to compute before d2h is done with it
            st.hand_over(flat_grad, st.d2h)
            if not self.states.holds(i):  # nothing lands here; its squared norm: the owner's share
                self.schedule.landing(i, _DONE_ZERO)
                self._log("reduce", i, None)
                return
            # the owner's norm / accumulate / D2H follow the reduce on d2h, not compute
            # (engine.backward joins d2h at the end)
            with st.on(st.d2h):
                return self._land_local(i, flat_grad, first, final)
        return self._land_local(i, flat_grad, first, final)

    def _land_local(self, i: int, flat_grad: torch.Tensor, first: bool, final: bool) -> None:
        """Layer i's (mean) gradient into its home: the GPU-held accumulator, or D2H and the host
        worker."""
        st, states = self.streams, self.states
        slab = None  # a landing slab of the ring (GA > 1), returned to the ring by the fold
        home = states.grad_home(i)
        if home is GradHome.DEVICE or home is GradHome.HOLD:  # HOLD: [Note: gradients held on the
            # device] (grad_hold.py); both: only the norm goes to the host
            return self._accumulate_on_device(i, flat_grad, first, final, home is GradHome.HOLD)
        direct = home is GradHome.DIRECT
        if direct and not first:
            # A second gradient for layer i before the step (two forwards into one loss, as a DPO
            # step with separate chosen/rejected passes; or a second backward() with GA 1): it lands
            # in a temporary pinned buffer and the worker adds it to the first, in the home's dtype,
            # as autograd would.
            dest = states.extra_landing(flat_grad.numel(), pin=self.device.type == "cuda")
            if dest.dtype != flat_grad.dtype:
                flat_grad = flat_grad.to(dest.dtype)
        elif direct:
            # the moments pass has read the old gradient ([Note: deferred moments] in
            # host_update.py)
            self.schedule.wait_moments(i, self.schedule.moments_of(i), self.timer)
            dest = states.grad(i)
            # GA 1: the gradient is final as it leaves the GPU, so its norm is taken there
            if final:
                torch.linalg.vector_norm(flat_grad, dtype=torch.float32, out=self.norm_dev[i])
            if dest.dtype != flat_grad.dtype:
                # fp32 landing: convert on the GPU, not the host
                flat_grad = flat_grad.to(dest.dtype)
        else:
            slab = states.landing_slab()  # blocks only if the worker is the ring's length behind
            dest = slab[: flat_grad.numel()]
        grad_ready = st.record(st.compute())
        st.wait(st.d2h, grad_ready)
        with st.on(st.d2h), self.timer.span("d2h", st.d2h), _range("d2h", i):
            dest.copy_(flat_grad, non_blocking=True)
            if direct and first and final:
                self.norm_host[i : i + 1].copy_(self.norm_dev[i : i + 1], non_blocking=True)
        st.hand_over(flat_grad, st.d2h)
        landed = st.record(st.d2h)
        self._log("d2h", i, None)
        moments = self.schedule.moments_of(i) if first and not direct else None  # taken now
        self.schedule.landing(
            i, self.worker.submit(self._land, i, landed, dest, slab, first, final, moments)
        )

    def _accumulate_on_device(
        self, i: int, flat_grad: torch.Tensor, first: bool, final: bool, held: bool = False
    ) -> None:
        """The gradient stays on the GPU, only its norm goes to the host: a GPU-held layer's fp32
        accumulator, or (``held``) its slice of the held gradients ([Note: gradients held on the
        device]: GA 1, on compute, which the backward's end event follows; a second backward of the
        window adds in the compute dtype, as autograd)."""
        st = self.streams
        grad = self.states.grad(i)  # the device's accumulator, or the hold's slice
        if first:
            grad.copy_(flat_grad)
        else:
            grad.add_(flat_grad)
        self._log("hold" if held else "acc", i, None)
        if not final:
            self.schedule.landing(i, self.worker.submit(lambda: None))
            return
        torch.linalg.vector_norm(grad, dtype=torch.float32, out=self.norm_dev[i])
        st.wait(st.d2h, st.record(st.compute()))
        with st.on(st.d2h):
            self.norm_host[i : i + 1].copy_(self.norm_dev[i : i + 1], non_blocking=True)
        landed = st.record(st.d2h)
        self.schedule.landing(i, self.worker.submit(self._land_norm, i, landed))

    def _land_norm(self, i: int, landed) -> float:
        landed.synchronize()
        return float(self.norm_host[i]) ** 2

    def _land(
        self, i: int, landed, dest: torch.Tensor, slab, first: bool, final: bool, moments=None
    ):
        """Worker thread: wait for the D2H, fold the bytes into the layer's gradient, return its
        sq-norm. ``moments``: the layer's moments pass due when this landing was queued (a first
        fold into the home waits for it)."""
        landed.synchronize()
        # See [Note: host threads] in optimizer.py
        listener = self.landing_listener if final else None
        # a second gradient for a layer stepped speculatively: undone while its gradient is the
        # one it used
        if listener is not None:
            listener.before_final_fold(i)
        # the fold overwrites the gradient the moments pass reads ([Note: deferred moments] in
        # host_update.py)
        self.schedule.wait_moments(i, moments, self.timer)
        with self.timer.host_span("landing_s"), _range("land", i):
            sq = self._fold(i, dest, first, final)
        if slab is not None:
            self.states.return_slab(slab)  # only now may a later D2H overwrite it
        if listener is not None:  # speculative optimizer step (speculation.py)
            listener.final_landing(i, sq)
        return sq

    def _fold(self, i: int, dest: torch.Tensor, first: bool, final: bool):
        direct = self.states.grad_home(i) is GradHome.DIRECT
        if direct and first:  # landed in its home; its norm was taken on the GPU
            return float(self.norm_host[i]) ** 2 if final else None
        grad = self.states.fold_grad(i, dest, first)
        if not final:
            return None
        if direct:  # a second landing in the same window (see _evacuate): the norm of the sum
            return float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
        return float(torch.dot(grad, grad))
