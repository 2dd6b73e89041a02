"""The recompute checks itself: a layer's backward recompute must reproduce its forward.

[Note: recompute check] The engine's gradients are right only if each layer's recompute
(executor.py, ``StreamedLayers._recompute``) computes the same function of the same inputs as its
forward did. That rests on details of the model's code that upstream releases change (transformers
5.24 renamed the decoder layers' cache argument, and the recompute silently appended every key
twice). Two checks turn such drift into an error, on the user's own machine, while ``active`` (the
first steps of every run by default; ``megatrain.check_recompute``):

- **Values.** The recompute's outputs are compared with the forward's, on the device, with no sync
  per layer: one ``vector_norm`` of the difference and one of the reference per output, queued on
  the compute stream; the relative errors are read once, at ``engine.step()`` (``read``), where the
  step already waits for the last gradient landing. The reference for the hidden states is the
  forward's own output: the next layer's saved input when the model handed it on unchanged (no extra
  memory; with ``offload_activations`` it is that input as it came back from the host), otherwise a
  detached alias of the output kept until the recompute. The layer's other outputs (router logits,
  attention weights: tuple items and what Hugging Face's output-capturing hooks recorded) are
  compared with detached aliases of the forward's.
- **Inputs.** A value check cannot see everything: with the cache appended twice, causal attention
  over the duplicated keys gives the forward's values exactly while the gradient is wrong. So the
  state reachable from the layer's arguments (tensors by identity, version and shape; objects'
  attributes, lists and dicts, a few levels deep) is fingerprinted before the forward and again
  before the recompute: an argument the forward (or a later layer) changed in place means the
  recompute runs on other inputs. This one is checked on the CPU, at the recompute, and raises there
  (inside ``engine.backward()``, which then discards the window's gradients).

A mismatch raises ``RecomputeMismatch`` naming the layer, the output, the error, the model class and
the transformers version, before the step's update is applied (``engine.step()`` rolls back
speculated layers and drops the window's gradients first): nothing trains on a wrong gradient, and
the weights stay as they were.

[Note: non-finite values are not drift] A forward output that holds NaN or inf (a NaN in the batch,
weights blown up by too large a learning rate, fp16 range) is no evidence about the recompute: NaN
never equals NaN. Such an output is not compared; ``read`` returns a report instead (the step, the
first layer whose forward output is non-finite in forward order, and whether the first layer's input
already was: the batch's embeddings), which the engine logs as a warning. The loss and the gradients
are then non-finite, and the step is skipped as any step with non-finite gradients is, in every
precision (optimizer.py; fp16's loss scaler as DeepSpeed's), with a line naming the layers and
parameters whose gradients were non-finite (``nonfinite_gradients_message``). The norms are fp32: an
output whose squares overflow fp32 (magnitudes past ~1e19, weights already blown up) reads as
non-finite too and is reported the same way. (fp64 norms would tell the two apart at 4.5x the
check's cost: 16.6 against 3.7 ms a step at 3B/16K on an H200.)
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

# relative error ||recompute - forward|| / ||forward|| allowed per output, by compute dtype. The
# recompute runs the same kernels on the same inputs, usually bit for bit; what may differ is
# rounding: a kernel chosen differently with grad enabled, atomics in CUDA MoE scatter kernels.
# Drift of the kind this catches is O(1e-1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
AUTO_STEPS = 3  # "auto": the first optimizer steps of every run (every engine) are checked
_DEPTH = 4  # how deep the argument fingerprint follows attributes, lists and dicts
_MAX_ITEMS = 20_000  # and at most this many leaves (a pathological argument does not make it slow)


class RecomputeMismatch(RuntimeError):
    """A layer's backward recompute did not reproduce its forward (see [Note: recompute check])."""


def steps_to_check(setting) -> int | None:
    """``megatrain.check_recompute`` -> optimizer steps to check: None = every step, 0 = none."""
    if setting is True:
        return None
    if setting is False:
        return 0
    if setting == "auto":
        return AUTO_STEPS
    return int(setting)


def validate_setting(setting) -> None:
    if setting in (True, False, "auto") or (
        isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0
    ):
        return
    raise ValueError(
        f"megatrain.check_recompute must be true, false, \"auto\" (the first {AUTO_STEPS} steps) "
        "or a "
        f"number of steps >= 0, got {setting!r}"
    )


