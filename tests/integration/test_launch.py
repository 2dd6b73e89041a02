"""tests/launch.py: a launch is run again only when a rank died of the exit-time abort, up to three
launches."""

import subprocess

from tests.launch import EXIT_ABORT, run_again_after_exit_abort


def _results(*procs):
    calls = []

    def launch():
        calls.append(1)
        return procs[len(calls) - 1]

    return launch, calls


def test_runs_again_on_the_exit_abort_only():
    ok = subprocess.CompletedProcess([], 0, "", "")
    abort = subprocess.CompletedProcess([], 1, "", f"...\n{EXIT_ABORT}\nSignal 6 (SIGABRT)")
    other = subprocess.CompletedProcess([], 1, "", "Traceback ...\nAssertionError")
    for procs, want, n in (
        ((ok,), ok, 1),
        ((other,), other, 1),
        ((abort, ok), ok, 2),
        ((abort, other), other, 2),
        ((abort, abort, ok), ok, 3),
        ((abort, abort, abort), abort, 3),
    ):
        launch, calls = _results(*procs)
        assert run_again_after_exit_abort(launch) is want and len(calls) == n
