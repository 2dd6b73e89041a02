"""Disk space asked of the file system itself before a byte is written: ``reserve_file``.

statvfs only guesses what a write will get. ``f_bfree`` counts the blocks ext4 keeps for its
``resuid``/``resgid``
(root by default) or a process with ``CAP_SYS_RESOURCE``: a container's root may have neither, and a
check that
counted them passed a 73 GiB save on a disk with 54 GB writable, which then failed with ENOSPC
part-way (issue 47).
``f_bavail`` is closer, but quotas, thin provisioning and other writers still make it a guess.
``os.posix_fallocate``
is the file system's own answer: the blocks it gives belong to the file, and a write into them does
not fail for
space (ext4, xfs, tmpfs; a copy-on-write file system such as btrfs or zfs may still fail an
overwrite). So a file
is reserved before it is written, and a writer that cannot fit fails there, having written nothing:

- a file whose size is known (the checkpoint files, their manifests, the NVMe swap file) at that
size; the writer
  opens it without truncating (``r+b``) and writes into the blocks it holds;
- a file whose size is only bounded (``torch.save``'s pickles) at the bound; the writer cuts it to
the bytes it
  wrote (``truncate``);
- room a later writer needs beside it (the files a checkpoint's commit writes) as a scratch file,
deleted right
  before that writer starts. Another process may take the room in between: the writer then fails
  with ENOSPC as
  before; the scratch file narrows that window to the write itself, it cannot close it.

Where the file system does not implement fallocate (``EOPNOTSUPP``; ``EINVAL`` from some network and
FUSE file
systems) the space is checked against ``f_bavail`` instead, never ``f_bfree``. A refusal is a
``DiskSpaceError`` (an
``OSError`` with errno ENOSPC) naming the path, the bytes asked for and the bytes available, with
the attempt undone
(ext4 keeps the blocks a failed fallocate did get: the file is removed).
"""

from __future__ import annotations

import errno
import os

_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL)  # (errno.ENOTSUP is EOPNOTSUPP on Linux)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskSpaceError(OSError):
    """The file system did not give ``needed`` bytes for ``path``; ``available``: what statvfs says
    it has for this
    process (``f_bavail``, after the failed reservation was undone); ``reason``: that in words, a
    clause a caller
    can put in its own message (``str(error)`` is ``[Errno 28] not enough disk space:
    <reason>``)."""

    def __init__(
        self, reason: str, *, path: str, needed: int, available: int, message: str | None = None
    ) -> None:
        super().__init__(errno.ENOSPC, message or f"not enough disk space: {reason}")
        self.reason, self.path, self.needed, self.available = reason, path, needed, available

    def __reduce__(self):  # (an OSError's pickle would drop the keyword fields)
        return _rebuild, (self.reason, self.path, self.needed, self.available, self.strerror)


def _rebuild(reason: str, path: str, needed: int, available: int, message: str) -> DiskSpaceError:
    return DiskSpaceError(reason, path=path, needed=needed, available=available, message=message)


def byte_count(nbytes: int) -> str:
    """``1,234,567,890 bytes (1.15 GiB)``: how the messages here write a byte count (MiB below a
    GiB)."""
    if nbytes >= 2**30:
        return f"{nbytes:,} bytes ({nbytes / 2**30:.2f} GiB)"
    return f"{nbytes:,} bytes ({nbytes / 2**20:.2f} MiB)"


def available_bytes(path: str) -> int:
    """Bytes this process may still put on the file system of ``path`` (or of its nearest existing
    parent), as
    statvfs says: ``f_bavail`` (root's reserved blocks are not counted: a file system may keep them
    from root)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def reserve_file(path: str, nbytes: int, mode: int = 0o644) -> None:
    """``path`` created (or an existing file kept, never truncated) with its first ``nbytes``
    allocated on disk by
    the file system (its size at least ``nbytes``). Raises ``DiskSpaceError`` where the file system
    does not give
    them, having undone the attempt: a file this call created is removed, an existing one cut back
    to its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, mode)
    try:
        size = os.fstat(fd).st_size
        refused = _fallocate(fd, nbytes)
        if refused is not None and refused.errno in _FULL:
            if size:
                os.ftruncate(fd, size)  # (blocks past it that the failed call allocated are freed)
            else:
                _unlink(path)
    finally:
        os.close(fd)
    if refused is None:
        return
    available = available_bytes(os.path.dirname(os.path.abspath(path)))
    if refused.errno in _FULL:
        raise DiskSpaceError(
            f"the file system refused to reserve {byte_count(nbytes)} for {path} "
            f"({refused.strerror}); it has {byte_count(available)} available",
            path=path,
            needed=nbytes,
            available=available,
        )
    if available < nbytes:  # the file system cannot reserve: statvfs's f_bavail is what is left
        if not size:
            _unlink(path)
        raise DiskSpaceError(
            f"{path} needs {byte_count(nbytes)}, and the file system (which cannot reserve space: "
            f"{refused.strerror}) has {byte_count(available)} available",
            path=path,
            needed=nbytes,
            available=available,
        )


def _fallocate(fd: int, nbytes: int) -> OSError | None:
    """None once the file system gave the first ``nbytes`` of ``fd``; else its ENOSPC-like or "not
    supported"
    error (any other error is raised)."""
    if nbytes <= 0:
        return None
    try:
        os.posix_fallocate(
            fd, 0, nbytes
        )  # looked up on each call: tests put a full disk in its place
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED + _FULL:
            raise
        return exc
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
