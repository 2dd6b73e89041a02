"""The drift tests under another set of dependency versions: ``make canary`` (the newest published
transformers, accelerate, peft and DeepSpeed) and ``make oldest`` (the oldest pyproject.toml
declares). CI runs both after ``make test``; a failure fails CI, and the log names each package
whose version differs from the tested set.

    python -m tests.drift canary|oldest [pytest args...]

The drift tests are the ones whose correctness rests on the internals of those packages: every
script path against plain PyTorch (test_paths), every model family (test_families), kept layers
(test_keep), the recompute self-check (test_recompute_check), the recompute's skipped output
projection, whose eligibility is read from the layers' source (test_recompute_skip), the version
table (test_versions), TRL's published scripts against real DeepSpeed (test_trl: the canary
upgrades TRL too; ``make oldest`` installs no TRL, so they skip there, docs/trl.md says why), and
DeepSpeed's multi-node runner exporting MEGATRAIN_DS to every host (test_pdsh_exports,
compat/launcher_env.py: a stand-in pdsh, no services; under tests/system, so it runs as root only,
as CI runs).
"""

from __future__ import annotations

import subprocess
import sys

DRIFT_TESTS = [
    "tests/engine/test_paths.py",
    "tests/engine/test_families.py",
    "tests/engine/test_keep.py",
    "tests/engine/test_recompute_check.py",
    # the recompute's skipped down_proj: eligibility read from transformers' layer source
    "tests/engine/test_recompute_skip.py",
    "tests/unit/test_versions.py",
    # DeepSpeed's checkpoint layout, which the way back writes
    "tests/integration/test_wayback.py",
    # TRL's scripts: its patched forward, its ZeRO-3 generation hooks (skipped: oldest)
    "tests/integration/test_trl.py",
    # the runner's exports carry the switch to every host (root only)
    "tests/system/test_pdsh_exports.py",
]


def main(argv: list[str]) -> int:
    from megatrain_ds import versions

    kind, extra = (argv[0] if argv else "canary"), argv[1:]
    print(f"== drift tests ({kind}): installed versions ==", flush=True)
    versions.main()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", *DRIFT_TESTS, *extra])
    differing = [
        f"{p} {versions.installed(p)} ({versions.status(p, versions.installed(p))}; tested "
        f"{lo}..{hi})"
        for p, (lo, hi) in versions.TESTED.items()
        if versions.installed(p) not in (None, hi)
        and versions.status(p, versions.installed(p)) != "tested"
    ]
    versions_line = ", ".join(f"{p} {versions.installed(p)}" for p in (*versions.TESTED, "trl"))
    if rc != 0:
        print(f"\nDRIFT ({kind}) FAILED (pytest exit {rc}) with {versions_line}.", flush=True)
        if differing:
            print(
                "Outside the tested range, so the likely cause: "
                + "; ".join(differing)
                + ". Read the failing "
                "tests above, fix the engine for that release, then move the range "
                "(pyproject.toml, "
                "megatrain_ds/versions.py TESTED, constraints*.txt).",
                flush=True,
            )
        return rc
    print(
        f"\nDRIFT ({kind}) PASSED with {versions_line}."
        + (
            f" Newer than the tested set and passing: {'; '.join(differing)}: the tested range can "
            "move."
            if differing
            else ""
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
