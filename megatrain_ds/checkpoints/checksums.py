"""Checkpoint files written with their checksums (``save_file``), and verified before a load reads
them (``verify``).

A flipped byte in an optimizer file used to load without a word (masters off by up to 0.25;
DeepSpeed does not check either). Each rank's ``save_checkpoint`` hashes its files while writing
them (SHA-256 of the bytes as they go to the file, no second read) and writes
``zero_pp_rank_<r>_checksums.sha256`` beside them, in ``sha256sum``'s format, so ``sha256sum -c
zero_pp_rank_0_checksums.sha256`` checks a folder by hand. ``load_checkpoint`` verifies every
manifest of the folder before it reads anything (each rank the manifests of the saving ranks
congruent to it), and refuses a mismatch naming the file, leaving the engine untouched. Folders
without a manifest (real DeepSpeed's, older ones) load as before.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os

import torch

from ..host import available_bytes, reserve_file

MANIFEST = "zero_pp_rank_{rank}_checksums.sha256"
_CHUNK = 1 << 24  # 16 MiB per read when verifying
_DIGEST = 64  # hex digits of a SHA-256
# what torch.save writes beyond its storages' bytes, at most: per record a header and a descriptor
# padded to 64 bytes (and a central directory entry), and the pickle (the tensors' metadata; a
# model's few thousand names)
_RECORD_BYTES, _PICKLE_BYTES = 512, 1 << 20


class ChecksumError(RuntimeError):
    """A checkpoint file's bytes differ from those its save recorded."""


class HashingWriter:
    """A write-only file object that hashes what passes through it (torch.save writes its archive
    sequentially)."""

    def __init__(self, f) -> None:
        self.f, self.sha = f, hashlib.sha256()
        self.name = getattr(f, "name", None)  # the path, as a file object has it
        # what a write raised: torch.save's zip writer hides it behind "unexpected pos"
        self.error = None

    def write(self, data) -> int:
        try:
            self.sha.update(data)
            return self.f.write(data)
        except BaseException as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def save_file(obj, path: str) -> str:
    """Write ``obj`` with torch.save into a file reserved first (host/disk_space.py), fsynced;
    returns the SHA-256 of the bytes written (checksums.py). A full disk (ENOSPC, or torch's
    "unexpected pos" once a write came up short) is an OSError naming the file, the bytes it needs
    and those free; another write error is an OSError naming the file; the caller removes the
    unfinished folder, and the previous checkpoint stays as it was. torch.save's zip writer turns
    whatever a write raised into its RuntimeError "unexpected pos": the write's own exception is
    raised instead, so a Ctrl-C in the middle of a file is the script's KeyboardInterrupt (the fault
    driver found it reported as a full disk)."""
    writer = None
    # the disk asked for before a byte is written: the pickle's size is known only once it is
    # written, so the file is reserved at a bound of it, written into from its start (torch.save
    # writes a file object sequentially) and cut to the bytes written (a DiskSpaceError naming the
    # file and the bytes, with no file left, where it cannot fit)
    reserve_file(path, _saved_bytes_bound(obj))
    try:
        with open(path, "r+b") as f:
            writer = HashingWriter(f)
            torch.save(obj, writer)
            f.truncate()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:
        # what the write raised, under torch's RuntimeError
        hidden = writer.error if writer is not None else None
        # raised before the write's body ran (a Ctrl-C lands at a call's first instruction): torch
        # keeps it as the context
        if hidden is None and isinstance(exc, RuntimeError):
            hidden = _hidden_cause(exc)
        # Ctrl-C (KeyboardInterrupt) mid-write: the script's except KeyboardInterrupt gets it
        # (it was a "disk is full" OSError)
        if hidden is not None and not isinstance(hidden, Exception):
            raise hidden from None
        cause = hidden if hidden is not None else exc
        full = getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
            hidden is None and "unexpected pos" in str(exc)
        )  # a short write that raised nothing
        if not full:
            # EIO, EROFS, ...: named with the file (a write's error names none)
            if isinstance(cause, OSError):
                raise OSError(
                    cause.errno,
                    f"save_checkpoint: writing {path} failed: {cause.strerror or cause}. "
                    "This save is abandoned (its folder removed); the previous checkpoint and "
                    "'latest' "
                    "are intact",
                ) from exc
            if hidden is not None:
                raise hidden from exc  # the write's own error, not torch's "unexpected pos"
            raise
        free = available_bytes(os.path.dirname(path) or ".")
        raise OSError(
            errno.ENOSPC,
            f"save_checkpoint: the disk is full writing {path}: it needs about "
            f"{_tensor_bytes(obj) / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free there. This "
            "save is "
            "abandoned (its folder removed); the previous checkpoint and 'latest' are intact. Free "
            "space "
            "or save to another disk",
        ) from exc
    return writer.hexdigest()


