"""The dependency versions the test suite has passed with, and the one warning outside them.

megatrain_ds's gradients are right only while the model code it streams behaves as it expects (how a
decoder layer receives its KV cache, what it returns, how output capturing records router logits):
details of transformers that change from one monthly release to the next. ``TESTED`` is the range of
each dependency the suite (``make test``, and the drift subset under the oldest and the newest
releases: ``make oldest``, ``make canary``) has passed with; ``check_installed`` is called by
``initialize`` and warns once per process, naming each package outside it. The recompute check
(recompute_check.py) is what stops a run that an untested release breaks.

    # installed vs tested, one line per package; exit 1 if any is outside
    python -m megatrain_ds.versions
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings

# package -> (oldest, newest) the suite has passed with. Keep in step with pyproject.toml's ranges,
# constraints.txt (the newest: what `make` installs) and constraints-oldest.txt (`make oldest`).
# torch: CI runs 2.13.0 (CPU); the lent GPU boxes run 2.11 (+cu130).
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "2.13.0"),
    "transformers": ("5.2.0", "5.24.0"),
    "deepspeed": ("0.19.8", "0.19.8"),
    "accelerate": ("1.0.1", "1.15.0"),
    "peft": ("0.13.2", "0.21.2"),
}
_WARNED = False


def _release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); '5.2' -> (5, 2, 0). Pre-releases count as their release."""
    from packaging.version import Version

    release = Version(version).release
    return tuple(release) + (0,) * (3 - len(release))


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def status(package: str, version: str | None) -> str:
    """'tested', 'older than tested', 'newer than tested' or 'not installed'."""
    if version is None:
        return "not installed"
    oldest, newest = TESTED[package]
    if _release(version) < _release(oldest):
        return "older than tested"
    if _release(version) > _release(newest):
        return "newer than tested"
    return "tested"


def outside() -> list[str]:
    """'<package> <version> (<status>; tested <oldest>..<newest>)' for each installed package
    outside its range."""
    out = []
    for package, (oldest, newest) in TESTED.items():
        version = installed(package)
        state = status(package, version)
        if state not in ("tested", "not installed"):
            out.append(f"{package} {version} ({state}; tested {oldest}..{newest})")
    return out


def check_installed() -> list[str]:
    """At ``initialize``: one warning per process naming every installed dependency outside
    ``TESTED``."""
    global _WARNED
    bad = outside()
    if bad and not _WARNED:
        _WARNED = True
        warnings.warn(
            "megatrain_ds has not been tested with "
            + ", ".join(bad)
            + ". Its gradients rest on details "
            "of these packages; the recompute check (megatrain.check_recompute) stops a run whose "
            "recompute "
            "no longer reproduces the forward, but the tested versions are the safe choice: pip "
            "install "
            "-c constraints.txt (in the repository) or `python -m megatrain_ds.versions`.",
            stacklevel=3,
        )
    return bad


def main() -> int:
    print(f"{'package':<14}{'installed':<16}{'tested':<22}status")
    bad = 0
    for package, (oldest, newest) in TESTED.items():
        version = installed(package)
        state = status(package, version)
        bad += state not in ("tested", "not installed")
        print(f"{package:<14}{version or '-':<16}{oldest + '..' + newest:<22}{state}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
