"""megatrain_ds.host.placement: topology from a fake sysfs, the plan's choices, the config parse,
applying it to a real worker thread, and the host_adam placement sweep on tiny parameters."""

import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatrain_ds.host import placement as pl


def _fake_sysfs(
    root, nodes: dict[int, str], siblings: dict[int, str] | None = None, pci: dict | None = None
):
    for n, cpulist in nodes.items():
        d = root / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for cpu, sib in (siblings or {}).items():
        d = root / "devices/system/cpu" / f"cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    for bus, (node, vendor, klass) in (pci or {}).items():
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")
    return str(root)


def _two_socket_smt(tmp_path):
    """2 nodes x 4 cores x 2 SMT: node0 = 0-3,8-11, node1 = 4-7,12-15; cpu c's sibling is c+8."""
    sib = {c: f"{c % 8},{c % 8 + 8}" for c in range(16)}
    return _fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, sib)


def test_parse_cpulist():
    assert pl.parse_cpulist("0-3,8-11") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert pl.parse_cpulist("5") == [5]
    assert pl.parse_cpulist("") == []
    assert pl.parse_cpulist("0-6:2") == [0, 2, 4, 6]


def test_topology_from_fake_sysfs(tmp_path):
    root = _two_socket_smt(tmp_path)
    topo = pl.host_topology(root, usable=list(range(16)))
    assert topo["cpus"] == list(range(16))
    assert topo["nodes"] == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert topo["siblings"][3] == (3, 11) and topo["siblings"][11] == (3, 11)
    assert topo["smt"]


def test_topology_restricted_affinity_and_no_sysfs(tmp_path):
    root = _two_socket_smt(tmp_path)
    # a container's cpuset: node 0 gone, 13 not ours
    topo = pl.host_topology(root, usable=[4, 5, 12])
    assert topo["nodes"] == {1: [4, 5, 12]}
    assert topo["siblings"][4] == (4, 12) and topo["siblings"][5] == (5,)
    bare = pl.host_topology(str(tmp_path / "nothing"), usable=[0, 1, 2])
    assert bare["nodes"] == {0: [0, 1, 2]} and not bare["smt"]
    assert bare["siblings"] == {0: (0,), 1: (1,), 2: (2,)}


def test_plan_prefers_gpu_node_skips_smt_and_reserves_main(tmp_path):
    topo = pl.host_topology(_two_socket_smt(tmp_path), usable=list(range(16)))
    p = pl.plan_placement(topo, gpu_numa_node=1)
    assert p.numa_node == 1 and p.main_cores == (4,)
    # node 1's physical cores but the main's; no 12-15
    assert p.cores == (5, 6, 7) and p.threads == 3
    assert not p.shared_with_main
    p0 = pl.plan_placement(topo, gpu_numa_node=0, reserve_main=2)
    assert p0.main_cores == (0, 1) and p0.cores == (2, 3) and p0.threads == 2
    none = pl.plan_placement(topo, gpu_numa_node=0, reserve_main=0)
    assert none.main_cores == () and none.cores == (0, 1, 2, 3)


def test_plan_unknown_gpu_node_takes_the_largest(tmp_path):
    topo = pl.host_topology(_two_socket_smt(tmp_path), usable=[0, 1, 4, 5, 6, 7])
    for node in (None, 3):  # unknown, or a node we may not run on
        p = pl.plan_placement(topo, gpu_numa_node=node)
        assert p.numa_node == 1 and p.main_cores == (4,) and p.cores == (5, 6, 7)


def test_plan_explicit_threads_spill_order(tmp_path):
    topo = pl.host_topology(_two_socket_smt(tmp_path), usable=list(range(16)))
    p = pl.plan_placement(topo, 0, threads=5)  # node 0 physical (1-3), then node 1 physical
    assert p.cores == (1, 2, 3, 4, 5) and p.threads == 5
    # all 7 other physical cores, then SMT siblings (not 8: main's)
    p = pl.plan_placement(topo, 0, threads=9)
    assert p.cores == (1, 2, 3, 4, 5, 6, 7, 9, 10)
    p = pl.plan_placement(topo, 0, threads=40)
    assert (
        p.threads == 40 and len(p.cores) == 15 and 0 not in p.cores and "oversubscribed" in p.reason
    )


