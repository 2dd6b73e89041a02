"""Host memory limits (megatrain_ds/host/host_limits.py, planning/host_bytes.py's ``host_budget``):
the budget is the
smallest of MemAvailable, the memory cgroup's room and the user's setting, and says which limit
binds.

- ``cgroup_memory`` on fake cgroup trees in tmp_path: v1 and v2 layouts, nested levels (the tightest
binds),
  "unlimited" (a v1 limit of 2^63 rounded to a page; v2 "max"), the inactive page cache not counted
  as used, a
  container's view (its cgroup is the mount's root), a hybrid host (v2 under ``unified``).
- ``host_budget`` with injected limits: which one binds and the words it prints; a set budget above
the cgroup's room
  is cut to it.
- ``pinning_limits`` / ``pin_failure_message``: each limit page-locking runs into, with the numbers
and the shortfall.
- ``check_capacity`` refuses a run the cgroup cannot hold, naming the cgroup; a CUDA plan notes
RLIMIT_MEMLOCK.
"""

import os

import pytest

from megatrain_ds.host import host_limits
from megatrain_ds.host.host_limits import CgroupMemory, cgroup_memory, pinning_limits
from megatrain_ds.host.host_memory import pin_failure_message
from megatrain_ds.planning import capacity_count, host_bytes, plan
from megatrain_ds.planning.host_bytes import HostBudget, HostLimits, host_budget
from tests.models import tiny_hf

GiB = 2**30
V1_NONE = (
    9223372036854771712  # what a v1 cgroup without a limit shows (2^63 - 1 rounded down to 4 KiB)
)


def _v1_level(directory, limit, usage, inactive=0):
    os.makedirs(directory, exist_ok=True)
    for name, value in (("memory.limit_in_bytes", limit), ("memory.usage_in_bytes", usage)):
        with open(os.path.join(directory, name), "w") as f:
            f.write(f"{value}\n")
    with open(os.path.join(directory, "memory.stat"), "w") as f:
        f.write(f"cache 1234\ninactive_file 1\ntotal_inactive_file {inactive}\n")


def _v2_level(directory, limit, usage, inactive=0):
    os.makedirs(directory, exist_ok=True)
    if limit is not None:  # the root of a v2 hierarchy has no memory.max
        with open(os.path.join(directory, "memory.max"), "w") as f:
            f.write(f"{limit}\n")
    with open(os.path.join(directory, "memory.current"), "w") as f:
        f.write(f"{usage}\n")
    with open(os.path.join(directory, "memory.stat"), "w") as f:
        f.write(f"anon 5\ninactive_file {inactive}\n")


def _proc(tmp_path, text):
    path = tmp_path / "proc_cgroup"
    path.write_text(text)
    return str(path)


