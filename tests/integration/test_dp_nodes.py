"""Data parallel past one host, and the gradients held on the device under data parallel (CPU, gloo;
dp.py).

- Two "nodes" on this machine: two ``torchrun --nnodes 2 --node_rank 0/1`` launches over 127.0.0.1,
  one rank each. Each is its own host (GROUP_RANK differs; LOCAL_WORLD_SIZE is 1): with
  ``host_sharding: "node"`` each holds a whole copy of the host state and the gradients are
  all-reduced between them; with ``"job"`` each holds half. Both train bit for bit as one node of
  two ranks (the same sums, the global norm added in one order).
- ``gradient_hold: "gpu"`` on 2 ranks (the owners hold their layers' mean gradients on the device,
  here the CPU device): bit for bit as the host landing on 2 ranks, with fewer host bytes, and the
  planner's host bytes for 2 ranks are the engine's to the byte.
Script: tests/scripts/dp_train.py.
"""

import json
import subprocess
import sys

import pytest
import torch

from tests.launch import run_again_after_exit_abort, wait_both
from tests.integration.test_dp import SCRIPT, _check, _env, _port, run

# one path twice: which layers step before the norm is a race (speculation.py)
SAME = {"speculative_step": False}
LAYERS = ("--layers", "8")  # 4 per rank: more than the 3 slabs a held gradient is read through


def same_bits(got: dict, want: dict) -> None:
    assert (
        got["loss"] == want["loss"]
        and got["grad_norm"] == want["grad_norm"]
        and got["lr"] == want["lr"]
    )
    assert set(got["weights"]) == set(want["weights"])
    for name, w in want["weights"].items():
        assert torch.equal(got["weights"][name], w), name
    assert len(set(got["digests"])) == 1


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """One node of two ranks: what the two-node launches must equal."""
    return run(
        tmp_path_factory.mktemp("nodes") / "one.json", *LAYERS, "--mt", json.dumps(SAME), ranks=2
    )


def two_nodes(tmp_path, *args: str) -> dict:
    """Two ``torchrun --nnodes 2`` launches on this host (one rank each, LOCAL_RANK 0 on both); rank
    0's record."""
    out = tmp_path / "nodes.json"

    def launch():  # both "nodes"; the first failure (or success) of the two, with both logs
        port, logs, procs = _port(), [], []
        for node in (0, 1):
            logs.append(
                (open(tmp_path / f"node{node}.out", "w+"), open(tmp_path / f"node{node}.err", "w+"))
            )
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nnodes",
                        "2",
                        "--nproc_per_node",
                        "1",
                        "--node_rank",
                        str(node),
                        "--master_addr",
                        "127.0.0.1",
                        "--master_port",
                        str(port),
                        str(SCRIPT),
                        "--out",
                        str(out if node == 0 else tmp_path / "unused.json"),
                        *LAYERS,
                        *args,
                    ],
                    env=_env(),
                    stdout=logs[-1][0],
                    stderr=logs[-1][1],
                    text=True,
                )
            )
        wait_both(procs)
        text = [[f.seek(0) or f.read() for f in pair] for pair in logs]
        for pair in logs:
            for f in pair:
                f.close()
        failed = [proc for proc in procs if proc.returncode != 0]
        proc = (failed or procs)[0]
        return subprocess.CompletedProcess(
            proc.args, proc.returncode, "".join(t[0] for t in text), "".join(t[1] for t in text)
        )

    _check(run_again_after_exit_abort(launch))
    record = json.loads(out.read_text())
    record["weights"] = torch.load(str(out) + ".pt")
    return record


def test_two_nodes_hold_a_copy_each_and_train_as_one_node(one_node, tmp_path):
    """ "node" sharding (the default): each node holds every layer and resident parameter
    (LOCAL_WORLD_SIZE 1: its own host), and the two nodes train bit for bit as one node of two
    ranks."""
    got = two_nodes(tmp_path, "--mt", json.dumps(SAME))
    assert got["world"] == 2 and [r["local_world"] for r in got["ranks"]] == [1, 1]
    total = got["host_elements"][0][1]
    assert [n for n, _ in got["host_elements"]] == [total, total]
    assert [len(r["resident"]) for r in got["ranks"]] == [3, 3]
    assert (
        got["ranks"][0]["host_bytes"] == got["ranks"][1]["host_bytes"] == got["planned_host_bytes"]
    )
    same_bits(got, one_node)


def test_two_nodes_sharing_one_copy_train_as_one_node(one_node, tmp_path):
    """ "job" sharding: the two nodes hold half the state each (one copy over the job) and train bit
    for bit as one node of two ranks."""
    got = two_nodes(tmp_path, "--mt", json.dumps({**SAME, "host_sharding": "job"}))
    total = got["host_elements"][0][1]
    assert sum(n for n, _ in got["host_elements"]) == total and all(
        0 < n < total for n, _ in got["host_elements"]
    )
    assert [r["local_world"] for r in got["ranks"]] == [1, 1]
    same_bits(got, one_node)


def test_held_gradients_two_ranks_equal_the_host_landing(one_node, tmp_path):
    """gradient_hold "gpu" with 2 ranks: each owner keeps its layers' mean gradient on the device
    until its update; bit for bit as the host landing, no host gradient buffer (three slabs each),
    the plan the engine's to the byte."""
    got = run(
        tmp_path / "hold.json",
        *LAYERS,
        "--mt",
        json.dumps({**SAME, "gradient_hold": "gpu"}),
        ranks=2,
    )
    assert [r["grad_hold"] for r in got["ranks"]] == [True, True]
    same_bits(got, one_node)
    hold = sum(r["host_bytes"] for r in got["ranks"])
    assert hold == got["planned_host_bytes"] and hold < sum(
        r["host_bytes"] for r in one_node["ranks"]
    )
