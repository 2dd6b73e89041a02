"""The fault-injection driver (tests/fault_driver.py) in ``make test``: a fixed seed, one case of
each kind (a Ctrl-C inside an engine call, a full disk during a save, a flipped byte in a
checkpoint, a rank that dies or stalls), and no case may lose work or go on silently. The longer run
is on demand:

    python -m tests.fault_driver --cases 200 --seed 1          (docs/reliability.md has its counts)

Every case runs in a child process with a bound (a hang is killed and counted as lost): this test
cannot hang.
"""

import errno
import os

import pytest
import torch

from megatrain_ds.checkpoints import checkpoint_stream, checksums
from megatrain_ds.streaming.schedule import LayerSchedule
from tests import fault_driver

SEED = 0


def test_a_few_fault_cases_lose_nothing_and_are_never_silent():
    outcomes = fault_driver.run(cases=4, seed=SEED)
    counts = fault_driver.summary(outcomes)
    assert sorted(counts["by_kind"]) == sorted(fault_driver.KINDS)  # one case of each kind
    bad = [o for o in outcomes if o.result in (fault_driver.LOST, fault_driver.SILENT)]
    assert not bad, "\n".join(
        f"case {o.case} ({o.kind}, {o.params}): {o.result}: {o.why}\n{o.notes}" for o in bad
    )
    assert counts[fault_driver.OK] + counts[fault_driver.UNCLEAR] == 4


# --------------------------------------------------------------------------------------------------
# What the driver found, each fixed; these failed before the fix.


def _interrupt_at(monkeypatch, owner, name, n, exc=KeyboardInterrupt):
    """``owner.name`` raises ``exc`` at its n-th call (once), where a Ctrl-C's handler would raise
    it."""
    real, calls = getattr(owner, name), {"n": 0}

    def hooked(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, hooked)


def test_a_ctrl_c_inside_a_forward_leaves_no_slot_named_after_the_wrong_layer(
    tmp_path, monkeypatch
):
    """A KeyboardInterrupt after a layer's weights were copied into a slot but before the slot was
    renamed left it named after its old layer (with the new one's weights): the next forward used
    them for the old layer, and the run trained on silently different weights (in-place differences
    of 4e-3 after 4 steps)."""
    ga, ref = 1, fault_driver.Reference(1, str(tmp_path))
    engine = fault_driver._engine(ga)
    # the third layer load of the first forward
    _interrupt_at(monkeypatch, LayerSchedule, "loaded", 3)
    with pytest.raises(KeyboardInterrupt):
        fault_driver.script(engine, ga, str(tmp_path / "a"))
    monkeypatch.undo()
    assert engine.global_steps == 0
    assert fault_driver.finish_and_check(ref, engine, ga, str(tmp_path / "b"), "in place") is None


@pytest.mark.parametrize("where", ["entry", "inside"])
def test_a_ctrl_c_while_a_checkpoint_file_is_written_is_a_keyboard_interrupt(
    tmp_path, monkeypatch, where
):
    """torch.save's zip writer turned what a write raised into its RuntimeError "unexpected pos",
    which the save reported as a full disk: a Ctrl-C during a save became "OSError: the disk is
    full" (and no KeyboardInterrupt). Now (the files are streamed, checkpoint_stream.py) the
    script's except KeyboardInterrupt gets it, and the previous checkpoint is intact."""
    engine = fault_driver._engine(1)
    fault_driver.script(engine, 1, str(tmp_path / "ckpt"))  # saves global_step2 on the way
    if where == "entry":  # at the write's first instruction (where a signal's handler runs)
        _interrupt_at(monkeypatch, checkpoint_stream.StreamWriter, "write", 5)
    else:  # inside it, from the file's write
        real, calls = checkpoint_stream.StreamWriter.write, {"n": 0}

        def write(self, data, crc=0):
            calls["n"] += 1
            if calls["n"] == 5:
                self.f = type(
                    "F",
                    (),
                    {"write": lambda _self, _data: (_ for _ in ()).throw(KeyboardInterrupt())},
                )()
            return real(self, data, crc)

        monkeypatch.setattr(checkpoint_stream.StreamWriter, "write", write)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    monkeypatch.undo()
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    assert not [p for p in os.listdir(tmp_path / "ckpt") if ".tmp-" in p]


def test_a_write_error_names_the_file(tmp_path, monkeypatch):
    """Another write error (EIO) came out as torch's "unexpected pos" with no file named."""
    real, calls = checksums.HashingWriter.write, {"n": 0}

    def write(self, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(self, data)

    monkeypatch.setattr(checksums.HashingWriter, "write", write)
    with pytest.raises(OSError, match=r"writing .*x\.pt failed: Input/output error"):
        checksums.save_file({"w": torch.zeros(1000)}, str(tmp_path / "x.pt"))


def test_a_corrupted_manifest_line_is_refused_naming_the_manifest(tmp_path):
    """A flipped byte that made a manifest line undecodable raised UnicodeDecodeError (or a bare
    ValueError)."""
    checksums.save_file({"w": torch.zeros(10)}, str(tmp_path / "a.pt"))
    digest = checksums._file_sha256(str(tmp_path / "a.pt"))
    for line in (
        digest[:10].encode() + b"\xe3" + digest[11:].encode() + b"  a.pt\n",
        digest.encode() + b" a.pt\n",
    ):
        (tmp_path / "zero_pp_rank_0_checksums.sha256").write_bytes(line)
        with pytest.raises(
            checksums.ChecksumError, match=r"zero_pp_rank_0_checksums\.sha256 is corrupted: line 1"
        ):
            checksums.verify(str(tmp_path))
