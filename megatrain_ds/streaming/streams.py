"""The three streams of the executor, and their CPU stand-ins.

[Note: stream and event ordering]

Three streams, one schedule. ``h2d`` copies a layer's wire weights from pinned host memory into a
device slot; ``compute`` is the caller's current stream (the model's own ops run there too); ``d2h``
evacuates a layer's flat gradient into pinned host memory. The other actors are two host threads:
the landing thread consumes landed gradients, the AdamW thread runs the optimizer. No per-layer
``synchronize()`` exists; only the events below order the actors.

| event                 | recorded on | waited by                   | protects                     |
|-----------------------|-------------|-----------------------------|------------------------------|
| ``slot.ready``        | h2d         | compute (``wait_event``)    | slot bytes are the layer's   |
|                       |             |                             | weights                      |
| ``slot.free``         | compute     | h2d, before overwriting the | the last kernel reading the  |
|                       |             | slot                        | slot is done                 |
| ``wire_read[i]``      | h2d         | worker (``synchronize``)    | optimizer rewrites wire i    |
|                       |             |                             | only after the last H2D that |
|                       |             |                             | reads it has finished        |
| ``grad_ready``        | compute     | d2h (``wait_event``)        | the flat gradient is fully   |
|                       |             |                             | written                      |
| ``landed``            | d2h         | worker (``synchronize``)    | host grad / landing slab     |
|                       |             |                             | holds the bytes              |
| ``resident_uploaded`` | h2d         | compute (``wait_event``)    | resident params hold the     |
|                       |             |                             | updated weights              |
| ``params_read``       | compute     | h2d, before the resident    | no queued kernel still reads |
|                       |             | upload                      | the resident params the      |
|                       |             | (``ResidentParams.upload``) | upload overwrites in place   |
| ``backward_done``     | compute     | opt, before GPU-side AdamW  | gradient accumulators are    |
|                       |             |                             | complete                     |
|                       |             | main (``synchronize``, in   | the recompute check's errors |
|                       |             | step(), while the recompute | are written                  |
|                       |             | check is on)                | (recompute_check.py)         |
| ``device_ready[i]``   | opt         | h2d, before the cast of a   | the update of layer i's      |
|                       |             | GPU-held layer's master     | device master is done (the   |
|                       |             | into a slot                 | other layers' may still run) |
| resident update's     | opt         | h2d, before the resident    | GPU-held resident state is   |
| result (event)        |             | upload                      | updated                      |
|                       |             | (``ResidentParams.upload``) |                              |

``opt`` runs the AdamW of optimizer state held on the GPU (``gpu_optimizer_layers``): a stream of
its own, so the forward's first casts do not queue behind every layer's update (one H2D queue would
hold the embedding's upload and layer 0's cast behind the whole model's AdamW, ~25 ms at 3B).

The per-layer fields these events and futures live in (versions, ``wire_ready``, ``wire_read``,
landings) have one owner, ``LayerSchedule`` (schedule.py), with the cycle and its invariants.

Host-side ordering (not events, Python futures). Two host threads: the landing thread (folds,
squared norms, the norm task) and the AdamW thread (speculative updates, then each step's update
tasks); each is FIFO, and an update task waits for its step's norm future (its ``StepDecision``).
Every hand-off between the host threads is [Note: host threads] in optimizer.py. the worker runs in
FIFO order, so gradient landings of a backward precede the norm task of the following ``step()``,
which precedes the per-layer optimizer tasks. Before ``h2d`` reads wire i, the main thread waits
(CPU-side) for the optimizer future of layer i: this is the only place where the GPU can wait on the
CPU, and it is what makes the update of step t overlap the forward of step t+1 in layer order.

Device memory read by another stream after its producer is done is handed over with
``Tensor.record_stream`` so the caching allocator does not reuse it early (the flat gradient on
d2h).

On a machine without CUDA the same schedule runs with ``CpuStreams``: copies are synchronous, events
are already complete, and waits return at once. The executor never branches on the device: it only
talks to the ``Streams`` interface below.
"""

from __future__ import annotations

import contextlib

import torch


class CpuEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU: work it would order has already completed."""

    def synchronize(self) -> None:  # work issued on a CPU "stream" is synchronous
        return None

    def query(self) -> bool:
        return True


class CpuStreams:
    """Stand-in streams for CPU: the executor calls the same methods; everything runs inline."""

    kind = "cpu"

    def __init__(self) -> None:
        self.h2d = None
        self.d2h = None
        self.opt = None

    def compute(self):
        return None

    def record(self, stream) -> CpuEvent:
        return CpuEvent()

    def wait(self, stream, event) -> None:
        return None

    def on(self, stream):
        return contextlib.nullcontext()

    def hand_over(self, tensor: torch.Tensor, stream) -> None:
        return None


class CudaStreams:
    """The real streams. ``compute`` is whatever stream is current where the layer runs.

    See [Note: stream and event ordering] above for every record/wait below.
    """

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # h2d: weight prefetch into slots; high priority so a prefetch is not queued behind a long
        # D2H.
        self.h2d = torch.cuda.Stream(device=device, priority=-1)
        # d2h: gradient evacuation into pinned host memory.
        self.d2h = torch.cuda.Stream(device=device)
        # opt: AdamW of the optimizer state held on the GPU (see the Note)
        self.opt = torch.cuda.Stream(device=device)

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def record(self, stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        if event is not None:
            stream.wait_event(event)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def hand_over(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


def make_streams(device: torch.device):
    return CudaStreams(device) if device.type == "cuda" else CpuStreams()
