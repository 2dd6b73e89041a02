"""torchrun as clusters run it: a rank killed mid-run and the job restarted from its last
checkpoint; a rank that
hangs; a rank that exited while another still waited for it.

- ``torchrun --max-restarts 1``: rank 1 SIGKILLs itself in step 3 (once); rank 0 fails at once in
its collective;
  torchrun restarts both; the script resumes from ``latest`` (it saves after every step) and the
  losses of the
  restarted steps equal an uninterrupted run's bit for bit. torchrun runs with
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
  by default (torch 2.13) its workers share the rendezvous' TCPStore across restarts with no
  per-round prefix, and
  the restarted ranks read the previous round's gloo addresses ("Gloo connectFullMesh failed ...
  Connection
  refused" in init_process_group; pytorch/pytorch#135712 describes the same for NCCL).
- A rank that sleeps for ever between backward() and step(): rank 0 names it (CollectiveError)
within
  ``collective_timeout``; torchrun then stops the hung worker, so every rank ends.
- A script that saves on rank 0 only: rank 1's script ends while rank 0 waits for it in
save_checkpoint(); rank 0's
  error says rank 1 exited (its exit record, dp.py [Note: collective timeouts]), not where it last
  reported being.

The script is tests/scripts/cluster_train.py (a tiny Llama, 2 ranks, gloo on CPU).
"""

import subprocess
import time
from pathlib import Path

from megatrain_ds.parallel import dp
from tests.launch import run_again_after_exit_abort
from tests.scripts import cluster_train as ct

STEPS, TIMEOUT_S = 5, 3.0


def _launch(cmd, tmp: Path, expect_ok: bool, **env) -> tuple[subprocess.CompletedProcess, Path]:
    """``cmd(out)`` in a fresh folder (launched again after the exit-time abort of tests/launch.py
    when it should
    succeed); returns the finished launch and its ``out``."""
    attempt = iter(range(3))
    outs = []

    def once():
        outs.append(tmp / f"attempt{next(attempt)}")
        return subprocess.run(
            [str(c) for c in cmd(outs[-1])],
            env=ct.launch_env(**env),
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=300,
        )

    proc = run_again_after_exit_abort(once) if expect_ok else once()
    assert (proc.returncode == 0) == expect_ok, (
        proc.returncode,
        (proc.stdout + proc.stderr)[-6000:],
    )
    return proc, outs[-1]


def test_torchrun_restarts_a_killed_rank_from_its_last_checkpoint(tmp_path):
    proc, out = _launch(
        lambda out: ct.torchrun(
            "--out",
            out,
            "--steps",
            STEPS,
            "--save",
            out / "ckpt",
            "--kill-rank",
            1,
            "--kill-at",
            3,
            launcher=("--max-restarts", "1"),
        ),
        tmp_path,
        expect_ok=True,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    log = proc.stdout + proc.stderr
    recs = ct.records(str(out))
    assert [e["fault"] for e in recs[1] if "fault" in e] == ["kill"]  # killed once, in step 3
    for rank, lines in recs.items():
        trained = [(e["restart"], e["step"]) for e in lines if "loss" in e]
        assert trained == [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4)], (rank, trained, log[-4000:])
        assert [(e["restart"], e["step"]) for e in lines if "resumed" in e] == [
            (1, 3)
        ]  # from global_step3
    for error in [
        e["error"] for e in recs[0] if "error" in e
    ]:  # rank 0, if torchrun's SIGTERM did not come first
        assert error["type"] == "CollectiveError" and "rank 1" in error["message"], error
    assert ct.losses(str(out)) == ct.reference_losses(STEPS)  # bit for bit


def test_a_hung_rank_is_named_and_torchrun_ends_every_rank(tmp_path):
    proc, out = _launch(
        lambda out: ct.torchrun(
            "--out", out, "--steps", STEPS, "--timeout", TIMEOUT_S, "--hang-rank", 1, "--hang-at", 2
        ),
        tmp_path,
        expect_ok=False,
    )
    ended = time.time()
    recs = ct.records(str(out))
    hang = next(e["time"] for e in recs[1] if e.get("fault") == "hang")
    error = next(e["error"] for e in recs[0] if "error" in e)
    assert error["type"] == "CollectiveError"
    assert TIMEOUT_S - 0.5 <= error["time"] - hang <= TIMEOUT_S + 10, error["time"] - hang
    assert ended - hang <= TIMEOUT_S + 45, ended - hang  # torchrun stopped the hung worker
    for said in (
        "rank 0 of 2: ",
        "in step() of micro-step 2 (global step 2)",
        "did not arrive: rank 1.",
        "rank 1 (did not arrive; host ",
        "between backward() and step() of micro-step 2: backward() returned",
    ):
        assert said in error["message"], error["message"]
    assert not any("finished" in e for lines in recs.values() for e in lines)


