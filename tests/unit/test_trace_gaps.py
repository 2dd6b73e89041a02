"""benchmarks.trace_gaps: the compute stream's idle gaps and the host ranges that overlap them."""

from benchmarks.trace_gaps import _compress, compute_gaps, gaps_table


def _k(tid, ts, dur, name="gemm"):
    return {"ph": "X", "cat": "kernel", "tid": tid, "ts": ts, "dur": dur, "name": name}


def _r(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "tid": 1, "ts": ts, "dur": dur, "name": name}


def test_gaps_of_the_busiest_stream_with_overlapping_ranges():
    events = [
        _k(7, 0, 100),
        _k(7, 100, 50),
        _k(7, 3150, 100, "embedding"),
        _k(7, 3250, 10),
        _k(9, 0, 40),  # a copy stream with less kernel time: not the compute stream
        _r("megatrain.wait_resident_update", 200, 2900),
        _r("megatrain.adamw.L3", 1000, 500),
        _r("megatrain.adamw.L4", 1600, 500),
        _r("megatrain.fwd.L0", 3200, 100),
        _r("aten::mm", 400, 10),
    ]
    gaps, totals = compute_gaps(events, min_gap_us=1000)
    assert len(gaps) == 1
    g = gaps[0]
    assert (g["start_us"], g["dur_us"], g["next_kernel"]) == (150, 3000, "embedding")
    assert g["host_ranges"] == [
        "megatrain.adamw.L3",
        "megatrain.adamw.L4",
        "megatrain.wait_resident_update",
    ]
    assert totals["window_us"] == 3260 and totals["busy_us"] == 260 and totals["idle_us"] == 3000
    table = gaps_table(gaps, totals)
    assert "| 0.1 | 3.00 | embedding | adamw.L3-4, wait_resident_update |" in table


def test_compress_groups_layers_per_phase():
    assert _compress(
        ["megatrain.h2d.L1", "megatrain.h2d.L2", "megatrain.norm", "megatrain.h2d.L5"]
    ) == ["h2d.L1-5", "norm"]


def test_timeline_gaps_name_what_each_thread_was_doing():
    from benchmarks.trace_gaps import timeline_gaps

    rows = [
        (0.000, 0.010, "gpu-compute", "compute"),
        (0.010, 0.020, "gpu-compute", "compute"),
        (0.050, 0.060, "gpu-compute", "compute"),
        (0.012, 0.045, "megatrain-adamw_0", "megatrain.adamw.L0"),
        (0.030, 0.048, "MainThread", "megatrain.wait_norm"),
        (0.001, 0.005, "megatrain-host_0", "megatrain.land.L3"),
    ]  # before the gap: not listed
    gaps = timeline_gaps(rows, min_gap_s=0.005)
    assert (
        len(gaps) == 1
        and abs(gaps[0]["start_s"] - 0.020) < 1e-12
        and abs(gaps[0]["dur_s"] - 0.030) < 1e-12
    )
    assert gaps[0]["threads"] == {"MainThread": "wait_norm", "megatrain-adamw_0": "adamw.L0"}


def test_traced_ranges_are_recorded_from_every_thread_only_while_a_timeline_is_on():
    import threading

    from megatrain_ds.streaming.timing import start_timeline, take_timeline, traced

    with traced("megatrain.before"):
        pass
    start_timeline()
    with traced("megatrain.main"):
        pass
    t = threading.Thread(target=_in_thread, args=(traced,), name="w")
    t.start()
    t.join()
    rows = take_timeline()
    assert sorted((r[2], r[3]) for r in rows) == [
        ("MainThread", "megatrain.main"),
        ("w", "megatrain.worker"),
    ]
    assert all(r[1] >= r[0] for r in rows)
    with traced("megatrain.after"):
        pass
    assert take_timeline() == []


def _in_thread(traced):
    with traced("megatrain.worker"):
        pass


def test_the_recorded_command_names_no_machine_path():
    from argparse import Namespace

    from benchmarks.trace_gaps import _command_line

    argv = [
        "--model",
        "qwen2.5-3b",
        "--out",
        "/data/run/out/x",
        "--trace",
        "/data/run/t.json",
        "--steps",
        "3",
    ]
    assert (
        _command_line(argv, Namespace(out="/data/run/out/x", trace="/data/run/t.json"))
        == "--model qwen2.5-3b --out OUT --trace TRACE --steps 3"
    )