def fingerprint(value) -> tuple:
    """What an argument holds, as comparable leaves: a tensor by (identity, version counter, shape),
    scalars by value, containers and objects' attributes followed ``_DEPTH`` levels (modules and
    callables by identity: their parameters are the layer's own business). Reads no tensor data: no
    device sync."""
    out: list = []
    seen: set[int] = set()

    def visit(item, depth: int) -> None:
        if len(out) >= _MAX_ITEMS:
            return
        if isinstance(item, torch.Tensor):
            out.append(("t", id(item), item._version, tuple(item.shape)))
        elif item is None or isinstance(item, (bool, int, float, str, torch.dtype, torch.device)):
            out.append(item)
        elif depth >= _DEPTH or id(item) in seen or isinstance(item, nn.Module) or callable(item):
            out.append(("o", id(item)))
        elif isinstance(item, (list, tuple)):
            seen.add(id(item))
            out.append(("seq", len(item)))
            for x in item:
                visit(x, depth + 1)
        elif isinstance(item, dict):
            seen.add(id(item))
            out.append(("map", len(item)))
            for key, x in list(item.items()):
                out.append(key if isinstance(key, (str, int)) else ("k", id(key)))
                visit(x, depth + 1)
        else:
            seen.add(id(item))
            out.append(("obj", id(item), type(item).__name__))
            for key, x in list(getattr(item, "__dict__", {}).items()):
                out.append(key)
                visit(x, depth + 1)

    visit(value, 0)
    return tuple(out)


def argument_state(args: tuple, kwargs: dict, names: tuple[str, ...]) -> dict[str, tuple]:
    """Each argument of a layer call (by its name where the signature gives one) -> its
    ``fingerprint``."""
    state = {}
    for j, value in enumerate(args):
        label = names[j] if j < len(names) else f"positional argument {j + 2}"
        state[f"{label}= ({type(value).__name__})"] = fingerprint(value)
    for key, value in kwargs.items():
        state[f"{key}= ({type(value).__name__})"] = fingerprint(value)
    return state


