"""The host budget under a real memory cgroup (DESIGN.md, "Honest limits"): a process in a cgroup
with a memory limit
plans against the limit, and a run the cgroup cannot hold is refused at ``initialize`` with the
numbers, never killed
by the cgroup's OOM killer.

Each test makes a cgroup of its own (v1: /sys/fs/cgroup/memory/megatrain_test_<pid>_<n>; v2 when
/sys/fs/cgroup/cgroup.controllers exists), writes its limit, starts a child that moves itself in
(``sh -c 'echo $$ > .../cgroup.procs; exec python ...'``) and removes the cgroup afterwards. The
children import torch
(about 250-300 MB resident): the limits leave room for that, and the refused model's host state
(about 2.1 GB) is
larger than the whole limit.
"""

import os
import subprocess
import sys
import textwrap
from itertools import count

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CGROUP = "/sys/fs/cgroup"
V2 = os.path.exists(os.path.join(CGROUP, "cgroup.controllers"))
MiB = 2**20
_serial = count()


class MemoryCgroup:
    """A memory cgroup with ``limit`` bytes (no swap), removed by ``remove``."""

    def __init__(self, limit: int) -> None:
        name = f"megatrain_test_{os.getpid()}_{next(_serial)}"
        self.name = "/" + name
        self.dir = os.path.join(CGROUP, name) if V2 else os.path.join(CGROUP, "memory", name)
        if V2:
            with open(os.path.join(CGROUP, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        os.mkdir(self.dir)
        if V2:
            self._write("memory.max", limit)
            if os.path.exists(os.path.join(self.dir, "memory.swap.max")):
                self._write("memory.swap.max", 0)
        else:
            self._write("memory.limit_in_bytes", limit)
            if os.path.exists(os.path.join(self.dir, "memory.memsw.limit_in_bytes")):
                self._write(
                    "memory.memsw.limit_in_bytes", limit
                )  # no swap: over the limit is an OOM kill

    def _write(self, name: str, value) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(str(value))

    def oom_kills(self) -> int:
        """OOM kills in this cgroup (v1 memory.oom_control's oom_kill, v2 memory.events')."""
        with open(os.path.join(self.dir, "memory.events" if V2 else "memory.oom_control")) as f:
            fields = dict(line.split() for line in f if line.strip())
        return int(fields.get("oom_kill", 0))

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """``argv`` in this cgroup (the child moves itself in before exec), from the repository
        root."""
        procs = os.path.join(self.dir, "cgroup.procs")
        command = f'echo $$ > {procs} && exec "$@"'
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        return subprocess.run(
            ["sh", "-c", command, "sh", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def remove(self) -> None:
        if os.path.isdir(self.dir):
            os.rmdir(self.dir)


@pytest.fixture
def cgroup():
    made = []

    def make(limit: int) -> MemoryCgroup:
        made.append(MemoryCgroup(limit))
        return made[-1]

    yield make
    for group in made:
        group.remove()


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_plan_budget_is_the_cgroup_room(cgroup):
    group = cgroup(1536 * MiB)
    out = group.run(
        [sys.executable, "-m", "megatrain_ds.cli", "plan", "tiny", "--device", "cpu", "--json"]
    )
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: does not fit; either way no kill
    import json

    plan = json.loads(out.stdout)
    assert 0 < plan["host_budget_bytes"] <= 1536 * MiB
    assert plan["host_budget_source"].startswith(f"memory cgroup {group.name} limit 1.50 GiB - "), (
        plan
    )
    assert group.oom_kills() == 0


REFUSED = """
    import torch
    import megatrain_ds
    from megatrain_ds.planning.capacity import CapacityError
    from tests.models import PlainLM

    # 134 M parameters: 0.5 GB of weights, 2.1 GB of host state
    model = PlainLM(vocab=64, width=2048, depth=8)
    config = {"train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0}}
    try:
        megatrain_ds.initialize(model=model, config=config)
    except CapacityError as exc:
        print("REFUSED:", exc)
        raise SystemExit(3)
    print("ACCEPTED")
"""


def test_initialize_refuses_what_the_cgroup_cannot_hold(cgroup, tmp_path):
    group = cgroup(1536 * MiB)
    out = group.run([sys.executable, _script(tmp_path, REFUSED)])
    assert out.returncode == 3, (
        out.returncode,
        out.stdout[-2000:],
        out.stderr[-3000:],
    )  # not -9: no OOM kill
    message = out.stdout.split("REFUSED:", 1)[1]
    first = message.splitlines()[0]
    assert (
        "host RAM: needs 2.0" in first and f"(memory cgroup {group.name} limit 1.50 GiB - " in first
    ), first
    assert "ask the scheduler for more memory" in first
    assert group.oom_kills() == 0


TRAINS = """
    import torch
    import megatrain_ds
    from tests.models import PlainLM

    torch.manual_seed(0)
    model = PlainLM(vocab=64, width=64, depth=3)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0}}
    engine, *_ = megatrain_ds.initialize(model=model, config=config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        logits = engine(ids)
        shifted = logits[:, :-1].reshape(-1, 64)
        loss = torch.nn.functional.cross_entropy(shifted, ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    print("LOSSES", losses)
"""


def test_a_run_inside_the_limit_trains(cgroup, tmp_path):
    group = cgroup(1536 * MiB)
    out = group.run([sys.executable, _script(tmp_path, TRAINS)])
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    losses = eval(out.stdout.split("LOSSES", 1)[1])
    assert len(losses) == 4 and losses[-1] < losses[0]
    logged = out.stdout + out.stderr
    assert f" budget (memory cgroup {group.name} limit 1.50 GiB - " in logged, logged[-3000:]
    assert "step=4, skipped=0" in logged
    assert group.oom_kills() == 0
