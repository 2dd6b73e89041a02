"""The engine's host buffers: private mappings that a forked child does not inherit, huge pages
where the kernel offers them, and the training they hold still exact (the equivalence tests cover
the numbers)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def _engine_buffers(engine):
    store = engine.store
    return {
        "master": store.master,
        "exp_avg": store.exp_avg,
        "exp_avg_sq": store.exp_avg_sq,
        "grad": store.grad,
    }


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps", encoding="ascii") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def _one_step_engine(layers=2):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
    }
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=layers), config=cfg)
    ids = torch.randint(0, 100, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


@linux
def test_forked_child_does_not_inherit_the_optimizer_state():
    """A DataLoader worker forked after initialize() must not share the state copy-on-write (the
    parent's next optimizer step would duplicate every page it writes while the worker lives)."""
    engine = _one_step_engine()
    buffers = _engine_buffers(engine)
    assert all(_mapped(t.data_ptr()) for t in buffers.values())
    plain = torch.zeros(1 << 20)  # an ordinary tensor, for contrast: the child has it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report which addresses it can see, touch nothing else
        seen = [name for name, t in buffers.items() if _mapped(t.data_ptr())]
        os.write(w, (",".join(seen) + "|" + str(_mapped(plain.data_ptr()))).encode())
        os._exit(0)
    os.close(w)
    report = os.read(r, 4096).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    seen, plain_seen = report.split("|")
    assert seen == "", f"forked child inherited engine buffers: {seen}"
    assert plain_seen == "True"
    # the parent still trains on them
    ids = torch.randint(0, 100, (2, 8))
    engine.synchronize()
    before = engine.store.master.clone()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.synchronize()
    assert not torch.equal(before, engine.store.master)
    engine.destroy()


@linux
def test_large_host_buffers_use_huge_pages_when_the_kernel_offers_them():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as fh:
            mode = fh.read()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are switched off on this machine")
    from megatrain_ds.host.host_state import host_buffer

    regions: list = []
    t = host_buffer(16 << 20, torch.float32, pin=False, regions=regions)  # 64 MiB
    t.fill_(1.0)
    lo = t.data_ptr()
    huge_kb = None
    with open("/proc/self/smaps", encoding="ascii") as fh:
        inside = False
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a <= lo < b
            elif inside and head == "AnonHugePages:":
                huge_kb = int(line.split()[1])
                break
    assert huge_kb is not None and huge_kb >= 2048, (
        f"{huge_kb} kB of the 64 MiB buffer in huge pages"
    )
    assert float(t.sum()) == 16 << 20