class RecomputeCheck:
    """Compares every recompute with its forward while ``active``; see [Note: recompute check]. One
    per executor; the engine advances it once per optimizer step (``read``)."""

    def __init__(
        self,
        setting,
        tolerance,
        compute_dtype: torch.dtype,
        model_class: str,
        input_from_next: bool,
    ) -> None:
        validate_setting(setting)
        self.left = steps_to_check(setting)  # optimizer steps still to check (None: all of them)
        self.tolerance = (
            float(tolerance)
            if tolerance not in (None, "auto")
            else TOLERANCE.get(compute_dtype, 1e-4)
        )
        self.model_class = model_class
        # the hidden-states reference is taken from the next layer's saved input when the forward
        # handed its output on unchanged (offloaded activations: that input comes back from the
        # host; an alias would pin the device copy the offload freed); else the forward's output is
        # kept as a detached alias
        self.input_from_next = input_from_next
        # (layer, output, |diff|, |ref|)
        self.pending: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []
        # per forward: is the first layer's input finite (a 0-dim bool)
        self.first_inputs: list[torch.Tensor] = []
        self.compared = 0  # outputs compared so far (this engine)
        # hidden-state outputs whose reference never came (the next layer had no backward)
        self.unchecked = 0
        self.steps_checked = 0
        self.worst = 0.0  # largest relative error read so far

    @property
    def active(self) -> bool:
        return self.left is None or self.left > 0

    # --- forward side -----------------------------------------------------------------------------
    def before_forward(self, call, names: tuple[str, ...]) -> None:
        """A training forward of ``call`` is about to run: its arguments' state, for the recompute
        to match."""
        if self.active:
            call.check = _CallCheck(argument_state(call.args, call.kwargs, names))

    def after_forward(self, call, outputs: list) -> None:
        """The Function's outputs of a training forward (primary first): what the recompute must
        reproduce."""
        if call.check is not None:
            call.check.expect = [o.detach() for o in outputs]

    def handed_on(self, prev, hidden: torch.Tensor) -> None:
        """The next layer's forward starts from ``hidden``: when that is ``prev``'s own output, the
        next layer's saved input is the reference for ``prev``'s hidden states (see
        ``input_from_next``)."""
        chk = prev.check if prev is not None else None
        if chk is None or chk.output is None or chk.output() is not hidden:
            return
        chk.from_next = True
        if self.input_from_next:
            chk.expect[0] = None  # comes in ``give_input`` from the next layer's backward

    def remember_output(self, call, output: torch.Tensor) -> None:
        if call.check is not None:
            call.check.output = weakref.ref(output)

    # --- backward side ----------------------------------------------------------------------------
    def give_input(self, call, x: torch.Tensor | None) -> None:
        """Layer ``call``'s backward has its input ``x`` (the saved one, or the kept graph's): it is
        the forward's output of the previous layer, which recomputes next."""
        prev = call.prev
        # the model's first layer:
        if x is not None and prev is None and self.active and x.is_floating_point():
            # was the batch's input finite?
            self.first_inputs.append(torch.isfinite(x.detach()).all())
        if (
            x is not None
            and prev is not None
            and prev.check is not None
            and prev.check.from_next
            and prev.check.expect is not None
            and prev.check.expect[0] is None
        ):
            prev.check.expect[0] = x.detach()

    def check_inputs(self, call, names: tuple[str, ...]) -> None:
        """Before the recompute: its arguments hold what the forward's held (CPU only; raises at
        once)."""
        chk = call.check
        if chk is None:
            return
        now = argument_state(call.args, call.kwargs, names)
        what = next(
            (label for label, state in chk.arguments.items() if now.get(label) != state), None
        )
        if what is not None:
            call.check = None
            raise RecomputeMismatch(
                self._message(
                    call.index,
                    f"its argument {what} changed between its forward and its backward recompute "
                    "(the "
                    "layer, or a later one, updated it in place: a KV cache the forward appended "
                    "to, a state object), "
                    "so the recompute would run on other inputs than the forward and its gradient "
                    "would be wrong",
                )
            )

    def compare(self, call, outputs: list) -> None:
        """Queue, on the current (compute) stream, the relative error of each recomputed output."""
        chk, call.check = call.check, None
        if chk is None or chk.expect is None:
            return
        labels = _labels(call)
        for k, (got, want) in enumerate(zip(outputs, chk.expect)):
            if want is None:
                self.unchecked += 1
                continue
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                got_shape = (
                    tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                )
                raise RecomputeMismatch(
                    self._message(
                        call.index,
                        f"its recomputed {labels[k]} has shape {got_shape}, the forward's "
                        f"{tuple(want.shape)}",
                    )
                )
            got = got.detach()
            diff = torch.linalg.vector_norm(got - want, dtype=torch.float32)
            ref = torch.linalg.vector_norm(want, dtype=torch.float32)
            self.pending.append((call.index, labels[k], diff, ref))
            self.compared += 1

    def drop(self, call) -> None:
        """A call whose backward will not recompute (a kept layer): nothing to compare."""
        call.check = None

    # --- end of step ------------------------------------------------------------------------------
    def read(self, dp=None, step: int | None = None) -> str | None:
        """At an optimizer step (``step``, as the progress line counts it): read the queued errors
        (one device sync, where the step waits anyway), count the step, and raise
        ``RecomputeMismatch`` for the worst output over the tolerance (any rank's, when ``dp``).
        Returns the report of non-finite forward outputs, if any ([Note: non-finite values are not
        drift])."""
        pending, self.pending = self.pending, []
        first_inputs, self.first_inputs = self.first_inputs, []
        if self.left is not None and self.left > 0:
            self.left -= 1
        if not pending and (dp is None or not dp.active):
            return None
        self.steps_checked += 1
        report = None
        if pending:
            diffs = torch.stack([d for _, _, d, _ in pending]).cpu().double()
            refs = torch.stack([r for _, _, _, r in pending]).cpu().double()
            rel = diffs / refs.clamp_min(1e-30)
            rel = torch.where(
                torch.isnan(rel) | (diffs.isfinite() != refs.isfinite()),
                torch.full_like(rel, float("inf")),
                rel,
            )
            rel = torch.where((diffs == 0) & (refs == 0), torch.zeros_like(rel), rel)
            nonfinite = ~refs.isfinite()  # the forward's own output: nothing to compare
            rel = torch.where(nonfinite, torch.zeros_like(rel), rel)
            if bool(nonfinite.any()):
                inputs_finite = bool(torch.stack(first_inputs).all()) if first_inputs else None
                report = self._nonfinite_report(pending, nonfinite.tolist(), inputs_finite, step)
            worst = int(torch.argmax(rel))
            worst_rel = float(rel[worst])
        else:
            worst, worst_rel = -1, 0.0
        bad = worst_rel > self.tolerance
        # every rank stops together: a rank that raised alone would hang the rest
        if dp is not None and dp.active:
            bad = dp.min_int(0 if bad else 1) == 0
        self.worst = max(self.worst, worst_rel if worst_rel != float("inf") else self.worst)
        if not bad:
            return report
        if worst < 0 or worst_rel <= self.tolerance:
            raise RecomputeMismatch(
                self._message(
                    -1,
                    "another rank's recompute did not reproduce its forward "
                    "(its own error message names the layer)",
                )
            )
        layer, label = pending[worst][0], pending[worst][1]
        raise RecomputeMismatch(
            self._message(
                layer,
                f"its recomputed {label} differs from the forward's by {worst_rel:.3g} (relative, "
                "L2), over the "
                f"tolerance {self.tolerance:g}",
            )
        )

    def _nonfinite_report(
        self, pending: list, nonfinite: list[bool], inputs_finite: bool | None, step: int | None
    ) -> str:
        """Where the forward's non-finite values start: the first layer (forward order) with a
        non-finite output, and whether the first layer's input (the batch's embeddings) already held
        them."""
        layer, label = min((p[0], p[1]) for p, bad in zip(pending, nonfinite) if bad)
        if inputs_finite is False:
            where = (
                "the first layer's input already holds them: the hidden states the model computed "
                "from the "
                "batch (NaN/inf in inputs_embeds or another float input, or in the embedding "
                "weights)"
            )
        else:
            where = (
                f"layer {layer}'s {label} is the first layer output that holds them"
                + (
                    " (the batch's embeddings, its input, are finite)"
                    if layer == 0 and inputs_finite
                    else ""
                )
                + ": the weights or the activations blew up (too large a learning rate, fp16's "
                "range)"
            )
        return (
            f"{'step ' + str(step) + ': ' if step is not None else ''}non-finite values (NaN/inf, "
            "or magnitudes "
            f"past ~1e19 whose squares overflow fp32) in the forward of {self.model_class}: {where}"
            ". This is not a "
            "recompute mismatch (those outputs are not compared). A step whose gradients are "
            "non-finite is skipped"
        )

    def _message(self, layer: int, what: str) -> str:
        import transformers

        where = f"layer {layer}" if layer >= 0 else "a layer"
        return (
            f"megatrain_ds: the backward recompute of {where} of {self.model_class} does not "
            "reproduce its "
            f"forward: {what}. With transformers {transformers.__version__} the gradient of this "
            "step would be "
            "wrong, so the step was not applied (the weights are as before it, the window's "
            "gradients were "
            "dropped). This usually means the installed transformers changed how a decoder layer "
            "uses its "
            "cache, masks, RNG or buffers in a way megatrain_ds does not handle. What to do: "
            "install the "
            "tested versions (pip install -c constraints.txt, or see `python -m "
            "megatrain_ds.versions`), and "
            "report this message with `pip list` at the megatrain_ds issue tracker. "
            "megatrain.check_recompute: false turns this check off (not recommended)."
        )


