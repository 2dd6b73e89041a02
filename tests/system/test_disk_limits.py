"""Disk limits on real small file systems mounted here (root): a save, the checkpoint writer and the
NVMe tier ask the
file system itself for their bytes (posix_fallocate; megatrain_ds/host/disk_space.py) before they
write one.

- tmpfs of a few MiB (it implements fallocate): a save that cannot fit writes nothing, names the
bytes; one that
  fits loads back; the NVMe tier too large for its disk is refused at ``initialize``.
- ext4 with 5% reserved blocks (``mkfs.ext4 -m 5``) that root may not use (mounted with
``resuid``/``resgid`` of
  nobody, and the process without CAP_SYS_RESOURCE): the disk of issue 47, where statvfs's
  ``f_bfree`` counts
  blocks no one may write. The check counts ``f_bavail``; a check fooled into counting ``f_bfree``
  is caught by the
  reservation, with nothing written.

Each test mounts its own file system under its tmp_path and unmounts it in a ``finally``.
"""

import contextlib
import ctypes
import os
import re
import subprocess

import pytest
import torch
import transformers

import megatrain_ds
from megatrain_ds.checkpoints import checkpoint_folder
from megatrain_ds.host import nvme
from megatrain_ds.host.disk_space import DiskSpaceError
from megatrain_ds.planning import capacity, capacity_count
from tests.models import tiny_hf

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0},
}
CAP_SYS_RESOURCE = 24
NOBODY = 65534


def _run(*cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)} failed: {out.stderr.strip()}"


@contextlib.contextmanager
def _mounted(folder, *mount_args):
    os.makedirs(folder, exist_ok=True)
    _run("mount", *mount_args, str(folder))
    try:
        yield str(folder)
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode:
            subprocess.run(
                ["umount", "-l", str(folder)], capture_output=True
            )  # (a file still open: lazily)


def _tmpfs(tmp_path, size: int):
    return _mounted(tmp_path / "tmpfs", "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


@contextlib.contextmanager
def _ext4_reserved_for_nobody(tmp_path, size=512 << 20):
    """An ext4 image with 5% of its blocks reserved, for uid/gid nobody only: root may write them
    only with
    CAP_SYS_RESOURCE, which ``_without_cap_sys_resource`` takes away."""
    image = tmp_path / "ext4.img"
    with open(image, "wb") as f:
        f.truncate(size)
    _run("mkfs.ext4", "-q", "-F", "-m", "5", str(image))
    with _mounted(
        tmp_path / "ext4", "-o", f"loop,resuid={NOBODY},resgid={NOBODY}", str(image)
    ) as folder:
        yield folder


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


@contextlib.contextmanager
def _without_cap_sys_resource():
    """This process (all its threads: the effective set is per thread, so the save's threads are
    started inside)
    without CAP_SYS_RESOURCE in its effective set, as a container's root runs (Docker drops it); put
    back after
    (it stays permitted). Only the calling thread's set changes: the save runs on it."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    had = data[0].effective & (1 << CAP_SYS_RESOURCE)
    data[0].effective &= ~(1 << CAP_SYS_RESOURCE)
    assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        data[0].effective |= had
        libc.capset(ctypes.byref(header), data)


def _engine(seed=0):
    """A Llama of 1M parameters: a checkpoint of 12.6 MB, large beside the 1 MiB the free-space
    check adds for the
    small files."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=1024,
            tie_word_embeddings=False,
        )
    )
    engine, *_ = megatrain_ds.initialize(model=model, config=CFG)
    ids = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


def _listing(folder):
    return sorted(
        (os.path.relpath(os.path.join(r, n), folder), os.path.getsize(os.path.join(r, n)))
        for r, _, names in os.walk(folder)
        for n in names
    )


def _masters(engine):
    engine.sync_masters_to_host()
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


def _checkpoint_bytes(engine, folder) -> int:
    """The disk one save of ``engine`` takes (its folder, the recovery scripts and ``latest``),
    saved in ``folder``."""
    engine.save_checkpoint(folder, tag="measure")
    total = sum(
        os.lstat(os.path.join(r, n)).st_blocks * 512
        for r, _, names in os.walk(folder)
        for n in names
    )
    return total


def _bfree_bytes(path):
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


