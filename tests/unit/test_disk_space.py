"""Disk space asked of the file system before a byte is written (megatrain_ds/host/disk_space.py),
without mounts: the
file system's answers (ENOSPC, EOPNOTSUPP, EINVAL) and statvfs's counts are faked.
tests/system/test_disk_limits.py
runs the same paths on real small file systems (tmpfs, ext4 with reserved blocks)."""

import errno
import io
import os
import pickle
import re

import pytest
import torch

import megatrain_ds
from megatrain_ds.checkpoints import checkpoint_folder, checksums
from megatrain_ds.checkpoints.checkpoint_files import MODEL_FILE, OPTIM_FILE
from megatrain_ds.host import disk_space, nvme
from megatrain_ds.host.disk_space import DiskSpaceError, reserve_file
from megatrain_ds.planning import host_bytes
from tests.models import tiny_hf

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0},
}


def _refusing(code, after=0):
    """A posix_fallocate that refuses with ``code`` once ``after`` calls have gone through (the real
    one)."""
    real, calls = os.posix_fallocate, []

    def fallocate(fd, offset, length):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        if len(calls) > after:
            raise OSError(code, os.strerror(code))
        return real(fd, offset, length)

    fallocate.calls = calls
    return fallocate


class _Statvfs:
    """statvfs of a disk with ``bavail`` blocks for anyone and ``bfree`` counting root's reserved
    ones."""

    def __init__(self, bavail: int, bfree: int, frsize: int = 4096) -> None:
        self.f_bavail, self.f_bfree, self.f_frsize, self.f_bsize = bavail, bfree, frsize, frsize


# ----------------------------------------------------------------------------------------------
# reserve_file
def test_a_reserved_file_holds_its_blocks_and_an_existing_one_is_not_truncated(tmp_path):
    path = tmp_path / "f"
    reserve_file(str(path), 3 << 20)
    assert path.stat().st_size == 3 << 20 and path.stat().st_blocks * 512 >= 3 << 20
    with open(
        path, "r+b"
    ) as f:  # a writer writes into it, then a second reservation keeps what it wrote
        f.write(b"kept")
    reserve_file(str(path), 1 << 20)
    assert path.read_bytes()[:4] == b"kept" and path.stat().st_size == 3 << 20
    reserve_file(str(tmp_path / "empty"), 0)
    assert (tmp_path / "empty").stat().st_size == 0


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_refused_reservation_names_the_bytes_and_leaves_nothing(tmp_path, monkeypatch, code):
    monkeypatch.setattr(os, "posix_fallocate", _refusing(code))
    monkeypatch.setattr(disk_space, "available_bytes", lambda path: 12_345)
    path = tmp_path / "big.pt"
    with pytest.raises(DiskSpaceError) as err:
        reserve_file(str(path), 5 << 30)
    e = err.value
    assert (e.errno, e.path, e.needed, e.available) == (errno.ENOSPC, str(path), 5 << 30, 12_345)
    assert str(e) == (
        f"[Errno 28] not enough disk space: the file system refused to reserve 5,368,709,120 bytes "
        f"(5.00 GiB) for {path} ({os.strerror(code)}); it has 12,345 bytes (0.01 MiB) available"
    )
    assert os.listdir(tmp_path) == []
    existing = tmp_path / "existing"
    existing.write_bytes(b"x" * 100)
    with pytest.raises(DiskSpaceError):
        reserve_file(str(existing), 1 << 20)
    assert existing.read_bytes() == b"x" * 100  # cut back to what it held
    again = pickle.loads(pickle.dumps(e))  # (the ranks of a save send each other their errors)
    assert (type(again), str(again), again.needed, again.available) == (
        DiskSpaceError,
        str(e),
        e.needed,
        12_345,
    )


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL])
def test_where_fallocate_is_not_supported_f_bavail_decides(tmp_path, monkeypatch, code):
    """The file system cannot reserve: statvfs's f_bavail is checked instead (never f_bfree, root or
    not)."""
    monkeypatch.setattr(os, "posix_fallocate", _refusing(code))
    monkeypatch.setattr(
        os, "statvfs", lambda path: _Statvfs(bavail=256, bfree=1 << 20)
    )  # 1 MiB; 4 GiB with root's
    reserve_file(str(tmp_path / "fits"), 1 << 20)
    assert (tmp_path / "fits").exists()
    with pytest.raises(
        DiskSpaceError,
        match=re.escape(
            f"{tmp_path / 'big'} needs 1,048,577 bytes (1.00 MiB), and the file system (which "
            "cannot reserve space: "
            f"{os.strerror(code)}) has 1,048,576 bytes (1.00 MiB) available"
        ),
    ):
        reserve_file(str(tmp_path / "big"), (1 << 20) + 1)
    assert sorted(os.listdir(tmp_path)) == ["fits"]


def test_another_error_of_fallocate_is_raised_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "posix_fallocate", _refusing(errno.EIO))
    with pytest.raises(OSError) as err:
        reserve_file(str(tmp_path / "f"), 4096)
    assert err.value.errno == errno.EIO and not isinstance(err.value, DiskSpaceError)


def test_every_free_space_count_leaves_out_roots_reserved_blocks(tmp_path, monkeypatch):
    """The checkpoint folder's check, the NVMe tier's and the planner's all read f_bavail (the save
    of issue 47
    counted f_bfree as root, and passed a check its disk could not honour)."""
    monkeypatch.setattr(os, "statvfs", lambda path: _Statvfs(bavail=10, bfree=1000))
    missing = str(tmp_path / "not" / "yet")  # (the nearest existing parent)
    assert disk_space.available_bytes(missing) == 40960
    assert checkpoint_folder.free_bytes(missing) == 40960
    assert nvme.free_bytes(str(tmp_path)) == 40960
    assert host_bytes.disk_free_bytes(missing) == 40960 and host_bytes.disk_free_bytes(None) is None


