"""The import paths of the flat layout (before 2026-11-28) kept working: ``megatrain_ds.<module>`` for a module that
now lives in one of the package's rooms (docs/architecture.md) is that same module object, so a script's
``from megatrain_ds.config import ConfigError``, a checkpoint that pickled a class under its old path and a test's
``monkeypatch.setattr("megatrain_ds.executor.X", ...)`` all reach the module the package itself uses (never a copy).

The DeepSpeed mirrors (``megatrain_ds.zero``, ``.comm``, ``.utils``, ``.checkpointing``) are also attributes of the
package, set in ``__init__``, because scripts reach them as ``deepspeed.zero.Init`` after the import swap.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ROOMS = {
    "model": ("model_map", "loss", "tiling", "replay", "recompute_check"),
    "parallel": ("dp", "comm"),
    "host": ("host_memory", "host_state", "grad_hold", "nvme", "layer_state", "device_state", "placement"),
    "streaming": ("executor", "streams", "schedule", "landing", "timing", "inference", "activations"),
    "optim": ("optimizer", "host_update", "host_threads", "speculation", "resident", "loss_scale"),
    "planning": ("decisions", "capacity", "host_bytes", "plan", "plan_cli", "plan_gpu", "config", "config_values",
                 "shapes"),
    "checkpoints": ("checkpoint", "checkpoint_files", "checkpoint_folder", "checkpoint_partition", "checkpoint_stream",
                    "checksums", "adapters", "export", "wayback"),
    "api": ("surface", "zero", "zero_offload", "checkpointing", "utils", "monitor", "throughput"),
    "training": ("engine_auto", "engine_build", "engine_forward", "lifecycle"),
}
# old dotted name -> where the module lives now
MOVED = {f"megatrain_ds.{m}": f"megatrain_ds.{room}.{m}" for room, modules in ROOMS.items() for m in modules}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)  # the module itself: one object under both names
        self.spec = module.__spec__
        return module

    def get_code(self, fullname):
        """``python -m megatrain_ds.<old name>`` (runpy asks the loader for the code): its relative imports would
        resolve against the old package, so the command names the module's own path instead."""
        raise ImportError(f"{fullname} moved to {self.target}: run python -m {self.target}")

    def exec_module(self, module) -> None:
        # already executed under its own name; the import system has just set ``__spec__`` to the alias's spec:
        # the module keeps its own (its relative imports, reload and pickling go by where it lives)
        module.__spec__ = self.spec


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())  # before any finder that might load a stale flat copy
