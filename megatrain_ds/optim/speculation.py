"""Speculative optimizer stepping: AdamW of each layer as its gradient lands, before the global norm
is known.

Exact ``clip_grad_norm_`` needs the norm over every gradient, known only when the last one (layer
0's) has landed. Without speculation the whole host AdamW waits for it and then runs in forward
order under the next forward, which is faster than the CPU optimizer at small batches: the GPU idles
(41% of a 3B/16K step).

With speculation, at an accumulation boundary each layer's update is queued on the AdamW thread
right after its gradient lands (the landing thread folds gradients and sums norms; two threads, so
the norm is known as soon as the last gradient lands), during the backward, as if the clip
coefficient were 1 (fp16: 1 / loss scale). Updates not yet started when the norm is known are not
made speculatively (``closed``): those layers get the plain update after the norm, in forward order,
which is the order the next forward needs them (the host AdamW of a 3B step, ~0.8 s, outlasts a
backward without recompute). When the norm is known (``HostAdamW._norm_task``, whose
``StepDecision`` says whether the speculated updates are kept):

- finite and clipping does not fire (coefficient exactly 1), same hyperparameters: the speculated
  update is the update. It is **bit-identical** to the non-speculative step: the same fused kernel
  on the same inputs.
- clipping fires, the norm is not finite (the step is skipped), a layer got a second gradient after
  it was stepped (two forwards into one loss), or the learning rate changed between backward() and
  step(): each speculated layer is **rolled back** by the algebraic inverse of AdamW below (in
  float64 from the fp32 state and the gradient, which is still in its host buffer), then stepped
  again with the true coefficient (or left as it was, for a skipped step). The rollback is not
  bit-exact: it recovers m, v and the weight to within a few fp32 ulps
  (tests/engine/test_speculation.py: 20 steps with rollbacks stay within 1e-5 of PyTorch).
- a forward, ``zero_grad()``, a checkpoint or any read of the masters between backward() and step()
  rolls the speculated layers back first, so the model seen there is the pre-step one (as in
  DeepSpeed).

A step that clipped, skipped or rolled back turns speculation off for the next
``speculation_backoff`` steps (early training clips every step: then the optimizer runs exactly as
without speculation).

[Note: newest landing first] The AdamW thread is slower than the backward lands gradients (3B at 16K
on one H100: a layer's update ~15-18 ms beside the backward's copies, a layer's landing every ~11-15
ms), so a backlog grows. Taken oldest first, the backlog at the norm is the last layers to land:
layers 0, 1, 2, ..., the first the next forward needs, each then waiting for its update. Taken
newest first (each speculative task pops the most recent landing), the layers left at the norm are
spread over the model, and the plain updates after the norm (forward order) finish each one before
the forward reaches it. The values are the same either way (each layer's update is independent). Not
on the NVMe tier, whose read-ahead expects the landing order.

The step's tasks are queued when ``step()`` is called, which on a GPU comes before the backward's
last landings (the backward returns once its kernels are queued): the speculative tasks of those
landings queue behind the step's, whose first (the resident update) waits for the norm. So that
first task goes on taking landings until the norm is known (``await_decision``); the tasks queued
behind find nothing left. Seen on an H100 timeline before this: the AdamW thread waited for the norm
with layers landed and not stepped, their tasks run after the step's plain updates.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

_CHUNK = 1 << 22  # elements per float64 chunk of a rollback (32 MiB per temporary)

# [Note: native rollback] A rollback is on the step's critical path (the settle after the norm
# undoes a layer, then updates it again), and ``adamw_undo`` below makes about a dozen float64
# passes per chunk. Where the native host update is used (``megatrain.host_kernel``), the optimizer
# undoes a layer with ``host_update.native_adam_undo`` instead: csrc/host_adam.c's
# ``megatrain_adam_undo``, the same double arithmetic operation for operation, in one threaded,
# vectorized pass that also writes the wire copy. It equals ``adamw_undo`` except where torch's
# vectorized double sqrt (Sleef, 0.5001 ulp; C's is correctly rounded) differs in the last bit and
# that bit survives the rounding to fp32: under 1 element in 1,000, a few ulp, in near-zero moments
# (tests/unit/test_host_update.py). Neither is an exact inverse of the step: a rolled-back layer
# carries the undo's rounding either way.


@dataclass(slots=True, eq=False)
class Speculation:
    """One accumulation boundary's speculative updates (built by the main thread at the start of its
    last backward).

    Three threads share it; which one writes each field, and who reads it, is [Note: host threads]
    in optimizer.py. Whether the updates are kept is not here: the norm task decides it
    (``StepDecision.commit``)."""

    # per param group: lr, beta1, beta2, eps, weight_decay, step (step = step count + 1); read-only
    hp: list[dict]
    coef: float  # gradient multiplier the speculative updates used: 1 / loss scale; read-only
    # AdamW thread appends; its later tasks (settle, close), and the main thread after abandon's
    # undo, read them
    done: list[int] = field(default_factory=list)  # layers stepped, in landing order
    # resident parameters stepped (embeddings, head)
    resident_done: list[int] = field(default_factory=list)
    # the landing thread's own (the listener calls)
    landed: set[int] = field(default_factory=set)  # layers whose final gradient has landed
    # landed, not yet taken by a speculative update: the AdamW thread takes the newest first ([Note:
    # newest landing first]); appended by the landing thread, popped by the AdamW thread
    pending: list[int] = field(default_factory=list)
    stale: set[int] = field(default_factory=set)  # stepped, then another gradient landed for them
    resident_landed: set[int] = field(default_factory=set)
    # flags the AdamW thread reads before each speculative update
    # landing thread: a non-finite gradient landed: nothing more is speculated
    stopped: bool = False
    # the norm task (landing thread) knows the norm, or main abandoned it: updates not started yet
    # are not made speculatively (the layer gets the plain update after the norm, in forward order)
    closed: bool = False


class SpeculationPolicy:
    """When to speculate: not within ``backoff`` steps of a step that clipped, skipped or rolled
    back."""

    def __init__(self, enabled: bool, backoff: int) -> None:
        self.enabled, self.backoff = enabled, backoff
        # per step: clipped, skipped or rolled back
        self.recent: deque[bool] = deque(maxlen=max(backoff, 1))
        self.speculated = 0  # steps whose layers were stepped during the backward
        self.rolled_back = 0  # of those, steps rolled back (clipping fired, skipped, ...)

    def allows(self) -> bool:
        """Not before one step has shown whether clipping fires (the first step of a run usually
        clips, and a rollback from all-zero moments leaves rounding residue that Adam's first,
        sign-like update would amplify), and not within ``backoff`` steps of one that clipped,
        skipped or rolled back (0: every step after the first)."""
        return self.enabled and len(self.recent) > 0 and not (self.backoff and any(self.recent))

    def record(self, clipped_or_skipped: bool, rolled_back: bool) -> None:
        self.recent.append(clipped_or_skipped or rolled_back)


def await_decision(decided: Future, spec: Speculation | None, step_one):
    """AdamW thread, at the head of a step's tasks: ``decided.result()``, taking meanwhile the
    landings of the step's still-open speculation (``step_one(spec)`` takes one) ([Note: newest
    landing first])."""
    while spec is not None and not decided.done():
        if spec.pending and not spec.closed:
            step_one(spec)
        else:
            wait_futures([decided], timeout=0.002)  # a landing, or the norm
    return decided.result()


def same_hyperparameters(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x[k] == y[k] for x, y in zip(a, b) for k in x)


def adamw_undo(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hp: dict,
    coef: float,
    adam_w_mode: bool,
) -> None:
    """Invert one step of torch's fused (Adam|AdamW) kernel in place, given the gradient it used
    (``grad`` times ``coef``; the kernel divides by ``grad_scale = 1 / coef``). The kernel computed,
    in order:

        AdamW: p <- p - lr*wd*p          Adam: g <- g + wd*p
        m <- lerp(m, g, 1 - b1)           v <- b2*v + (1 - b2)*g*g
        p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),   bc_k = 1 - b_k**step

    so, from the new p, m, v: p before the last line, then the decay, then m and v (v clamped at 0).
    Float64 arithmetic on the fp32 state, chunked so the temporaries stay small.
    """
    lr, b1, b2, eps, wd, step = (
        hp["lr"],
        hp["beta1"],
        hp["beta2"],
        hp["eps"],
        hp["weight_decay"],
        hp["step"],
    )
    step_size = lr / (1 - b1**step)
    bc2_sqrt = math.sqrt(1 - b2**step)
    for start in range(0, param.numel(), _CHUNK):
        sl = slice(start, start + _CHUNK)
        p, m, v = param[sl].double(), exp_avg[sl].double(), exp_avg_sq[sl].double()
        g = grad[sl].double() if coef == 1.0 else grad[sl].double() / (1.0 / coef)
        p = p + step_size * m / (v.sqrt() / bc2_sqrt + eps)
        if adam_w_mode:
            p = p / (1 - lr * wd)
        else:
            g = g + wd * p
        m = (m - (1 - b1) * g) / b1
        v = ((v - (1 - b2) * g * g) / b2).clamp_min_(0.0)
        param[sl].copy_(p)
        exp_avg[sl].copy_(m)
        exp_avg_sq[sl].copy_(v)