def test_v1_nested_the_tightest_level_binds(tmp_path):
    mem = tmp_path / "cg" / "memory"
    _v1_level(mem, V1_NONE, 10 * GiB)
    _v1_level(mem / "slurm", 8 * GiB, 7 * GiB)  # 1 GiB left: binds
    _v1_level(mem / "slurm" / "job_1", 6 * GiB, 2 * GiB, inactive=GiB // 2)  # 4.5 GiB left
    proc = _proc(tmp_path, "5:cpu,cpuacct:/slurm/job_1\n4:memory:/slurm/job_1\n0::/\n")
    cg = cgroup_memory(str(tmp_path / "cg"), proc)
    assert cg == CgroupMemory("/slurm", 8 * GiB, 7 * GiB, 1) and cg.headroom == GiB
    _v1_level(
        mem / "slurm", 8 * GiB, 1 * GiB
    )  # now the job's own limit binds, less its inactive page cache
    cg = cgroup_memory(str(tmp_path / "cg"), proc)
    assert cg == CgroupMemory("/slurm/job_1", 6 * GiB, int(1.5 * GiB), 1) and cg.headroom == int(
        4.5 * GiB
    )


def test_v1_unlimited_and_no_memory_controller(tmp_path):
    mem = tmp_path / "cg" / "memory"
    _v1_level(mem, V1_NONE, 10 * GiB)
    _v1_level(mem / "a" / "b", V1_NONE, GiB)
    _v1_level(mem / "a", V1_NONE, GiB)
    assert cgroup_memory(str(tmp_path / "cg"), _proc(tmp_path, "4:memory:/a/b\n")) is None
    assert (
        cgroup_memory(str(tmp_path / "cg"), _proc(tmp_path, "1:cpu:/a/b\n")) is None
    )  # no memory hierarchy
    assert cgroup_memory(str(tmp_path / "cg"), str(tmp_path / "missing")) is None


def test_v1_container_view(tmp_path):
    """Docker without a cgroup namespace: /proc/self/cgroup names /docker/<id>, but the mount's root
    is that
    cgroup (its limit is on the root's files)."""
    mem = tmp_path / "cg" / "memory"
    _v1_level(mem, 2 * GiB, GiB // 4)
    cg = cgroup_memory(str(tmp_path / "cg"), _proc(tmp_path, "9:memory:/docker/0123abcd\n"))
    assert cg == CgroupMemory("/", 2 * GiB, GiB // 4, 1)


def test_v2_nested_max_and_hybrid(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    _v2_level(root, None, 20 * GiB)
    _v2_level(root / "kubepods", 12 * GiB, 3 * GiB)
    _v2_level(root / "kubepods" / "pod1", "max", 2 * GiB)
    _v2_level(
        root / "kubepods" / "pod1" / "ctr", 4 * GiB, 2 * GiB, inactive=GiB
    )  # 3 GiB left: binds
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert cgroup_memory(str(root), proc) == CgroupMemory("/kubepods/pod1/ctr", 4 * GiB, GiB, 2)
    _v2_level(root / "kubepods" / "pod1" / "ctr", "max", 2 * GiB)
    assert cgroup_memory(str(root), proc) == CgroupMemory("/kubepods", 12 * GiB, 3 * GiB, 2)
    # a hybrid host: v1 hierarchies without memory, v2 mounted at <root>/unified
    hybrid = tmp_path / "hy"
    (hybrid / "cpu").mkdir(parents=True)
    (hybrid / "unified").mkdir()
    (hybrid / "unified" / "cgroup.controllers").write_text("memory\n")
    _v2_level(hybrid / "unified" / "job", 3 * GiB, GiB)
    assert cgroup_memory(str(hybrid), _proc(tmp_path, "3:cpu:/job\n0::/job\n")) == CgroupMemory(
        "/job", 3 * GiB, GiB, 2
    )


def test_budget_names_the_binding_limit():
    machine = HostLimits(available=20 * GiB, total=24 * GiB, cgroup=None)
    auto = host_budget("auto", limits=machine)
    assert auto == HostBudget(
        int(20 * GiB - 0.05 * 24 * GiB), "MemAvailable 20.00 GiB - 5% of MemTotal 24.00 GiB"
    )
    cg = CgroupMemory("/slurm/job_1", 6 * GiB, GiB, 1)
    limited = HostLimits(20 * GiB, 24 * GiB, cg)
    got = host_budget(None, limits=limited)
    assert got.bytes == int(5 * GiB - 0.05 * 6 * GiB)
    assert (
        got.source == "memory cgroup /slurm/job_1 limit 6.00 GiB - 1.00 GiB used - 5% of the limit"
    )
    freed = host_budget("auto", freed_bytes=GiB, limits=limited)
    assert freed.bytes == got.bytes + GiB and "1.00 GiB used + 1.00 GiB freed" in freed.source
    # a set budget is used as given (MemAvailable does not cut it), unless the cgroup cannot hold it
    assert host_budget(30, limits=machine) == HostBudget(
        30 * GiB, "megatrain.host_memory_budget 30 GiB"
    )
    assert host_budget(2.5, limits=limited) == HostBudget(
        int(2.5 * GiB), "megatrain.host_memory_budget 2.5 GiB"
    )
    cut = host_budget(8, limits=limited)
    assert cut.bytes == got.bytes and cut.source.endswith(
        "(below megatrain.host_memory_budget 8 GiB)"
    )
    # a cgroup with more room than the machine: MemAvailable binds
    roomy = HostLimits(4 * GiB, 24 * GiB, CgroupMemory("/big", 100 * GiB, GiB, 2))
    assert host_budget("auto", limits=roomy).source.startswith("MemAvailable")
    full = HostLimits(4 * GiB, 24 * GiB, CgroupMemory("/full", 2 * GiB, 3 * GiB, 2))
    assert host_budget("auto", limits=full).bytes == 0
    for bad in (0, -1, True, "lots"):
        with pytest.raises(plan.ConfigError, match="host_memory_budget"):
            host_budget(bad, limits=machine)


def test_pinning_limits_say_which_and_by_how_much():
    cg = CgroupMemory("/slurm/job_1", 6 * GiB, 5 * GiB, 1)
    out = pinning_limits(3 * GiB, 2 * GiB, memlock=4 * GiB, cgroup=cg, available=GiB)
    assert out == [
        "RLIMIT_MEMLOCK (ulimit -l) 4.00 GiB: 3.00 GiB page-locked + 2.00 GiB asked exceeds it by "
        "1.00 GiB "
        "(cudaHostRegister is not charged to it by NVIDIA's driver; mlock is)",
        "memory cgroup /slurm/job_1 limit 6.00 GiB - 5.00 GiB used leaves 1.00 GiB: short by 1.00 "
        "GiB",
        "MemAvailable 1.00 GiB: short by 1.00 GiB",
    ]
    assert pinning_limits(0, GiB, memlock=None, cgroup=None, available=2 * GiB) == []
    assert (
        "mlock is"
        not in pinning_limits(
            0, 2 * GiB, memlock=GiB, cgroup=None, available=None, memlock_counts=True
        )[0]
    )
    message = pin_failure_message(2 * GiB, 3 * GiB, 2, limits=out[:1])
    assert message.startswith(
        "cudaHostRegister of 2.00 GiB failed (CUDA error 2) with 3.00 GiB page-locked by this "
        "process already; limits: RLIMIT_MEMLOCK (ulimit -l) 4.00 GiB"
    )
    assert "limits: " in pin_failure_message(GiB, 0, 2)  # read from this machine: each limit named


def _tiny_layouts():
    model = tiny_hf("llama")
    _, layers = plan.find_block_list(model)
    group_of = {id(p): 0 for p in model.parameters()}
    layouts = [plan.build_layout(i, layer, group_of) for i, layer in enumerate(layers)]
    layer_ids = {id(p) for layer in layers for p in layer.parameters()}
    return layouts, [p for p in model.parameters() if id(p) not in layer_ids]


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0},
}


def test_capacity_refusal_names_the_cgroup(monkeypatch):
    layouts, resident = _tiny_layouts()
    config = plan.load_train_config(CONFIG)
    tight = HostLimits(20 * GiB, 24 * GiB, CgroupMemory("/slurm/job_7", 2**20, 2**19, 1))
    monkeypatch.setattr(host_bytes, "read_host_limits", lambda *a, **k: tight)
    with pytest.raises(plan.CapacityError) as err:
        plan.check_capacity(layouts, resident, config, "cpu")
    message = str(err.value)
    assert (
        "budget 460.80 KiB (memory cgroup /slurm/job_7 limit 1.00 MiB - 512.00 KiB used - 5% of "
        "the limit)" in message
    )
    assert "ask the scheduler for more memory" in message
    assert "budget: memory cgroup /slurm/job_7" in message  # the table's host RAM line
    roomy = HostLimits(20 * GiB, 24 * GiB, None)
    monkeypatch.setattr(host_bytes, "read_host_limits", lambda *a, **k: roomy)
    pred = plan.check_capacity(layouts, resident, config, "cpu")
    assert pred.fits and pred.host_budget_source.startswith("MemAvailable 20.00 GiB")


def test_cuda_plan_notes_memlock(monkeypatch):
    layouts, resident = _tiny_layouts()
    config = plan.load_train_config(CONFIG)
    monkeypatch.setattr(
        host_bytes, "read_host_limits", lambda *a, **k: HostLimits(20 * GiB, 24 * GiB, None)
    )
    monkeypatch.setattr(capacity_count, "memlock_limit", lambda: 1024)
    pred = plan.check_capacity(layouts, resident, config, "cuda", gpu_memory=80 * GiB)
    notes = [n for n in pred.notes if "RLIMIT_MEMLOCK" in n]
    assert len(notes) == 1 and notes[0].startswith("page-locked host buffers about ")
    assert "exceeds it by" in notes[0] and "not charged to it" in notes[0]
    monkeypatch.setattr(capacity_count, "memlock_limit", lambda: None)
    assert not any(
        "RLIMIT_MEMLOCK" in n
        for n in plan.check_capacity(layouts, resident, config, "cuda", gpu_memory=80 * GiB).notes
    )


def test_this_machine_reads():
    """The real files: MemAvailable <= MemTotal; a cgroup, if limited, has a positive limit."""
    available, total = host_limits.meminfo()
    assert 0 < available <= total
    cg = cgroup_memory()
    assert cg is None or (cg.limit > 0 and cg.path.startswith("/"))
