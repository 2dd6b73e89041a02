"""DeepSpeed's JIT-built C++ ops, built once before the suite's workers start (tests/conftest.py).

Why: with ``DS_BUILD_OPS=0`` (how the suite installs DeepSpeed) each op is compiled by the first
process that loads it: ``deepspeed_shm_comm`` at ``deepspeed.comm``'s init on CPU, ``cpu_adam`` at
DeepSpeedCPUAdam, ``pin_memory`` in ZeRO-3's offload, ``async_io`` where libaio is present. torch
builds under a lock file in the op's build folder (``torch.utils.cpp_extension``'s FileBaton) and
every other process waits *while that file exists*, with no timeout. Inside the suite the first
loader is often a rank of a multi-process test or a process a fault test kills on purpose; killed
mid-build, it leaves the lock behind and every later run of that op waits forever. A CI run
(2026-11-28, stop 42) sat at 91% until its 90-minute cap that way. Built here, serially and before
any test, no test process builds anything, and a build error shows as one clear line at the top of
the log.

A lock file older than ``STALE_S`` is removed first (no build takes that long; a younger one may be
another session's build in progress, and is left, so that session's build is not broken).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

STALE_S = 15 * 60
OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")


def _extensions_root() -> Path | None:
    """The folder torch builds every JIT op under (None if this torch no longer has the private
    helper)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    return Path(_get_build_directory("x", verbose=False)).parent


def clear_stale_locks(now: float | None = None) -> list[Path]:
    """Remove ``lock`` files older than ``STALE_S`` under torch's extensions folder; the removed
    paths."""
    now = time.time() if now is None else now
    removed = []
    root = _extensions_root()
    for lock in root.glob("*/lock") if root is not None and root.is_dir() else ():
        try:
            if now - lock.stat().st_mtime > STALE_S:
                lock.unlink()
                removed.append(lock)
        except FileNotFoundError:
            pass
    return removed


def prebuild(log=sys.stderr) -> dict[str, str]:
    """Build (or load, when already built) each op the suite's processes load; ``{builder:
    outcome}``."""
    for lock in clear_stale_locks():
        print(
            f"[tests/ops_prebuild.py] removed a stale torch extension build lock: {lock}",
            file=log,
            flush=True,
        )
    from deepspeed.accelerator import get_accelerator

    outcomes = {}
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)  # an instance, or None
        if builder is None or not builder.is_compatible(verbose=False):
            outcomes[name] = "not compatible here (skipped, as DeepSpeed skips it)"
            continue
        t = time.time()
        try:
            builder.load(verbose=False)
        # the tests that load it fail with this error themselves; the rest still run
        except Exception as exc:
            outcomes[name] = f"FAILED to build ({type(exc).__name__}: {str(exc)[:300]})"
            continue
        outcomes[name] = f"ready ({time.time() - t:.1f} s)"
    print(
        "[tests/ops_prebuild.py] DeepSpeed ops: "
        + ", ".join(f"{k} {v}" for k, v in outcomes.items()),
        file=log,
        flush=True,
    )
    return outcomes


# how tests/conftest.py runs it: DeepSpeed picks the accelerator as in the tests
if __name__ == "__main__":
    prebuild(sys.stderr)
