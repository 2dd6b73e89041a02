"""Multi-process launches in the tests, and the one failure they run again.

On this CPU box, a rank of a gloo run (torch 2.13; ours and real DeepSpeed's alike) now and then
dies of SIGABRT with ``terminate called without an active exception`` *after* its script has
finished: its records are written, every ``atexit`` handler has run, the process groups were
destroyed (tests/integration/test_dp.py's exit markers say so), and only interpreter finalization
was left. A C++ thread object is destroyed while still joinable there. That is not training
behaviour, so a launch that failed with exactly that line is run again, up to three launches in all
(said on stdout, so it shows in the test log); any other failure, or that one three times in a row,
fails the test as before. (Twice in a row was seen once under the two-worker suite, 2026-11-27:
tests/integration/test_dp.py's bf16-masters run.)
"""

from __future__ import annotations

import subprocess
import sys
import time

EXIT_ABORT = "terminate called without an active exception"


def aborted_at_exit(returncode: int, stderr: str | None) -> bool:
    return returncode != 0 and EXIT_ABORT in (stderr or "")


def run_again_after_exit_abort(launch, attempts: int = 3) -> subprocess.CompletedProcess:
    """``launch()`` -> a finished process (``CompletedProcess``, or anything with ``returncode``,
    ``stdout``, ``stderr``); called again, with a fresh port if it picks one, when a rank died of
    the exit-time abort."""
    for attempt in range(attempts):
        proc = launch()
        if not aborted_at_exit(proc.returncode, proc.stderr) or attempt == attempts - 1:
            return proc
        print(
            f"[tests/launch.py] a rank died of {EXIT_ABORT!r} after its script; launching again "
            f"(attempt {attempt + 2} of {attempts})",
            file=sys.stdout,
            flush=True,
        )
    return proc


def wait_both(procs, grace: float = 20.0, limit: float = 900.0) -> None:
    """Wait for both launches; once one has failed, the other gets ``grace`` seconds and is then
    stopped. Its agent would otherwise sit in torchrun's exit barrier for the failed node (300 s:
    seen in the suite, 2026-11-29, when a rank died of the exit-time abort that tests/launch.py runs
    again)."""
    start, failed_at = time.monotonic(), None
    # a list: every one polled (any() would stop at the first running)
    while None in [p.poll() for p in procs]:
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now - start > limit or (failed_at is not None and now - failed_at > grace):
            for p in procs:  # SIGTERM first: torchrun's agent then stops its worker
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            return
        time.sleep(0.2)
