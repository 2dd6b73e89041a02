"""The harness's Gemini peer under ``--gpu-memory-limit`` (benchmarks/gemini_system.py), on the
CPU: Gemini's "auto" placement plans from the device's total memory times ColossalAI's own
fraction, not from what is free, so the limit is handed to it as that fraction."""

from __future__ import annotations

import pytest

from benchmarks import gemini_system

GiB = 2**30


def test_gemini_is_told_the_limit_as_its_own_capacity_fraction():
    calls = []
    said = gemini_system.cap_gemini_capacity(24 * GiB, 140 * GiB, calls.append)
    assert calls == [pytest.approx(24 / 140)]
    assert (
        said.startswith("colo_set_process_memory_fraction(0.1714)") and "24.0 GiB of 140.0" in said
    )
    # a limit above the card is the whole card, never a fraction over 1
    calls.clear()
    gemini_system.cap_gemini_capacity(200 * GiB, 140 * GiB, calls.append)
    assert calls == [1.0]
    # no limit: Gemini's own capacity is left alone
    calls.clear()
    assert gemini_system.cap_gemini_capacity(None, 140 * GiB, calls.append) is None
    assert calls == []
    with pytest.raises(ValueError, match="total memory"):
        gemini_system.cap_gemini_capacity(24 * GiB, 0, calls.append)
