"""The config error and the reading of DeepSpeed's validation errors, in a module of their own:
config.py raises them, and so do the modules config.py calls to validate a block (monitor.py), which
must not import config.py back. Both names stay importable from ``megatrain_ds.planning.config``
(and ``ConfigError`` from ``megatrain_ds``)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value megatrain_ds cannot use; the message names the key."""


def validation_error_parts(exc: Exception) -> tuple[str, str]:
    """(key, reason) of a pydantic ValidationError from one of DeepSpeed's config models. The key is
    "" when the model's own cross-field check failed (its reason names the keys)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return ".".join(str(part) for part in first.get("loc", ())), str(first.get("msg", exc))
    lines = str(exc).splitlines()
    return (lines[1].strip() if len(lines) > 1 else "?"), (
        lines[2].strip() if len(lines) > 2 else str(exc)
    )
