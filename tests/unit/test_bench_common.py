"""The harness's one-process world (benchmarks/common.py set_single_process_env): its store binds
the port the OS gives it at bind time, so no port chosen earlier can be taken in between (the
EADDRINUSE a suite run saw in ZeRO-3's child, 2026-11-29)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import socket, sys
    import torch, torch.distributed as dist
    from benchmarks.common import set_single_process_env

    set_single_process_env()
    print("port", __import__("os").environ["MASTER_PORT"])
    init = sys.argv[1]
    if init == "env":
        dist.init_process_group("gloo")
    else:  # ColossalAI's launch_from_torch builds this address from MASTER_ADDR and MASTER_PORT
        import os
        address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    print("sum", float(t.sum()), "world", dist.get_world_size())
    dist.destroy_process_group()
    """
)


def _run(init: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    clean.update(env, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, init],
        env=clean,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_one_process_world_binds_the_port_the_os_gives_at_bind_time():
    for init in ("env", "tcp"):
        out = _run(init)
        assert "port 0" in out and "sum 3.0 world 1" in out, out


def test_a_master_port_the_caller_set_is_kept(monkeypatch):
    from benchmarks.common import free_port, set_single_process_env

    # a copy: the function also sets RANK, WORLD_SIZE, ..., which must not leak into other tests
    monkeypatch.setattr(os, "environ", {**os.environ, "MASTER_PORT": "29123"})
    set_single_process_env()
    assert os.environ["MASTER_PORT"] == "29123"
    del os.environ["MASTER_PORT"]
    set_single_process_env()
    assert os.environ["MASTER_PORT"] == "0"
    assert 0 < free_port() < 65536


def test_pack_out_leaves_one_archive_holding_every_result(tmp_path):
    """benchmarks/pack_out.sh: a device command's results beyond what the device returns (8 files,
    2 folders down) leave as one results.tgz with every file and its path; nothing else remains."""
    import tarfile

    files = {f"call/depth_{i}/run_L{i}.json": f'{{"layers": {i}}}' for i in range(9)}
    files["call/a/b/c/deep.log"] = "deep"
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "pack_out.sh")
    done = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "10 files" in done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["results.tgz"]
    with tarfile.open(tmp_path / "results.tgz") as tar:
        got = {
            m.name.removeprefix("./"): tar.extractfile(m).read().decode() for m in tar if m.isfile()
        }
    assert got == files


def test_the_allocator_record_says_where_reserved_memory_is_not_allocated(monkeypatch):
    """The 24 GiB runs budget from the reserved peak, 3.5 GiB over the allocated one at 7B: the
    record sums torch's snapshot segments by stream and pool, keeps the peaks and the retries, and
    the line names the streams whose reserved memory is not allocated."""
    from benchmarks import common

    gib = 2**30
    stats = {
        "allocated_bytes.all.peak": 16 * gib,
        "reserved_bytes.all.peak": 20 * gib,
        "inactive_split_bytes.all.peak": gib,
        "num_alloc_retries": 3,
        "num_ooms": 0,
    }
    segments = [  # the fields of torch.cuda.memory_snapshot()'s segments the record reads
        {"stream": 0, "segment_type": "large", "total_size": 4 * gib, "allocated_size": 4 * gib},
        {"stream": 77, "segment_type": "large", "total_size": 3 * gib, "allocated_size": gib},
        {"stream": 77, "segment_type": "large", "total_size": 2 * gib, "allocated_size": 0},
        {"stream": 99, "segment_type": "small", "total_size": 2 * 2**20, "allocated_size": 0},
    ]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    rec = common.summarize_allocator(stats, segments, {77: "compute"})
    assert rec["allocated_peak"] == 16 * gib and rec["reserved_peak"] == 20 * gib
    assert rec["alloc_retries"] == 3 and rec["ooms"] == 0 and rec["expandable_segments"]
    by = rec["reserved_now_by_stream"]
    assert by["compute large"] == {"segments": 2, "reserved": 5 * gib, "allocated": gib}
    assert by["default large"]["reserved"] == 4 * gib and "0x63 small" in by
    line = common.allocator_line({"system": "megatrain", "settings": {"allocator": rec}})
    assert "allocated peak 16.00 GiB, reserved peak 20.00 GiB, retries 3" in line
    assert "expandable segments on" in line and "compute large 4.00" in line
    assert "default large" not in line  # all of it allocated
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert not common.expandable_segments()
    # off CUDA there is nothing to record, and nothing is printed
    assert common.allocator_record("cpu") == {}
    assert common.allocator_line({"system": "x", "settings": {"allocator": {}}}) == ""
    assert common.allocator_line({"system": "x", "allocator": rec}).startswith("    [x] allocator")


