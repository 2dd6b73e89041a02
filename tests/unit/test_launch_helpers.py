"""The tests' launch helpers (tests/launch.py, tests/fork_launch.py): a two-process launch where one
fails does not wait on the other; the warm server's forked ranks behave as launched processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.launch import aborted_at_exit, wait_both


def test_wait_both_stops_the_other_launch_once_one_has_failed():
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    start = time.monotonic()
    wait_both([waiting, failing], grace=0.5)
    assert time.monotonic() - start < 30
    assert failing.returncode == 3 and waiting.returncode not in (None, 0)


def test_wait_both_waits_for_two_that_succeed():
    procs = [
        subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({t})"])
        for t in (0.2, 1.0)
    ]
    wait_both(procs, grace=0.1)
    assert [p.returncode for p in procs] == [0, 0]


def test_only_the_exit_abort_line_with_a_failure_counts_as_the_exit_abort():
    line = "terminate called without an active exception"
    assert aborted_at_exit(-6, f"... done\n{line}\n")
    assert not aborted_at_exit(0, line) and not aborted_at_exit(1, "RuntimeError: something else")


RANK_SCRIPT = """
import atexit, os, sys
rank = os.environ["RANK"]
env = os.environ
# one write (atomic on a pipe): unbuffered print() writes each piece apart, and two ranks' pieces
# would interleave on the shared stdout
fields = ["out", rank, env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"], os.getcwd()]
line = " ".join(fields)
os.write(1, (line + "\\n").encode())
atexit.register(lambda: open(os.path.join(sys.argv[1], "exit" + rank), "w").write("ran"))
if sys.argv[2] == "fail" and rank == "1":
    raise ValueError("rank 1 fails")
"""


def test_warm_run_forks_ranks_with_torchrun_env_and_exits_them_as_processes(tmp_path):
    """tests/fork_launch.py's warm server: each rank sees torchrun's variables and the launch's
    working folder, its output comes back, its atexit handlers run; a failing rank is the launch's
    exit status, with its traceback."""
    from tests.fork_launch import warm_run

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MASTER_PORT="29999",
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )
    proc = warm_run(2, str(script), [str(tmp_path), "ok"], env, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("out "))
    assert lines == [f"out {r} 2 {r} 29999 {tmp_path}" for r in (0, 1)]
    assert [(tmp_path / f"exit{r}").read_text() for r in (0, 1)] == ["ran", "ran"]
    failed = warm_run(2, str(script), [str(tmp_path), "fail"], env, timeout=120, cwd=str(tmp_path))
    assert failed.returncode == 1 and "ValueError: rank 1 fails" in failed.stderr


def test_spawned_ranks_get_torchrun_env_and_the_first_failure_is_the_status(tmp_path):
    """The launch for GPU runs (``--spawn``: fresh processes, no fork after a CUDA init): the same
    variables and exit handling as the forked ranks, and a failing rank's status is the launch's."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MASTER_PORT="29998")
    cmd = [sys.executable, "-m", "tests.fork_launch", "--spawn", "2", str(script), str(tmp_path)]
    root = str(Path(__file__).resolve().parents[2])
    ok = subprocess.run(
        [*cmd, "ok"], env=env, cwd=root, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = sorted(line for line in ok.stdout.splitlines() if line.startswith("out "))
    # (one loaded make test saw no lines with status 0: the whole output says what the ranks did)
    seen = f"stdout {ok.stdout[-2000:]!r} stderr {ok.stderr[-2000:]!r}"
    assert lines == [f"out {r} 2 {r} 29998 {root}" for r in (0, 1)], seen
    assert [(tmp_path / f"exit{r}").read_text() for r in (0, 1)] == ["ran", "ran"], seen
    bad = subprocess.run(
        [*cmd, "fail"], env=env, cwd=root, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and "ValueError: rank 1 fails" in bad.stderr
