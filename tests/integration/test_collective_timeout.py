"""Collective timeouts that name the rank (dp.py, [Note: collective timeouts];
``megatrain.collective_timeout``).

Before: a rank stalled between ``backward()`` and ``step()`` (a data loader, a debugger) left every
other rank waiting in the norm's all-reduce for gloo's default 30 minutes (NCCL's watchdog: 10), and
the error named neither the rank nor the collective. Now each rank raises ``CollectiveError`` within
the configured timeout, naming itself, the collective and step, the rank that did not arrive and
where it is, and what to do; both processes exit. Two gloo processes on the CPU
(tests/scripts/dp_fault.py); every wait is bounded (its ``launch_pair`` kills what is left after 120
s), so this test cannot hang.
"""

import json
import math

import pytest

from megatrain_ds.planning.config import (
    ConfigError,
    MegatrainSettings,
    collective_timeout_of,
    parse_config,
)
from tests.scripts.dp_fault import launch_pair

TIMEOUT_S = 3.0
CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("bad", [0, -1, "600", True, math.nan, math.inf, None])
def test_the_key_is_checked_by_name(bad):
    with pytest.raises(
        ConfigError, match=r"megatrain\.collective_timeout must be a number of seconds > 0"
    ):
        parse_config({**CFG, "megatrain": {"collective_timeout": bad}})


def test_the_default_and_the_process_group_megatrain_creates():
    assert MegatrainSettings().collective_timeout == 600.0  # NCCL's own default wait
    assert (
        parse_config({**CFG, "megatrain": {"collective_timeout": 2.5}}).megatrain.collective_timeout
        == 2.5
    )
    # initialize() makes the launcher's process group before it parses the config: with this timeout
    assert (
        collective_timeout_of({**CFG, "megatrain": {"collective_timeout": 90}}).total_seconds()
        == 90
    )
    assert collective_timeout_of(CFG).total_seconds() == 600
    # parse_config says why
    assert collective_timeout_of({**CFG, "megatrain": {"collective_timeout": -1}}) is None


def test_a_rank_stalled_between_backward_and_step_is_named_and_every_rank_exits(tmp_path):
    """Rank 1 sleeps 8 s between backward() and step() of its second step; the timeout is 3 s."""
    procs, logs = launch_pair(
        str(tmp_path),
        [
            "--timeout",
            str(TIMEOUT_S),
            "--fault",
            "stall",
            "--at",
            "between",
            "--victim",
            "1",
            "--fault-step",
            "1",
            "--stall",
            "8",
        ],
    )
    records = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    # both exited by themselves (launch_pair kills and sets None otherwise), failing
    for r, proc in procs.items():
        assert proc.returncode not in (None, 0), (r, proc.returncode, open(logs[r]).read()[-3000:])
    fault = records[1]["events"]["fault"]
    error = records[0]["error"]
    assert error["type"] == "CollectiveError", error
    assert TIMEOUT_S - 0.5 <= error["time"] - fault <= TIMEOUT_S + 15, error["time"] - fault
    message = error["message"]
    for said in (
        "rank 0 of 2: the all-reduce of the global gradient norm, in step() of micro-step 1 "
        "(global step 1)",
        "did not complete within megatrain.collective_timeout = 3 s; did not arrive: rank 1.",
        "rank 1 (did not arrive; host ",
        "between backward() and step() of micro-step 1: backward() returned, step() not called yet",
        "What to do: every rank must make the same engine calls",
        "raise megatrain.collective_timeout",
        "(gloo: ",
    ):
        assert said in message, message
    assert error["missing"] == [1]
    # the stalled rank, once it resumes, finds its peer gone: it fails too, naming it, instead of
    # waiting
    late = records[1]["error"]
    assert late["type"] == "CollectiveError" and late["missing"] == [0], late
    assert (
        "connection closed" in late["message"]
        and records[1]["events"]["stall_over"] <= late["time"]
    )