@pytest.mark.gpu
def test_gpu_the_allocator_record_names_a_side_streams_cached_memory():
    """On CUDA: memory freed on a named side stream stays reserved there, not allocated, and the
    record says so under that stream's name (torch's snapshot reports streams by handle)."""
    import torch

    from benchmarks import common

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del x  # freed: cached in a segment of the side stream's pool
    rec = common.allocator_record("cuda", {side.cuda_stream: "side"})
    row = rec["reserved_now_by_stream"]["side large"]
    assert row["reserved"] >= 64 * 2**20 and row["allocated"] < row["reserved"]
    assert rec["reserved_peak"] >= rec["allocated_peak"] >= 64 * 2**20
    assert "side large" in common.allocator_line({"system": "t", "allocator": rec})


def test_a_runs_teardown_comes_after_its_result_is_written(tmp_path, monkeypatch):
    """run_system writes the JSON before the engine's teardown (common.after_result): a 7B run's
    teardown took 5-22 s after its steps, and a phase's limit landing there lost a finished run
    (2026-11-30). The real megatrain_ds system on the CPU: its engine's destroy runs once, after
    the result file exists."""
    from benchmarks import common, run_system
    from megatrain_ds.engine import MegaTrainEngine

    path = tmp_path / "r.json"
    seen = []
    destroy = MegaTrainEngine.destroy

    def recording_destroy(engine):
        seen.append(path.exists())
        destroy(engine)

    monkeypatch.setattr(MegaTrainEngine, "destroy", recording_destroy)
    monkeypatch.setattr(common, "DEFER_TEARDOWN", common.DEFER_TEARDOWN)  # main sets it
    monkeypatch.delenv("MEGATRAIN_OPTIONS", raising=False)
    args = ["--system", "megatrain", "--model", "tiny", "--device", "cpu", "--seq", "64"]
    args += ["--tokens-per-step", "128", "--steps", "1", "--warmup", "1", "--json", str(path)]
    assert run_system.main(args) == 0
    assert seen == [True]  # destroyed once, with the result already on disk
    assert json.loads(path.read_text())["status"] == "ok"
    assert common.release_after_result() == 0  # nothing left behind


def test_without_deferral_a_teardown_runs_at_once_and_with_it_holds_the_objects(monkeypatch):
    """Outside run_system (a test calling a system in its own process) after_result runs the
    teardown where the system asks; deferred, the objects a list holds live until the release."""
    import gc
    import weakref

    from benchmarks import common

    class Big:
        pass

    ran = []
    monkeypatch.setattr(common, "DEFER_TEARDOWN", False)
    common.after_result(lambda: ran.append(1))
    assert ran == [1]
    monkeypatch.setattr(common, "DEFER_TEARDOWN", True)
    obj = Big()
    ref = weakref.ref(obj)
    common.after_result([obj].clear)
    common.after_result(lambda: ran.append(2))
    del obj
    gc.collect()
    assert ref() is not None and ran == [1]
    assert common.release_after_result() == 2
    assert ref() is None and ran == [1, 2]


def test_the_run_line_says_how_much_host_memory_was_in_huge_pages():
    """The harness's line for a run reads the last phase's transparent huge pages (a host update
    1.34x slower on one machine after two large peers had no recorded cause, 2026-11-30); a
    record from before the field prints as before."""
    from benchmarks.report import report_line

    res = {
        "system": "megatrain",
        "layers": 28,
        "tokens_per_step": 8192,
        "tokens_per_s": 4404.0,
        "tflops": 189.5,
        "peak_gpu_bytes": 19.3e9,
        "peak_host_rss_bytes": 114.8e9,
        "status": "ok",
        "phases": [{"phase": "steps done", "anon_huge_bytes": 96.5e9}],
    }
    assert "host 114.8 GB (96.5 in huge pages)" in report_line(res)
    res["phases"] = [{"phase": "steps done"}]
    assert "huge pages" not in report_line(res) and "host 114.8 GB" in report_line(res)