def test_plan_one_core_and_two_cpu_boxes(tmp_path):
    one = pl.host_topology(str(tmp_path / "none"), usable=[0])
    p = pl.plan_placement(one, None)
    assert p.threads == 1 and p.cores == (0,) and p.main_cores == (0,) and p.shared_with_main
    smt_pair = pl.host_topology(
        _fake_sysfs(tmp_path / "s", {0: "0-1"}, {0: "0-1", 1: "0-1"}), usable=[0, 1]
    )
    # one physical core: the optimizer gets the main's sibling, not its cpu
    p = pl.plan_placement(smt_pair, 0)
    assert p.main_cores == (0,) and p.cores == (1,) and not p.shared_with_main
    two = pl.host_topology(str(tmp_path / "none"), usable=[0, 1])
    p = pl.plan_placement(two, None)
    assert p.main_cores == (0,) and p.cores == (1,) and p.threads == 1


def test_gpu_numa_node_from_sysfs(tmp_path):
    root = _fake_sysfs(
        tmp_path,
        {0: "0-1"},
        pci={"0000:3b:00.0": (1, "0x10de", "0x030200"), "0000:00:1f.0": (0, "0x8086", "0x060100")},
    )
    assert pl._node_of("00000000:3B:00.0", root) == 1  # NVML/CUDA spelling
    assert pl._node_of("3b:00.0", root) == 1
    assert pl._node_of("0000:99:00.0", root) is None
    if not torch.cuda.is_available():  # no device properties: every NVIDIA device is on node 1
        assert pl.gpu_numa_node(0, root) == 1
        (tmp_path / "bus/pci/devices/0000:3b:00.0/numa_node").write_text("-1\n")
        assert pl.gpu_numa_node(0, root) is None


def test_resolve_settings():
    topo = pl.host_topology("/nonexistent", usable=[0, 1, 2, 3])
    assert pl.resolve("off", topology=topo) is None
    auto = pl.resolve("auto", topology=topo)
    assert auto.main_cores == (0,) and auto.cores == (1, 2, 3)
    assert pl.resolve(None, topology=topo) == auto
    assert pl.resolve(2, topology=topo).threads == 2
    assert pl.resolve("3", topology=topo).cores == (1, 2, 3)
    for bad in ("fast", 0, -2, 1.5, True, [2], "2.5"):
        with pytest.raises(ValueError, match="megatrain.host_threads"):
            pl.resolve(bad, topology=topo)


def test_resolve_warns_and_continues_on_unreadable_topology():
    pl._warned.discard("plan")
    with pytest.warns(RuntimeWarning, match="megatrain.host_threads"):
        assert pl.resolve("auto", topology={"nodes": {}}) is None


def test_apply_placement_changes_the_worker_not_the_main_thread():
    before = os.sched_getaffinity(0)
    threads_before = torch.get_num_threads()
    target = sorted(before)[-1:]
    plan = pl.Placement(
        threads=1,
        cores=tuple(target),
        main_cores=(),
        numa_node=None,
        shared_with_main=False,
        reason="test",
    )
    worker = ThreadPoolExecutor(1, initializer=pl.apply_placement, initargs=(plan,))
    try:

        def probe():
            # a parallel op: the worker's OpenMP team (if any) starts here
            torch.randn(200_000).mul_(2.0)
            return threading.get_native_id(), os.sched_getaffinity(0), torch.get_num_threads()

        tid, affinity, n = worker.submit(probe).result()
        assert affinity == set(target) and n == 1
        assert os.sched_getaffinity(tid) == set(target)
        assert os.sched_getaffinity(0) == before  # the main thread is untouched
        assert torch.get_num_threads() == threads_before
    finally:
        worker.shutdown()
        torch.set_num_threads(threads_before)  # set_num_threads also sets the process-wide default


