"""The resident parameters: what a model keeps on the device outside its streamed layers
(embeddings, final norm, LM head), with their fp32 masters, Adam moments and gradients (host memory,
or the GPU). The host optimizer (optimizer.py) updates them; the host threads' hand-offs around them
are [Note: host threads] there.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..parallel import done as _done
from ..host import ResidentState
from ..streaming import LandingListener, traced
from .speculation import adamw_undo


class ResidentParams:
    """The resident parameters' gradient landing, window bookkeeping and upload. Their persistent
    tensors (fp32 master, moments, gradient, wire and landing buffers) are ``self.state``
    (``ResidentState``, host/resident_state.py), whose lists this object also shows as read-only
    attributes (``master``, ``grad``...).

    After autograd each resident ``.grad`` lands into its fp32 gradient (``evacuate``: D2H and a
    host fold, or in place on the device); before a forward the device copies are refreshed from the
    updated masters (``upload``). Data parallel ([Note: data parallel] in dp.py): a trained
    parameter's state is held by its owner only; every other rank sends its gradient to the owner
    (``evacuate``) and receives the updated copy from it (``upload``).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group_of: dict[int, int],
        device: torch.device,
        compute_dtype: torch.dtype,
        streams,
        pin: bool,
        state_on_device: bool = False,
        dp=None,
        owned: list[bool] | None = None,
    ) -> None:
        # the persistent tensors (host/resident_state.py); this object lands gradients into them and
        # uploads
        self.state = ResidentState(
            params, group_of, device, compute_dtype, pin, state_on_device, dp, owned
        )
        self.device, self.streams = device, streams
        # data parallel: each state held by its owner
        self.dp = dp if dp is not None and dp.active else None
        self.norm_dev = torch.zeros(len(params), dtype=torch.float32, device=device)
        self.norm_host = torch.zeros(len(params), dtype=torch.float32)
        if device.type == "cuda":
            self.norm_host = self.norm_host.pin_memory()
        # The window's landings (main thread: ``evacuate`` writes them, the optimizer's
        # ``close_window`` takes them; each future runs on the landing thread and returns the final
        # squared norm, or None)
        self.has_grad = [False] * len(params)
        self.sq_norm: list[Future | None] = [None] * len(params)
        # The landing thread's, read after the landing's future: the window's only gradient of k is
        # its landing buffer as it came from the GPU, not folded into the fp32 home (``grad_of``)
        self.direct = [False] * len(params)
        # The optimizer task that updates them (main thread: ``rewrite``); on the AdamW thread it
        # returns the opt-stream event after a GPU-held update (None otherwise), which ``upload``
        # waits for. See [Note: host threads].
        self.update: Future | None = None
        self.uploaded = True  # main thread: the device copies hold the last update
        # Main thread (``upload``): the last H2D event reading the host wire copies; read by the
        # AdamW tasks queued after that upload (the submit orders it), which ``synchronize`` it
        # before rewriting the wire copies
        self.wire_read = None
        # Told of each final landing on the landing thread (the speculative step); set once, by
        # ``listen``
        self.listener: LandingListener | None = None

    def grad_of(self, k: int, fp32: bool = False) -> torch.Tensor:
        """Resident parameter k's gradient of the last window, after its landing ran: the landing
        buffer itself (the compute dtype) when that window had one gradient, else the fp32 home.
        ``fp32``: the fp32 home either way (a fold, now, where needed: torch's fused kernel wants
        the master's dtype)."""
        if self.direct[k] and fp32:
            self.grad[k].copy_(self.landing[k])
            self.direct[k] = False
        return self.landing[k] if self.direct[k] else self.grad[k]

    def listen(self, listener: LandingListener) -> None:
        """Main thread, before any backward: ``listener.final_resident_landing(k, sq)`` is called on
        the landing thread after resident parameter k's final gradient of a window is in its fp32
        home (landing.py)."""
        self.listener = listener

    def close_window(self) -> tuple[list, list[bool]]:
        """Main thread, at the optimizer step: the window's landings (futures of squared norms,
        flags), then a fresh window."""
        out = list(self.sq_norm), list(self.has_grad)
        self.reset_window()
        return out

    def reset_window(self) -> None:
        self.has_grad = [False] * len(self.params)
        self.sq_norm = [None] * len(self.params)

    def rewrite(self, task: Future) -> None:
        """Main thread: ``task`` (AdamW thread) updates the resident parameters; the next ``upload``
        waits for it."""
        self.update = task
        self.uploaded = False

    # the state's tensors, read where the landing, the update and the upload use them (the lists are
    # the state's: ``move_state_to_device`` replaces them there)
    params = property(lambda self: self.state.params)
    group_of = property(lambda self: self.state.group_of)
    trained = property(lambda self: self.state.trained)
    holds = property(lambda self: self.state.holds)
    on_device = property(lambda self: self.state.on_device)
    master = property(lambda self: self.state.master)
    exp_avg = property(lambda self: self.state.exp_avg)
    exp_avg_sq = property(lambda self: self.state.exp_avg_sq)
    grad = property(lambda self: self.state.grad)
    wire = property(lambda self: self.state.wire)
    landing = property(lambda self: self.state.landing)
    regions = property(lambda self: self.state.regions)

    def device_bytes(self) -> int:
        """GPU bytes ``move_state_to_device`` takes (``ResidentState.device_bytes``)."""
        return self.state.device_bytes()

    def move_state_to_device(self) -> None:
        """From now on keep the fp32 master, moments and gradient on the device
        (``ResidentState.move_to_device``; between steps, nothing queued); the landing side forgets
        the host buffers it used."""
        if self.on_device:
            return
        self.state.move_to_device()
        # (between steps: the last window's update has read its landing)
        self.direct = [False] * len(self.params)
        self.wire_read = None

    def evacuate(self, worker: ThreadPoolExecutor, final: bool) -> None:
        """After autograd: fold each resident ``.grad`` into its fp32 gradient (D2H + host worker,
        or in place on the device) and queue its squared norm."""
        for k, p in enumerate(self.params):
            if p.grad is None:
                continue
            if not self.trained[k]:  # requires grad but not in any optimizer group: not trained
                p.grad = None
                continue
            if self.dp is not None:  # the mean over every rank, on the owner (dp.py)
                self.dp.reduce_resident_grad(p.grad, k)
            first = not self.has_grad[k]
            # (every rank: the window has a gradient of k, wherever it lands)
            self.has_grad[k] = True
            # another rank's: its squared norm is the owner's share of the sum
            if not self.holds(k):
                self.sq_norm[k] = _done(0.0)
            elif self.on_device:
                self.sq_norm[k] = self._accumulate_on_device(k, p.grad, first, final, worker)
            else:
                self.sq_norm[k] = self._send_to_host(k, p.grad, first, final, worker)
            p.grad = None

    def _send_to_host(self, k, grad, first, final, worker) -> Future:
        st = self.streams
        if self.sq_norm[k] is not None:
            self.sq_norm[k].result()  # the landing buffer is free once the previous landing ran
        # a second gradient in the window (GA 1, two backwards): the first, if left in the landing
        # buffer, goes to the fp32 home before that buffer is overwritten
        if not first:
            self.grad_of(k, fp32=True)
        # GA 1: the gradient is final as it leaves the GPU, so its norm is taken there (as a
        # layer's, landing.py): on the host, the fp32 dot of a large tied embedding would hold the
        # landing thread, and the norm, hence every update of the step, would wait for it
        if first and final:
            torch.linalg.vector_norm(grad, dtype=torch.float32, out=self.norm_dev[k])
        st.wait(st.d2h, st.record(st.compute()))
        with st.on(st.d2h):
            self.landing[k].copy_(grad, non_blocking=True)
            if first and final:
                self.norm_host[k : k + 1].copy_(self.norm_dev[k : k + 1], non_blocking=True)
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
            self.norm_host[k : k + 1].copy_(self.norm_dev[k : k + 1], non_blocking=True)
        landed = st.record(st.d2h)
        return worker.submit(lambda: (landed.synchronize(), float(self.norm_host[k]) ** 2)[1])

    def _land(self, k: int, landed, first: bool, final: bool):
        with traced(f"megatrain.land_resident.L{k}"):
            return self._land_now(k, landed, first, final)

    def _land_now(self, k: int, landed, first: bool, final: bool):
        landed.synchronize()
        self.direct[k] = first and final
        # GA 1: no fold; the update reads the landing buffer (``grad_of``), its norm taken on the
        # GPU (_send_to_host): folding a large tied embedding from bf16 to fp32 on the landing
        # thread would hold the norm, and with it the step, behind the AdamW thread's work
        if first and final:
            sq = float(self.norm_host[k]) ** 2
        else:
            if first:
                self.grad[k].copy_(self.landing[k])
            else:
                self.grad[k].add_(self.landing[k])
            sq = float(torch.dot(self.grad[k].view(-1), self.grad[k].view(-1))) if final else None
        # speculative step of this parameter (speculation.py)
        if final and self.listener is not None:
            self.listener.final_resident_landing(k, sq)
        return sq

    def undo_one(self, k: int, hp: list[dict], coef: float, adam_w_mode: bool) -> None:
        """AdamW thread: resident parameter k's speculative update undone (speculation.adamw_undo),
        its wire rewritten."""
        if self.wire_read is not None:
            self.wire_read.synchronize()  # the last upload has read the wire copy
        adamw_undo(
            self.master[k].view(-1),
            self.grad_of(k).view(-1),
            self.exp_avg[k].view(-1),
            self.exp_avg_sq[k].view(-1),
            hp[self.group_of.get(id(self.params[k]), 0)],
            coef,
            adam_w_mode,
        )
        if self.wire[k] is not None:
            self.wire[k].copy_(self.master[k])

    def master_copy(self, k: int, dst: int | None = None) -> torch.Tensor | None:
        """Resident parameter k's fp32 master, a host copy (``ResidentState.master_copy``: a
        collective)."""
        return self.state.master_copy(k, dst)

    def upload(self) -> None:
        """Before a forward: wait for the optimizer, then refresh the device copies (H2D of the host
        wire copies, or a cast of the device masters), ordered before the forward's first kernel."""
        if self.uploaded:
            return
        with traced("megatrain.wait_resident_update"):
            updated = self.update.result()  # a GPU-held update: the opt-stream event after it
        st = self.streams
        # The copies overwrite the parameters in place: wait for every kernel queued on compute so
        # far (a backward may still read them when an eval forward runs between backward() and
        # step()). See [Note: stream and event ordering]: ``params_read``.
        st.wait(st.h2d, st.record(st.compute()))
        if self.on_device:
            st.wait(st.h2d, updated)  # the GPU-side update (opt stream) is done
        with st.on(st.h2d):
            for p, master, wire, grad in zip(self.params, self.master, self.wire, self.grad):
                # frozen ones never change (their master is p.data); others' come below
                if grad is not None:
                    p.data.copy_(master if self.on_device else wire, non_blocking=True)
            # each owner's copy to its shard (NCCL's stream after h2d's work: dp.py)
            if self.dp is not None:
                for k, p in enumerate(self.params):
                    if self.trained[k]:
                        self.dp.broadcast_resident(p.data, k)
        self.wire_read = st.record(st.h2d)
        st.wait(st.compute(), self.wire_read)
        self.uploaded = True
