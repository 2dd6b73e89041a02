"""benchmarks/phase_lib.sh, the device phases' runner: each h2h call's results.json is kept under
the phase's name and the call's tag, and an alternation that repeats a tag keeps every run."""

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Stands in for `python3 -m benchmarks.h2h ... --out DIR`: writes DIR/results.json naming the run
# (its order in the command and its last argument), as h2h's own does.
FAKE_PYTHON = """#!/usr/bin/env bash
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out=$a; prev=$a; done
n=$(( $(cat "$COUNTER" 2>/dev/null || echo 0) + 1 )); echo $n > "$COUNTER"
mkdir -p "$out"
printf '{"results": [{"run": %d, "variant": "%s"}]}' "$n" "${@: -1}" > "$out/results.json"
echo "fake h2h run $n"
"""


def test_a_repeated_tag_keeps_every_runs_results(tmp_path):
    """2026-11-30: an alternation (tight, cache, cache, tight) wrote each tag's JSON twice and kept
    only the second; the first runs survived in the log alone."""
    root = tmp_path / "tree"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "phase_lib.sh", root / "benchmarks" / "phase_lib.sh")
    (root / "benchmarks" / "device_setup.sh").write_text("")  # no wheels, no GPU here
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    script = (
        "model=tiny phase=alt out=$OUT; source benchmarks/phase_lib.sh\n"
        "for v in a b b a a; do h2h_call 30 $v --x $v; done\n"
    )
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out))
    env["COUNTER"] = str(tmp_path / "counter")
    proc = subprocess.run(
        ["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    runs = {p.name: json.loads(p.read_text())["results"][0] for p in sorted(out.glob("alt_*.json"))}
    assert runs == {
        "alt_a.json": {"run": 1, "variant": "a"},
        "alt_b.json": {"run": 2, "variant": "b"},
        "alt_b_run2.json": {"run": 3, "variant": "b"},
        "alt_a_run2.json": {"run": 4, "variant": "a"},
        "alt_a_run3.json": {"run": 5, "variant": "a"},
    }
    log = (out / "alt.log").read_text()
    assert log.count("== a: h2h --model tiny --x a") == 3 and "fake h2h run 5" in log
