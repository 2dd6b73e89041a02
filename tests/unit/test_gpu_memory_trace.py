"""benchmarks/gpu_memory_trace.py's replays of a caching-allocator snapshot, on a synthetic trace
in the shape torch.cuda.memory._snapshot() gives: the live blocks at the allocated peak, and the
reserved peak with the bytes free inside each stream's segments and the allocation whose new
segment set it."""

from __future__ import annotations

import pytest

from benchmarks.gpu_memory_trace import live_at_peak, reserved_at_peak

MiB = 2**20


def frame(name: str) -> list[dict]:
    return [{"filename": "/x/megatrain_ds/streaming/executor.py", "line": 7, "name": name}]


def snapshot() -> dict:
    """Before the trace: one 100 MiB segment on stream 0 holding a 60 MiB block. The trace: a 30
    MiB block fits the segment's hole; a 50 MiB block does not (10 free) and maps a new 64 MiB
    segment; on stream 7 a 20 MiB block in a 32 MiB segment of its own; the 50 and 30 MiB blocks
    are freed and the new segment unmapped. At the end: the 100 MiB segment with its 60 MiB block,
    and stream 7's segment with its block."""
    trace = [
        {"action": "alloc", "addr": 60 * MiB, "size": 30 * MiB, "stream": 0},
        {
            "action": "segment_map",
            "addr": 500 * MiB,
            "size": 64 * MiB,
            "stream": 0,
            "frames": frame("land_gradient"),
        },
        {"action": "alloc", "addr": 500 * MiB, "size": 50 * MiB, "stream": 0},
        {
            "action": "segment_alloc",
            "addr": 900 * MiB,
            "size": 32 * MiB,
            "stream": 7,
            "frames": frame("prefetch"),
        },
        {"action": "alloc", "addr": 900 * MiB, "size": 20 * MiB, "stream": 7},
        {"action": "free_requested", "addr": 500 * MiB, "size": 50 * MiB, "stream": 0},
        {"action": "free_completed", "addr": 500 * MiB, "size": 50 * MiB, "stream": 0},
        {"action": "free_completed", "addr": 60 * MiB, "size": 30 * MiB, "stream": 0},
        {"action": "segment_unmap", "addr": 500 * MiB, "size": 64 * MiB, "stream": 0},
        {"action": "snapshot", "addr": 0, "stream": 0},  # torch's marker entries carry no size
    ]
    segments = [
        {
            "device": 0,
            "stream": 0,
            "total_size": 100 * MiB,
            "blocks": [
                {"size": 60 * MiB, "state": "active_allocated"},
                {"size": 40 * MiB, "state": "inactive"},
            ],
        },
        {
            "device": 0,
            "stream": 7,
            "total_size": 32 * MiB,
            "blocks": [
                {"size": 20 * MiB, "state": "active_allocated"},
                {"size": 12 * MiB, "state": "inactive"},
            ],
        },
    ]
    return {"device_traces": [trace], "segments": segments}


def test_the_reserved_peak_names_the_free_bytes_by_stream_and_what_set_it():
    got = reserved_at_peak(snapshot())
    # 100 + 64 + 32 reserved when stream 7's segment came; allocated then 60 + 30 + 50
    assert got["reserved_bytes"] == 196 * MiB
    assert got["allocated_bytes"] == 140 * MiB
    assert got["free_by_stream"] == {0: 24 * MiB, 7: 32 * MiB}
    assert got["set_by"]["bytes"] == 32 * MiB and got["set_by"]["stream"] == 7
    assert got["set_by"]["action"] == "segment_alloc"
    assert got["set_by"]["origin"].endswith("prefetch")


def test_a_trace_that_adds_no_segment_reports_the_state_before_it():
    snap = snapshot()
    snap["device_traces"] = [
        [e for e in snap["device_traces"][0] if "segment" not in e["action"] and e["stream"] == 0]
    ]
    snap["segments"] = snap["segments"][:1]
    got = reserved_at_peak(snap)
    assert got["set_by"] is None
    assert got["reserved_bytes"] == 100 * MiB and got["allocated_bytes"] == 60 * MiB


def test_the_allocated_peak_lists_the_live_blocks():
    peak, blocks = live_at_peak(snapshot())
    assert peak == 100 * MiB  # the trace's own allocations: 30 + 50 + 20
    assert sorted(b["size"] for b in blocks) == [20 * MiB, 30 * MiB, 50 * MiB]


@pytest.mark.gpu
def test_gpu_the_reserved_peak_replay_reads_torchs_own_snapshot():
    """On CUDA, torch's own snapshot (the keys and states the synthetic one above assumes): a block
    on the default stream, then one on a new side stream, whose fresh segment sets the reserved
    peak while the first block is still allocated and the second not yet."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            b = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    got = reserved_at_peak(snap, device=torch.cuda.current_device())
    assert got["set_by"] is not None and got["set_by"]["stream"] == side.cuda_stream, got
    assert got["set_by"]["bytes"] >= 96 * MiB
    assert got["allocated_bytes"] == allocated0 + 64 * MiB, got
    assert got["reserved_bytes"] >= reserved0 + 160 * MiB, got
    assert got["free_by_stream"][side.cuda_stream] >= 96 * MiB, got
    del a, b
