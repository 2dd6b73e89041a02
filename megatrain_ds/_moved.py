"""The import paths of the flat layout (before 2026-11-28) kept working until 2027-03-01:
``megatrain_ds.<module>`` for a module that now lives in one of its packages (docs/architecture.md)
is that same module object, so a script's ``from megatrain_ds.config import ConfigError``, a
checkpoint that pickled a class under its old path and a test's
``monkeypatch.setattr("megatrain_ds.executor.X", ...)`` all reach the module the package itself uses
(never a copy). Each such path warns once per process (a ``DeprecationWarning`` naming the new path,
at the line that named the old one): the old paths are removed after 2027-03-01.

The DeepSpeed mirrors (``megatrain_ds.zero``, ``.comm``, ``.utils``, ``.checkpointing``:
``DEEPSPEED_MIRRORS``) are DeepSpeed's own names, not old paths: they stay and do not warn. They are
also attributes of the package, set in ``__init__``, because scripts reach them as
``deepspeed.zero.Init`` after the import swap.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

REMOVED_AFTER = "2027-03-01"  # the old paths' end date
PACKAGES = {
    "model": ("model_map", "loss", "tiling", "replay", "recompute_check"),
    "parallel": ("dp", "comm"),
    "host": (
        "host_memory",
        "host_state",
        "grad_hold",
        "nvme",
        "layer_state",
        "device_state",
        "placement",
    ),
    "streaming": (
        "executor",
        "streams",
        "schedule",
        "landing",
        "timing",
        "inference",
        "activations",
    ),
    "optim": ("optimizer", "host_update", "speculation", "resident", "loss_scale"),
    "planning": (
        "decisions",
        "capacity",
        "host_bytes",
        "plan",
        "plan_cli",
        "plan_gpu",
        "config",
        "config_values",
        "shapes",
    ),
    "checkpoints": (
        "checkpoint",
        "checkpoint_files",
        "checkpoint_folder",
        "checkpoint_partition",
        "checkpoint_stream",
        "checksums",
        "adapters",
        "export",
        "wayback",
    ),
    "api": ("surface", "zero", "zero_offload", "checkpointing", "utils", "monitor", "throughput"),
    "training": ("engine_auto", "engine_build", "engine_forward", "lifecycle"),
}
# old dotted name -> where the module lives now
MOVED = {
    f"megatrain_ds.{m}": f"megatrain_ds.{package}.{m}"
    for package, modules in PACKAGES.items()
    for m in modules
}

# DeepSpeed's names (``deepspeed.zero``, ...) that reach the same modules: not old paths, no end
# date
DEEPSPEED_MIRRORS = frozenset(
    f"megatrain_ds.{m}" for m in ("zero", "comm", "utils", "checkpointing")
)
# frames between the line that named an old path and the finder: the import system, this module, the
# package's ``__getattr__`` (``megatrain_ds.config`` as an attribute)
_IMPORT_FRAMES = (
    "<frozen importlib",
    os.path.dirname(importlib.__file__) + os.sep,
    __file__,
    os.path.join(os.path.dirname(__file__), "__init__.py"),
)


def _warn_old_path(old: str, new: str) -> None:
    """A DeprecationWarning attributed to the first frame outside the import system, so Python's
    default filters show it where that line is in ``__main__`` (a script's ``import
    megatrain_ds.config``)."""
    message = (
        f"{old} moved to {new}: import it from there (the old path is removed after {REMOVED_AFTER}"
        ")"
    )
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_IMPORT_FRAMES):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return
    warnings.warn_explicit(
        message,
        DeprecationWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__", "<unknown>"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.spec = None

    def create_module(self, spec):
        # the module itself: one object under both names
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def get_code(self, fullname):
        """``python -m megatrain_ds.<old name>`` (runpy asks the loader for the code): its relative
        imports would resolve against the old package, so the command names the module's own path
        instead."""
        raise ImportError(f"{fullname} moved to {self.target}: run python -m {self.target}")

    def exec_module(self, module) -> None:
        # already executed under its own name; the import system has just set ``__spec__`` to the
        # alias's spec: the module keeps its own (its relative imports, reload and pickling go by
        # where it lives)
        module.__spec__ = self.spec


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        if fullname not in DEEPSPEED_MIRRORS:
            _warn_old_path(fullname, new)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())  # before any finder that might load a stale flat copy
