"""The suite's DeepSpeed op prebuild (tests/ops_prebuild.py): a lock file a killed build left behind
is removed before the suite starts (else every load of that op waits forever: the CI hang of
2026-11-28), and a build in progress (a fresh lock) is left alone."""

import os
import time

from tests import ops_prebuild


def test_only_stale_build_locks_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(ops_prebuild, "_extensions_root", lambda: tmp_path)
    now = time.time()
    stale, fresh = tmp_path / "cpu_adam" / "lock", tmp_path / "pin_memory" / "lock"
    other = tmp_path / "x" / "build.ninja"
    for path in (stale, fresh, other):
        path.parent.mkdir()
        path.write_text("")
    os.utime(stale, (now - ops_prebuild.STALE_S - 60,) * 2)
    os.utime(other, (now - ops_prebuild.STALE_S - 60,) * 2)
    assert ops_prebuild.clear_stale_locks(now) == [stale]
    assert not stale.exists() and fresh.exists() and other.exists()


def test_no_extensions_folder_is_nothing_to_clear(tmp_path, monkeypatch):
    monkeypatch.setattr(ops_prebuild, "_extensions_root", lambda: tmp_path / "absent")
    assert ops_prebuild.clear_stale_locks() == []
    monkeypatch.setattr(ops_prebuild, "_extensions_root", lambda: None)
    assert ops_prebuild.clear_stale_locks() == []
