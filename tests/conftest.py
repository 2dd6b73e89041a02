import os
import sys

import pytest

# One OpenMP thread per test process, set before anything here imports torch (a value already set is
# kept; the subprocesses inherit it). make test runs two workers on the 2-core CI machine: with
# torch's default of one thread per core each, the workers' OpenMP teams oversubscribed the cores
# and spun against each other; three engine test files on 2 workers took 105.6 s that way and 52.6 s
# with one thread each (2026-11-29).
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the lent box, not in CI)")
    # DeepSpeed's JIT ops built once, before any test process can die holding a build lock
    # (tests/ops_prebuild.py): by the controller only (xdist workers carry ``workerinput``), which
    # xdist starts its workers after. The build runs in a child process: without xdist (``pytest -m
    # gpu`` on the box) the controller runs the tests, and a CUDA op built in its process broke
    # every liger Triton kernel compiled after it ("PassManager::run failed", H200, 2026-11-29); the
    # child leaves the test process as a user's script starts, the built op in the cache.
    if not hasattr(config, "workerinput"):
        import subprocess

        try:
            subprocess.run(
                [sys.executable, "-m", "tests.ops_prebuild"],
                timeout=900,
                check=False,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
        # a build stuck on a lock: the tests that load the op fail themselves
        except subprocess.TimeoutExpired:
            print(
                "[tests/conftest.py] the DeepSpeed op prebuild ran past 900 s and was stopped",
                file=sys.stderr,
            )


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