def test_a_rank_whose_script_ended_is_named_as_exited(tmp_path):
    """The published-script mistake: ``if rank == 0: engine.save_checkpoint(...)``. Before, rank 0's
    line for rank 1
    read "in backward() of micro-step N [report 0.4 s ago]" although rank 1 had exited
    successfully."""
    proc, out = _launch(
        lambda out: ct.torchrun(
            "--out", out, "--steps", 2, "--timeout", 30, "--rank0-saves", out / "ckpt"
        ),
        tmp_path,
        expect_ok=False,
    )
    recs = ct.records(str(out))
    assert any("finished" in e for e in recs[1])  # rank 1's script ended normally
    error = next(e["error"] for e in recs[0] if "error" in e)
    message = error["message"]
    assert error["type"] == "CollectiveError"
    for said in (
        "in save_checkpoint() (global step 2)",
        "the process of rank 1 exited.",
        "rank 1 (exited; host ",
        "exited: its script ended without an uncaught exception",
        "its last engine call: step() returned (micro-step 2, global step 2)",
        "rank 1 ended its script while rank 0 still made engine calls",
        "save_checkpoint() and GatheredParameters on every rank",
    ):
        assert said in message, message
    assert "in backward()" not in message and "did not arrive" not in message, message


class _FakeBoard:
    host, pid = "here", 1

    def __init__(self, reports):
        self.reports = reports

    def read(self):
        return dict(self.reports)


def _waiting_rank(reports: dict, world: int = 3) -> dp.DataParallel:
    """Rank 0 of ``world``, in step() of micro-step 4, its board holding ``reports`` (no process
    group)."""
    par = object.__new__(dp.DataParallel)
    par.world, par.rank, par.timeout_s, par.backend = world, 0, 3.0, "gloo"
    par.position = {"phase": "step", "seq": 9, "m": 4, "g": 4, "c": 1, "in": "the norm"}
    par._board = _FakeBoard(reports)
    return par


def test_the_report_says_exited_killed_or_behind():
    """Unit: rank 1 exited after an uncaught exception (its exit record), rank 2 left no record and
    its pid is gone
    (this host): named as exited with the exception and status, and as killed or crashed."""
    now = time.time()
    last = {
        "phase": "backward",
        "seq": 8,
        "m": 4,
        "g": 3,
        "c": 2,
        "in": "x",
        "t": now - 1,
        "host": "here",
        "pid": 1,
    }
    gone_pid = subprocess.Popen(["true"])
    gone_pid.wait()
    reports = {
        1: {**last, "pid": 11, "exit": {"raised": "KeyError: 'x'", "status": 1, "t": now}},
        2: {**last, "host": dp.socket.gethostname(), "pid": gone_pid.pid},
    }
    err = _waiting_rank(reports).explain(RuntimeError("Connection closed by peer"), "the norm", 0.1)
    text = str(err)
    assert err.missing == [1, 2]
    assert (
        "rank 1 (exited; host here, pid 11): exited after an uncaught KeyError: 'x' (exit status 1)"
        in text
    )
    assert "its last engine call: backward() (micro-step 4, global step 3)" in text
    assert "rank 2 (its process is gone: killed or crashed, no exit recorded;" in text
    assert (
        "the process of rank 1, rank 2 exited or crashed" in text and "its own log says why" in text
    )
    reports[2]["exit"] = {"raised": None, "status": None, "t": now}  # both exited
    text = str(
        _waiting_rank(reports).explain(RuntimeError("Connection closed by peer"), "the norm", 0.1)
    )
    assert (
        "the process of rank 1, rank 2 exited." in text
        and "rank 1, rank 2 ended their scripts while rank 0" not in text
        and "rank 2 ended its script while rank 0" in text
    )