# ---------------------------------------------------------------------------------------------- the
# writers
def test_torch_save_writes_into_its_reservation_and_is_cut_to_its_size(tmp_path, monkeypatch):
    obj = {"w": torch.randn(1000, 100), "view": torch.arange(10.0)[2:5], "n": 3}
    path = tmp_path / "model.bin"
    digest = checksums.save_file(obj, str(path))
    plain = io.BytesIO()
    torch.save(
        obj, plain
    )  # (to a file object, as save_file writes: the archive's folder is "archive")
    assert path.read_bytes() == plain.getvalue()  # the archive torch.save writes, no trailing bytes
    assert digest == checksums.hashlib.sha256(plain.getvalue()).hexdigest()
    assert checksums._saved_bytes_bound(obj) >= path.stat().st_size
    monkeypatch.setattr(os, "posix_fallocate", _refusing(errno.ENOSPC))
    with pytest.raises(
        DiskSpaceError,
        match=rf"refused to reserve [\d,]+ bytes .* for {re.escape(str(tmp_path))}"
        r"/again\.bin",
    ):
        checksums.save_file(obj, str(tmp_path / "again.bin"))
    assert os.listdir(tmp_path) == ["model.bin"]


def test_the_manifest_is_reserved_at_its_exact_size(tmp_path):
    digests = {MODEL_FILE: "a" * 64, OPTIM_FILE: "b" * 64}
    path = tmp_path / checksums.MANIFEST.format(rank=0)
    reserve_file(str(path), checksums.manifest_bytes(digests))
    written = checksums.write_manifest(str(tmp_path), 0, digests)
    assert written == str(path) and path.stat().st_size == checksums.manifest_bytes(digests)
    assert path.read_text() == f"{'a' * 64}  {MODEL_FILE}\n{'b' * 64}  {OPTIM_FILE}\n"


# ---------------------------------------------------------------------------------------------- a
# save
def _engine():
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=CFG)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


def _listing(folder):
    return sorted(
        (os.path.relpath(os.path.join(r, n), folder), os.path.getsize(os.path.join(r, n)))
        for r, _, names in os.walk(folder)
        for n in names
    )


def test_a_save_the_file_system_refuses_writes_nothing(tmp_path, monkeypatch):
    """The free-space check passes (statvfs says there is room), the file system refuses the
    optimizer file's
    blocks: a DiskSpaceError naming the file, its bytes and the rank's total, raised before a byte
    is written
    (every file is reserved first); the folder is as it was. Where fallocate is unsupported,
    f_bavail decides."""
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="one")
    before = _listing(tmp_path)
    refusing = _refusing(
        errno.ENOSPC, after=1
    )  # the model file is given its blocks, the optimizer file is not
    monkeypatch.setattr(os, "posix_fallocate", refusing)
    with pytest.raises(DiskSpaceError) as err:
        engine.save_checkpoint(str(tmp_path), tag="two")
    assert refusing.calls[1].endswith(OPTIM_FILE) and err.value.path.endswith(OPTIM_FILE)
    message = str(err.value)
    assert re.fullmatch(
        r"\[Errno 28\] save_checkpoint: not enough disk space for checkpoint 'two' in "
        rf"{re.escape(str(tmp_path))}: "
        rf"the file system refused to reserve {err.value.needed:,} bytes \(.* MiB\) for "
        rf".*/\.two\.tmp-\d+/{OPTIM_FILE} "
        r"\(No space left on device\); it has [\d,]+ bytes \(.*\) available; rank 0's files need "
        r"[\d,]+ bytes \(.*\) "
        r"in all\. Nothing was written: the previous checkpoint and 'latest' are as they were\. "
        r"Free space \(older "
        r"checkpoints\?\) or save to another disk",
        message,
    ), message
    assert _listing(tmp_path) == before and (tmp_path / "latest").read_text() == "one"
    monkeypatch.setattr(os, "posix_fallocate", _refusing(errno.EOPNOTSUPP))
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: _Statvfs(bavail=1, bfree=real(p).f_bfree))
    with pytest.raises(
        OSError, match=r"not enough disk space for checkpoint 'two'.*Nothing was written"
    ):
        engine.save_checkpoint(
            str(tmp_path), tag="two"
        )  # (refused by the check of the whole checkpoint first)
    assert _listing(tmp_path) == before
    monkeypatch.undo()
    engine.save_checkpoint(str(tmp_path), tag="two")
    assert (tmp_path / "latest").read_text() == "two"
    assert sorted(os.listdir(tmp_path / "two")) == sorted(
        os.listdir(tmp_path / "one")
    )  # no scratch file left
    engine.destroy()


def test_the_small_files_beside_the_checkpoint_are_reserved_until_the_commit(tmp_path, monkeypatch):
    """Rank 0 holds the room for the recovery scripts and ``latest`` in the temporary folder while
    its files are
    written, and gives it back right before the commit writes them."""
    engine = _engine()
    seen = {}
    real = checkpoint_folder.commit_folder

    def commit(save_dir, tmp, tag, save_latest):
        scratch = os.path.join(tmp, checkpoint_folder.SMALL_FILES_RESERVED)
        seen["size"] = os.path.getsize(scratch)
        return real(save_dir, tmp, tag, save_latest)

    monkeypatch.setattr("megatrain_ds.checkpoints.checkpoint.commit_folder", commit)
    engine.save_checkpoint(str(tmp_path))
    assert seen["size"] == checkpoint_folder.small_files_bytes() >= 4096
    assert checkpoint_folder.SMALL_FILES_RESERVED not in os.listdir(tmp_path / "global_step1")
    engine.destroy()
