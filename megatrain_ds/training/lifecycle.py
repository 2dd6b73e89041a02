"""The engine's lifecycle guards: what a script does around training that must lose nothing and say
what happened.

- ``deferred_interrupt``: Ctrl-C inside a step whose update is queued is held until the step's
  bookkeeping is done.
- ``close_tiers_at_exit``: an NVMe tier's writes land and its swap folder goes at interpreter exit,
  even without ``destroy()`` (threading's exit hooks run before the thread pools are joined).
- ``refuse_a_model_in_use`` / ``refuse_empty_sequences``: a second ``initialize()`` on one model and
  an empty batch, refused by name before anything runs.
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..log import logger


class deferred_interrupt:
    """Context manager: from ``hold()`` to the end of the block, Ctrl-C (SIGINT) is recorded instead
    of raised, and raised as the previous handler would (KeyboardInterrupt) when the block is done;
    a second Ctrl-C meanwhile is raised at once (the user insists). Main thread only (signals are
    delivered there); elsewhere a no-op."""

    def __init__(self) -> None:
        self.previous, self.received = None, 0

    def hold(self) -> None:
        if self.previous is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        # ignored, or set from outside Python: leave it alone
        if previous in (signal.SIG_IGN, None):
            return
        self.previous = previous
        signal.signal(signal.SIGINT, self._record)

    def _record(self, signum, frame) -> None:
        self.received += 1
        if self.received > 1:
            self._restore()
            raise KeyboardInterrupt

    def _restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous, previous = None, self.previous
            return previous
        return None

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        previous = self._restore()
        if self.received == 1 and kind is None and previous is not None:
            if previous is signal.SIG_DFL:
                raise KeyboardInterrupt
            previous(signal.SIGINT, None)  # Python's default_int_handler raises KeyboardInterrupt
        return False


# each NVMe tier not yet closed -> its engine's ``synchronize`` (weak: keeps no engine alive)
_LIVE_TIERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EXIT_HOOK: list = []  # registered once per process
EXIT_FLUSH_TIMEOUT_S = 30.0


def close_tiers_at_exit(tier, synchronize: Callable[[], None]) -> None:
    """A script that never calls ``destroy()`` (most DeepSpeed scripts) must still exit: at
    interpreter exit the thread pools are joined first (``concurrent.futures``' own exit hook),
    after which the NVMe tier's queued writes could not be issued and the old finalizer waited on
    them for ever. This hook runs before that one (threading's exit hooks run last registered
    first): it waits for the engine's queued updates (``synchronize``, a bound method of the
    engine) while the I/O threads still run, then flushes ``tier`` (bounded) and removes its swap
    folder."""
    if not _EXIT_HOOK:
        try:
            threading._register_atexit(_close_live_tiers)
        # no such hook (another Python), or already shutting down
        except (AttributeError, RuntimeError):
            atexit.register(_close_live_tiers)
        _EXIT_HOOK.append(_close_live_tiers)
    _LIVE_TIERS[tier] = weakref.WeakMethod(synchronize)


def _close_live_tiers() -> None:
    for tier, synchronize in list(_LIVE_TIERS.items()):
        if tier.io is None:  # closed already (destroy)
            continue
        wait = synchronize()
        try:
            if wait is not None:
                wait()  # the queued optimizer tasks, which read and write the tier
        except BaseException as exc:  # noqa: BLE001 - at exit: report, then still close
            logger.warning(
                f"at exit: the engine's queued work failed ({type(exc).__name__}: {exc}); the "
                "NVMe tier is closed anyway"
            )
        try:
            tier.close(timeout=EXIT_FLUSH_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001
            logger.warning(f"at exit: {exc}; the swap folder was removed")
    _LIVE_TIERS.clear()


def refuse_a_model_in_use(model: nn.Module) -> None:
    """A second initialize() on a model an engine streams (its layers route into that engine, their
    weights live in its host buffers), or streamed until destroy(): say so, and what to do, instead
    of failing to find its layers."""
    from ..api import Z3_VIEW  # (zero.py imports nothing of this module)

    if any(
        getattr(m.__dict__.get("forward"), "_megatrain_executor", False) for m in model.modules()
    ):
        raise RuntimeError(
            f"initialize(): this {type(model).__name__} is already trained by a megatrain_ds "
            "engine (its layers' "
            "weights live in that engine's host memory). For evaluation use that engine itself "
            "(engine.eval() under "
            "torch.no_grad(), or engine.module.generate); for a second engine, build it from "
            "another instance of the "
            "model (from_pretrained again, or a copy.deepcopy made before the first initialize)"
        )
    if any(getattr(p, "_z3_optimizer", None) is Z3_VIEW for p in model.parameters()):
        raise RuntimeError(
            f"initialize(): this {type(model).__name__} was trained by a megatrain_ds engine that "
            "was destroyed: its "
            "parameters hold no weights (they lived in that engine's host memory). Build the new "
            "engine from a "
            "fresh model with the trained weights: save_checkpoint / save_16bit_model before "
            "destroy(), then "
            "load_checkpoint into the new engine or from_pretrained the exported folder"
        )


def refuse_empty_sequences(args: tuple, kwargs: dict) -> None:
    """A batch whose token ids hold no token (shape (B, 0)) fails deep inside the model
    (transformers: "IndexError: index -1 is out of bounds"); say what it is before anything runs."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (
        isinstance(ids, torch.Tensor)
        and ids.dim() >= 2
        and not ids.is_floating_point()
        and ids.shape[-1] == 0
    ):
        raise ValueError(
            f"engine(...): input_ids has shape {tuple(ids.shape)}, an empty sequence: there is "
            "nothing "
            "to compute. Skip empty batches in the data pipeline (e.g. drop samples with no tokens "
            "in "
            "the collator); the engine's state is unchanged"
        )
