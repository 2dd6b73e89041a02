"""Run a function on a module right after its first import finishes (a post-import hook).

    after_import("deepspeed", patch)   # patch(module) runs once deepspeed/__init__.py has executed

A finder at the front of ``sys.meta_path`` answers only for the registered names: it asks the
finders behind it for the real spec and wraps the spec's loader so that ``exec_module`` runs the
module's own code and then the hook. After that the module's ``__loader__`` and ``__spec__.loader``
are the real loader again. A module already imported when its hook is registered is patched at once.
Nothing is imported ahead of time.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

_hooks: dict[str, Callable] = {}


class _HookedLoader(importlib.abc.Loader):
    """The real loader, plus the hook after ``exec_module``."""

    def __init__(self, loader, hook: Callable) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._hook(module)

    # get_source, get_resource_reader, is_package, ...: the real loader's
    def __getattr__(self, name):
        return getattr(self._loader, name)


class _HookFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        hook = _hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader, hook)
        return spec


_finder = _HookFinder()


def after_import(name: str, hook: Callable) -> None:
    """Call ``hook(module)`` when module ``name`` has been imported (now, if it already has
    been)."""
    _hooks[name] = hook
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None:
        hook(module)


def installed(name: str) -> bool:
    return name in _hooks and _finder in sys.meta_path
