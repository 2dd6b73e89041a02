import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the lent box, not in CI)")
    # DeepSpeed's JIT ops built once, before any test process can die holding a build lock (tests/ops_prebuild.py):
    # here in the controller only (xdist workers carry ``workerinput``), which xdist starts its workers after
    if not hasattr(config, "workerinput"):
        from tests.ops_prebuild import prebuild
        prebuild()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

