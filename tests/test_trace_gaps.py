"""benchmarks.trace_gaps: the compute stream's idle gaps and the host ranges that overlap them."""
from benchmarks.trace_gaps import _compress, compute_gaps, gaps_table


def _k(tid, ts, dur, name="gemm"):
    return {"ph": "X", "cat": "kernel", "tid": tid, "ts": ts, "dur": dur, "name": name}


def _r(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "tid": 1, "ts": ts, "dur": dur, "name": name}


def test_gaps_of_the_busiest_stream_with_overlapping_ranges():
    events = [_k(7, 0, 100), _k(7, 100, 50), _k(7, 3150, 100, "embedding"), _k(7, 3250, 10),
              _k(9, 0, 40),  # a copy stream with less kernel time: not the compute stream
              _r("megatrain.wait_resident_update", 200, 2900), _r("megatrain.adamw.L3", 1000, 500),
              _r("megatrain.adamw.L4", 1600, 500), _r("megatrain.fwd.L0", 3200, 100), _r("aten::mm", 400, 10)]
    gaps, totals = compute_gaps(events, min_gap_us=1000)
    assert len(gaps) == 1
    g = gaps[0]
    assert (g["start_us"], g["dur_us"], g["next_kernel"]) == (150, 3000, "embedding")
    assert g["host_ranges"] == ["megatrain.adamw.L3", "megatrain.adamw.L4", "megatrain.wait_resident_update"]
    assert totals["window_us"] == 3260 and totals["busy_us"] == 260 and totals["idle_us"] == 3000
    table = gaps_table(gaps, totals)
    assert "| 0.1 | 3.00 | embedding | adamw.L3-4, wait_resident_update |" in table


def test_compress_groups_layers_per_phase():
    assert _compress(["megatrain.h2d.L1", "megatrain.h2d.L2", "megatrain.norm", "megatrain.h2d.L5"]) == \
        ["h2d.L1-5", "norm"]
