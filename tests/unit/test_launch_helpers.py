"""The tests' launch helpers (tests/launch.py): a two-process launch where one fails does not wait on the other."""
import subprocess
import sys
import time

from tests.launch import aborted_at_exit, wait_both


def test_wait_both_stops_the_other_launch_once_one_has_failed():
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    start = time.monotonic()
    wait_both([waiting, failing], grace=0.5)
    assert time.monotonic() - start < 30
    assert failing.returncode == 3 and waiting.returncode not in (None, 0)


def test_wait_both_waits_for_two_that_succeed():
    procs = [subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({t})"]) for t in (0.2, 1.0)]
    wait_both(procs, grace=0.1)
    assert [p.returncode for p in procs] == [0, 0]


def test_only_the_exit_abort_line_with_a_failure_counts_as_the_exit_abort():
    line = "terminate called without an active exception"
    assert aborted_at_exit(-6, f"... done\n{line}\n")
    assert not aborted_at_exit(0, line) and not aborted_at_exit(1, "RuntimeError: something else")