def _hidden_cause(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt (or OSError) torch's writer turned into its RuntimeError, from the
    exception's chain."""
    seen, link = set(), exc.__context__ or exc.__cause__
    while link is not None and id(link) not in seen:
        if not isinstance(link, Exception) or isinstance(link, OSError):
            return link
        seen.add(id(link))
        link = link.__context__ or link.__cause__
    return None


def _storages(obj, found: dict) -> dict:
    """The storages of the tensors in a checkpoint payload (dicts, lists, tuples), by address: what
    torch.save writes (a view's whole storage, a storage shared by two tensors once)."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        found[(obj.device.type, storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, found)
    return found


def _tensor_bytes(obj) -> int:
    """Bytes of the storages in a checkpoint payload: about what torch.save writes."""
    return sum(_storages(obj, {}).values())


def _saved_bytes_bound(obj) -> int:
    """At least the bytes torch.save writes for ``obj`` (its storages, their records, the
    pickle)."""
    storages = _storages(obj, {})
    return sum(storages.values()) + _RECORD_BYTES * (len(storages) + 8) + _PICKLE_BYTES


def manifest_bytes(names) -> int:
    """The size of the manifest of the files ``names``: known before they are written (the save
    reserves it)."""
    return sum(_DIGEST + 2 + len(name.encode()) + 1 for name in names)


def write_manifest(folder: str, rank: int, digests: dict[str, str]) -> str:
    """``digests``: file name (in ``folder``) -> SHA-256 hex. Written (into the file the save
    reserved, if there is one: not truncated first) and fsynced; returns its path."""
    path = os.path.join(folder, MANIFEST.format(rank=rank))
    with open(path, "r+" if os.path.exists(path) else "w") as f:
        for name, digest in sorted(digests.items()):
            f.write(f"{digest}  {name}\n")
        f.truncate()  # (at the end written: the reserved size is this one)
        os.fsync(f.fileno())
    return path


def _file_sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def verify(folder: str, rank: int = 0, world: int = 1) -> int:
    """Check the files named by the manifests of ``folder`` that fall to ``rank`` of ``world`` (the
    saving ranks r with r % world == rank). Raises ``ChecksumError`` naming the first bad or missing
    file; returns how many files were checked (a listed file that is missing is left to the reader,
    which names it)."""
    checked = 0
    for manifest in sorted(glob.glob(os.path.join(folder, MANIFEST.format(rank="*")))):
        saved_rank = os.path.basename(manifest).split("_")[3]  # zero_pp_rank_<r>_checksums.sha256
        if not saved_rank.isdigit() or int(saved_rank) % world != rank:
            continue
        with open(manifest, "rb") as f:
            lines = f.read().split(b"\n")
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            # "<64 hex digits> <file name>", as written: anything else is a corrupted manifest
            try:
                digest, name = raw.decode("ascii").split("  ", 1)
                if (
                    len(digest) != 64
                    or not all(c in "0123456789abcdef" for c in digest)
                    or os.sep in name
                ):
                    raise ValueError
            except ValueError:  # (UnicodeDecodeError is one)
                raise ChecksumError(
                    f"{manifest} is corrupted: line {number} is not '<sha256>  <file name>' "
                    f"({raw[:100]!r}). "
                    "Nothing was loaded; load an earlier checkpoint (tag=...) or copy this folder "
                    "again"
                ) from None
            path = os.path.join(folder, name)
            # the reader names a missing rank file, with what saved the folder
            if not os.path.isfile(path):
                continue
            actual = _file_sha256(path)
            if actual != digest:
                raise ChecksumError(
                    f"{path} is corrupted: its SHA-256 is {actual}, its save recorded {digest} "
                    f"({manifest}). "
                    "Nothing was loaded; load an earlier checkpoint (tag=...) or copy this file "
                    "again"
                )
            checked += 1
    return checked