def test_pin_main_thread_returns_the_previous_mask():
    before = os.sched_getaffinity(0)
    plan = pl.Placement(
        threads=1,
        cores=(),
        main_cores=(min(before),),
        numa_node=None,
        shared_with_main=False,
        reason="test",
    )
    previous = pl.pin_main_thread(plan)
    try:
        assert previous == before and os.sched_getaffinity(0) == {min(before)}
    finally:
        os.sched_setaffinity(0, before)
    assert pl.pin_main_thread(None) is None


def test_apply_placement_warns_once_when_forbidden():
    pl._warned.discard("affinity")
    threads_before = torch.get_num_threads()
    bad = pl.Placement(
        threads=threads_before,
        cores=(10_000,),
        main_cores=(),
        numa_node=None,
        shared_with_main=False,
        reason="test",
    )
    result = {}

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["first"] = pl.apply_placement(bad)
            result["second"] = pl.apply_placement(bad)
        result["warnings"] = [str(w.message) for w in caught]

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert result["first"] is False and result["second"] is False
    assert len(result["warnings"]) == 1 and "megatrain.host_threads" in result["warnings"][0]
    assert pl.apply_placement(None) is False


def test_host_adam_sweep_prints_the_table(capsys):
    from benchmarks import host_adam

    threads_before = torch.get_num_threads()
    before = os.sched_getaffinity(0)
    assert host_adam.main(["--sweep", "--params", "2e6", "--runs", "2", "--threads", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "| threads | pinned | worker cores | main thread |" in out and "p99 µs" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 1 + 2 * 2 * 2  # main-alone baseline + threads x pinned x idle/busy
    assert rows[0].startswith("| none (main alone) |")
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads_before


def test_openmp_threads_inherit_the_worker_mask():
    """The finding in docs/placement.md: the worker's OpenMP team is created by its first parallel
    op, with the worker's mask; threads that existed before (the main thread's own) keep theirs."""
    cpus = sorted(os.sched_getaffinity(0))
    threads_before = torch.get_num_threads()
    before = pl.task_affinities()
    plan = pl.Placement(
        threads=2,
        cores=(cpus[-1],),
        main_cores=(),
        numa_node=None,
        shared_with_main=False,
        reason="test",
    )  # 2 threads on one cpu: the team exists even on a 1-cpu box
    worker = ThreadPoolExecutor(1, initializer=pl.apply_placement, initargs=(plan,))
    try:
        tid = worker.submit(threading.get_native_id).result()
        # large enough to run in parallel
        worker.submit(lambda: torch.randn(1_000_000).mul_(2.0)).result()
        after = pl.task_affinities()
        new = {t: m for t, m in after.items() if t not in before}
        assert tid in new and len(new) >= 2  # the worker and at least one thread it started
        assert all(m == {cpus[-1]} for m in new.values())
        assert all(after[t] == m for t, m in before.items() if t in after)
    finally:
        worker.shutdown()
        torch.set_num_threads(threads_before)


def test_local_ranks_get_disjoint_shares_of_the_host():
    """Data parallel: two ranks whose GPUs share a NUMA node split its physical cores (SMT siblings
    follow their core); ranks on different nodes keep their node; the plans never overlap."""
    from megatrain_ds.host.placement import plan_placement, share_between_local_ranks

    # one node, 8 physical cores 0-7 with siblings 8-15
    topo = {"nodes": {0: list(range(16))}, "siblings": {c: (c % 8, c % 8 + 8) for c in range(16)}}
    shares = [share_between_local_ranks(topo, [0, 0], r)["nodes"][0] for r in (0, 1)]
    assert shares == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    plans = [plan_placement(share_between_local_ranks(topo, [0, 0], r), 0) for r in (0, 1)]
    assert [p.main_cores for p in plans] == [(0,), (4,)]
    assert [p.cores for p in plans] == [(1, 2, 3), (5, 6, 7)]
    cores = [set(p.cores) | set(p.main_cores) for p in plans]
    assert not cores[0] & cores[1]
    # two nodes, one GPU on each: each rank keeps its own node whole
    two = {"nodes": {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}, "siblings": {}}
    assert share_between_local_ranks(two, [0, 1], 1)["nodes"] == {1: [4, 5, 6, 7]}
    # unknown GPU nodes: the biggest node is split
    assert share_between_local_ranks(two, [None, None], 1)["nodes"] == {0: [2, 3]}