# ----------------------------------------------------------------------------------------------
# tmpfs
def test_a_save_that_cannot_fit_on_tmpfs_writes_nothing_and_one_that_fits_loads_back(
    tmp_path, monkeypatch
):
    engine = _engine()
    one = _checkpoint_bytes(engine, str(tmp_path / "measure"))
    # room for one checkpoint and its small files, not for two
    with _tmpfs(tmp_path, size=one + one // 2 + (1 << 20)) as disk:
        save_dir = os.path.join(disk, "ckpt")
        engine.save_checkpoint(save_dir, tag="one")
        want = _masters(engine)
        before, free = _listing(disk), os.statvfs(disk).f_bavail
        # the free-space check (statvfs) refuses it: its message names the bytes
        with pytest.raises(
            OSError,
            match=r"not enough disk space for checkpoint 'two' .* it needs [\d,]+ bytes .* "
            r"[\d,]+ bytes .* are free there\. Nothing was written",
        ):
            engine.save_checkpoint(save_dir, tag="two")
        assert _listing(disk) == before
        # a check that believes there is room (issue 47: it counted blocks the disk would not give):
        # the file
        # system's own refusal, before a byte is written
        monkeypatch.setattr(checkpoint_folder, "free_bytes", lambda path: 1 << 50)
        with pytest.raises(DiskSpaceError) as err:
            engine.save_checkpoint(save_dir, tag="two")
        monkeypatch.undo()
        message = str(err.value)
        print(message)
        assert re.search(
            rf"save_checkpoint: not enough disk space for checkpoint 'two' in {re.escape(save_dir)}"
            r": the "
            r"file system refused to reserve [\d,]+ bytes \(.*\) for .*/\.two\.tmp-\d+/.*\.pt \(No "
            r"space "
            r"left on device\); it has [\d,]+ bytes \(.*\) available; rank 0's files need [\d,]+ "
            r"bytes "
            r".* in all\. Nothing was written: the previous checkpoint and 'latest' are as they "
            r"were",
            message,
        ), message
        assert err.value.needed > err.value.available
        assert _listing(disk) == before and os.statvfs(disk).f_bavail == free
        assert open(os.path.join(save_dir, "latest")).read() == "one"
        other = _engine(seed=1)
        other.load_checkpoint(save_dir)
        got = _masters(other)
        assert all(torch.equal(got[k], want[k]) for k in want)
        # the same tag again: the disk holds one copy, the previous is removed first (with a
        # warning), it fits
        with pytest.warns(UserWarning, match="cannot hold the previous checkpoint of tag 'one'"):
            engine.save_checkpoint(save_dir, tag="one")
        assert sorted(os.listdir(os.path.join(save_dir, "one"))) == sorted(
            n for n in os.listdir(tmp_path / "measure" / "measure")
        )
        other.load_checkpoint(save_dir)
        engine.destroy(), other.destroy()


def test_the_nvme_tier_too_large_for_its_tmpfs_is_refused_at_initialize(tmp_path, monkeypatch):
    cfg = {
        **CFG,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "buffer_count": 2},
        },
        "megatrain": {**CFG["megatrain"], "nvme_layers": 2, "nvme_backend": "threads"},
    }
    with _tmpfs(tmp_path, size=64 << 10) as disk:
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = disk
        with pytest.raises((nvme.NvmeError, capacity.CapacityError), match=r"free"):
            megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=cfg)
        # the planner's and the tier's statvfs checks fooled: the file system refuses the swap
        # file's blocks
        monkeypatch.setattr(nvme, "free_bytes", lambda path: 1 << 50)
        monkeypatch.setattr(capacity_count, "disk_free_bytes", lambda path: 1 << 50)
        with pytest.raises(nvme.NvmeError) as err:
            megatrain_ds.initialize(model=tiny_hf("llama", layers=2), config=cfg)
        message = str(err.value)
        print(message)
        assert re.search(
            r"cannot allocate the state of the layers placed on disk .*: the file system refused "
            r"to "
            r"reserve [\d,]+ bytes .* for .*/moments\.swp \(No space left on device\); it has "
            r"[\d,]+ "
            r"bytes .* available\. Free space there",
            message,
        ), message
        assert os.listdir(disk) == []  # no swap folder left


# ----------------------------------------------------------------------------------------------
# ext4
def test_ext4_reserved_blocks_root_may_not_write_are_not_counted(tmp_path, monkeypatch):
    """The disk of issue 47: statvfs's f_bfree counts the reserved blocks, this root may not write
    them. A save
    whose checkpoint lies between f_bavail and f_bfree is refused by the check (f_bavail), and a
    check that counted
    f_bfree (as before) is caught by the reservation: nothing is written either way."""
    engine = _engine()
    one = _checkpoint_bytes(engine, str(tmp_path / "measure"))
    with _ext4_reserved_for_nobody(tmp_path) as disk, _without_cap_sys_resource():
        st = os.statvfs(disk)
        reserved = (st.f_bfree - st.f_bavail) * st.f_frsize
        assert reserved > one, (
            reserved,
            one,
        )  # 5% of 512 MiB: a whole checkpoint fits in the reserved blocks
        # fill the disk to leave half a checkpoint writable (by anyone): f_bfree still counts a
        # whole one more
        filler = os.path.join(disk, "filler")
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - one // 2)
        os.close(fd)
        save_dir = os.path.join(disk, "ckpt")
        os.makedirs(save_dir)
        assert os.statvfs(disk).f_bavail * st.f_frsize < one < _bfree_bytes(disk)
        before = _listing(disk)
        with pytest.raises(
            OSError,
            match=r"not enough disk space for checkpoint 'global_step1'.*Nothing was written",
        ):
            engine.save_checkpoint(save_dir)
        assert _listing(disk) == before
        monkeypatch.setattr(checkpoint_folder, "free_bytes", _bfree_bytes)  # the check of issue 47
        free = os.statvfs(disk).f_bavail
        with pytest.raises(
            DiskSpaceError, match=r"the file system refused to reserve .*Nothing was written"
        ) as err:
            engine.save_checkpoint(save_dir)
        print(err.value)
        assert (
            _listing(disk) == before and os.statvfs(disk).f_bavail == free
        )  # no block kept by the failed call
        monkeypatch.undo()
        os.remove(filler)  # room again: it saves, and loads back
        engine.save_checkpoint(save_dir)
        other = _engine(seed=1)
        other.load_checkpoint(save_dir)
        want, got = _masters(engine), _masters(other)
        assert all(torch.equal(got[k], want[k]) for k in want)
        engine.destroy(), other.destroy()