class _CallCheck:
    """What one layer call's forward left for its recompute to match."""

    __slots__ = ("arguments", "expect", "output", "from_next")

    def __init__(self, arguments: dict) -> None:
        self.arguments = arguments  # ``argument_state`` of the call before the forward
        # the forward's outputs (detached); [0] None: from the next layer's input
        self.expect: list | None = None
        # weakref to the Function's primary output (is the next layer's input this one?)
        self.output = None
        self.from_next = False


def _labels(call) -> list[str]:
    labels = ["output (hidden states)"]
    labels += [f"output item {1 + j} of the layer's tuple" for j in call.extra_tensor_at]
    labels += [f"'{key}' (recorded by the output-capturing hooks)" for key, _, _ in call.captured]
    return labels


def nonfinite_gradients_message(
    step: int, layers: tuple[int, ...], n_layers: int, resident: list[str]
) -> str:
    """The line after a step skipped on non-finite gradients (bf16/fp32; fp16's loss scaler says its
    own): whose gradients were non-finite on this rank ([Note: non-finite values are not drift])."""
    whose = []
    if layers:
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        whose.append(f"streamed layer(s) {shown} (of {n_layers})")
    if resident:
        whose.append(", ".join(resident[:4]) + (", ..." if len(resident) > 4 else ""))
    return (
        f"step {step}: non-finite gradients (NaN/inf) of {' and '.join(whose) or 'another rank'}; "
        "the step was "
        "skipped and the weights are as before it (a NaN/inf in the batch or the loss, or weights "
        "blown up by too "
        "large a learning rate, give them)"
    )
