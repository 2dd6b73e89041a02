"""Step-time breakdown: H2D, compute, D2H, CPU optimizer, GPU idle.

On only with ``wall_clock_breakdown``. Device spans are timed with CUDA events recorded on the
stream doing the work; they are read once per step, at the start of the next step's forward, after a
device sync. With all optimizer state on the host the GPU has drained by then anyway (the resident
upload waited for the norm task, which waited for every gradient landing); with part of it on the
GPU the sync also waits for those update kernels (~tens of ms at 3B). Host spans (optimizer tasks,
the main thread's waits for the optimizer) are wall-clock. On CPU every span is wall-clock and the
streams are stand-ins.

    compute  = sum of per-layer forward/backward(recompute) spans + the LM-head loss span
    recompute = the part of compute that re-ran a layer's forward in its backward (a kept layer
               has none): work the model-FLOPs formula does not count
    idle     = wall - compute (the GPU's compute stream had nothing to run)
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch


# (start_s, end_s, thread, name) of every traced range, while one is recorded
_TIMELINE: list | None = None


def start_timeline() -> None:
    """Record every ``traced`` range (all threads, ``time.perf_counter`` seconds) and, through the
    step timer, the device spans, until ``take_timeline``: the host optimizer's threads included,
    which ``torch.profiler`` does not show (benchmarks/trace_gaps.py --timeline)."""
    global _TIMELINE
    _TIMELINE = []


def take_timeline() -> list:
    global _TIMELINE
    out, _TIMELINE = _TIMELINE or [], None
    return out


@contextlib.contextmanager
def traced(name: str):
    """A ``torch.profiler`` range, and a timeline entry while one is recorded (near-free
    otherwise)."""
    with torch.profiler.record_function(name):
        if _TIMELINE is None:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if _TIMELINE is not None:
                _TIMELINE.append((t0, time.perf_counter(), threading.current_thread().name, name))


def layer_range(op: str, i: int):
    """A profiler range naming the phase and layer (``torch.profiler`` traces show the overlap;
    near-free when no profiler is recording)."""
    return traced(f"megatrain.{op}.L{i}")


class StepTimer:
    def __init__(self, streams, enabled: bool) -> None:
        self.streams, self.enabled = streams, enabled
        self.cuda = streams.kind == "cuda"
        # "recompute" spans lie inside "compute" ones (the same stream): a part of it, not added
        self.spans: dict[str, list] = {
            "h2d": [],
            "d2h": [],
            "compute": [],
            "comm": [],
            "recompute": [],
        }
        # host spans: optimizer updates after the norm, speculative updates during the backward,
        # rollbacks
        self.host = {
            "optimizer_s": 0.0,
            "landing_s": 0.0,
            "wait_for_optimizer_s": 0.0,
            "speculative_s": 0.0,
            "rollback_s": 0.0,
            "nvme_wait_s": 0.0,  # within the optimizer spans
            "moments_s": 0.0,  # the deferred moments passes
            "wait_for_moments_s": 0.0,  # a landing's wait for its layer's moments pass
            "updated_params": 0.0,  # parameters the host AdamW updated (for its Gparam/s)
        }
        # the engine installs a callable returning cumulative counts (speculated steps)
        self.counters = dict
        self._lock = threading.Lock()
        self._step_start = None
        # timeline: (an event recorded when the device had drained, its perf_counter time)
        self._ref = None
        self._window_open = False
        self.last: dict = {}

    # device spans ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def span(self, kind: str, stream):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self.spans[kind].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans[kind].append(time.perf_counter() - t0)

    def _sum(self, kind: str) -> float:
        if self.cuda:  # ms -> s; the events completed (the stream was drained in begin_forward)
            return sum(start.elapsed_time(end) for start, end in self.spans[kind]) / 1e3
        return sum(self.spans[kind])

    # host spans -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def host_span(self, key: str):
        """Time a host span. The body may put counts in the yielded dict (``span["updated_params"] =
        n``): they are added with the span's seconds under one lock, so a step boundary that falls
        while a layer is being updated puts both the layer's time and its parameters in the same
        step (a rate from halves is wrong)."""
        t0 = time.perf_counter()
        counts: dict = {}
        try:
            yield counts
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                self.host[key] += seconds
                for name, value in counts.items():
                    self.host[name] += value

    # step boundaries ------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self._window_open or not self.enabled:
            return
        if self.cuda:
            torch.cuda.synchronize()  # CPU-GPU sync once per step (see the module docstring)
        now = time.perf_counter()
        if self._step_start is not None:
            self._finish(now)
        self._step_start = now
        if self.cuda and _TIMELINE is not None:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            self._ref = (ref, time.perf_counter())
        self._window_open = True

    def end_step(self) -> None:
        self._window_open = False

    def _finish(self, now: float) -> None:
        wall = now - self._step_start
        h2d, d2h, compute = self._sum("h2d"), self._sum("d2h"), self._sum("compute")
        with self._lock:
            host = dict(self.host)
            for key in self.host:
                self.host[key] = 0.0
        # the host update's rate: parameters updated (after the norm and speculatively) per second
        # of updating
        busy = host["optimizer_s"] + host["speculative_s"]
        rate = host["updated_params"] / 1e9 / busy if host["updated_params"] and busy > 0 else 0.0
        self.last = {
            "step_s": wall,
            "h2d_s": h2d,
            "compute_s": compute,
            "recompute_s": self._sum("recompute"),  # within compute_s
            "d2h_s": d2h,
            "comm_s": self._sum("comm"),
            "cpu_optimizer_s": host["optimizer_s"],
            "cpu_grad_landing_s": host["landing_s"],
            "wait_for_optimizer_s": host["wait_for_optimizer_s"],
            "cpu_speculative_optimizer_s": host["speculative_s"],
            "cpu_rollback_s": host["rollback_s"],
            "cpu_nvme_wait_s": host["nvme_wait_s"],
            "cpu_deferred_moments_s": host["moments_s"],
            "wait_for_moments_s": host["wait_for_moments_s"],
            "cpu_optimizer_gparam_s": rate,
            "cpu_updated_params": int(host["updated_params"]),
            "gpu_idle_s": max(0.0, wall - compute) if self.cuda else None,
            **self.counters(),
        }
        # device spans on the host's clock
        if self.cuda and _TIMELINE is not None and self._ref is not None:
            ref, t_ref = self._ref
            for kind, spans in self.spans.items():
                for start, end in spans:
                    a = t_ref + ref.elapsed_time(start) / 1e3
                    _TIMELINE.append((a, a + start.elapsed_time(end) / 1e3, f"gpu-{kind}", kind))
        for spans in self.spans.values():
            spans.clear()

    @staticmethod
    def format(b: dict) -> str:
        if not b:
            return "(no complete step yet)"
        idle = "n/a" if b.get("gpu_idle_s") is None else f"{b['gpu_idle_s'] * 1e3:.0f}"
        return (
            f"step {b['step_s'] * 1e3:.0f} ms | compute {b['compute_s'] * 1e3:.0f} "
            + (
                f"(of which recompute {b['recompute_s'] * 1e3:.0f}) "
                if b.get("recompute_s")
                else ""
            )
            + f"| H2D {b['h2d_s'] * 1e3:.0f} | D2H {b['d2h_s'] * 1e3:.0f} | "
            + (f"collectives {b['comm_s'] * 1e3:.0f} | " if b.get("comm_s") else "")
            + f"CPU optim {b['cpu_optimizer_s'] * 1e3:.0f} "
            f"(+{b.get('cpu_speculative_optimizer_s', 0) * 1e3:.0f} during backward"
            + (
                f"; {b['cpu_optimizer_gparam_s']:.2f} Gparam/s"
                if b.get("cpu_optimizer_gparam_s")
                else ""
            )
            + ") "
            + (
                f"of which NVMe read wait {b['cpu_nvme_wait_s'] * 1e3:.0f} "
                if b.get("nvme_read_bytes")
                else ""
            )
            + (
                f"| moments pass {b['cpu_deferred_moments_s'] * 1e3:.0f} (landings waited "
                f"{b.get('wait_for_moments_s', 0) * 1e3:.0f}) "
                if b.get("cpu_deferred_moments_s")
                else ""
            )
            + f"| fwd waited on optim {b['wait_for_optimizer_s'] * 1e3:.0f} | GPU idle {idle} ms"
            + (
                f" | speculated {b['speculated_steps']} rolled back {b['rolled_back_steps']}"
                if "speculated_steps" in b
                else ""
            )
        )
