"""The two version strings of megatrain_ds, in a module of their own so that the package's modules
read them without importing the package ``__init__`` (which imports the engine: an import circle).

``MEGATRAIN_VERSION`` is megatrain_ds's own release; ``__version__`` is the installed DeepSpeed's
(see the comment below). ``megatrain_ds.__version__`` and ``megatrain_ds.MEGATRAIN_VERSION`` are
these.
"""

from __future__ import annotations

import importlib.metadata

# megatrain_ds's own release (pyproject.toml's version; tests keep them equal)
MEGATRAIN_VERSION = "0.1.0"


def _deepspeed_version() -> str:
    """The installed DeepSpeed's version, from its metadata (importing deepspeed costs seconds)."""
    try:
        return importlib.metadata.version("deepspeed")
    # a dependency, so a broken install: every version gate fails
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


# Scripts gate features on ``deepspeed.__version__`` (OpenRLHF, trl, LLaMA-Factory: ``>= 0.9``, ``>=
# 0.16.5``) and, with ``import megatrain_ds as deepspeed``, read this one: it is the installed
# DeepSpeed's, so those gates pass as they would for the DeepSpeed beside megatrain_ds (whose config
# schema, lr schedules and comm it uses). megatrain_ds's own version is MEGATRAIN_VERSION.
__version__ = _deepspeed_version()
