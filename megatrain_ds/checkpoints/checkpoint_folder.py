"""A checkpoint folder's life across the ranks that write or read it (checkpoint.py says what is in
it).

The ranks agree (``CheckpointWorld``: the engine's data-parallel group over gloo, or one process):
every collective runs on the main thread in the same order on every rank, and a rank that fails
makes every rank raise (``agree``).

Writing. Rank 0 first cleans the leftovers of killed saves and checks the free space against the
bytes the new checkpoint needs (``prepare_folder``: each rank's files, sized exactly before they are
written, and a margin for the small files; statvfs's ``f_bavail``, never root's reserved blocks).
Then every rank asks the file system itself for its files' blocks before it writes a byte
(``reserve_files``: each file created at its exact size with posix_fallocate, host/disk_space.py),
rank 0 also for the small files it writes beside the folder at the commit (a scratch file in the
folder, deleted by ``commit_folder`` right before they are written: another writer may take that
room in between, and then ``latest`` is what fails, with the folder complete). A save that cannot
fit fails there with nothing written. A save goes to ``save_dir/.<tag>.tmp-<pid>`` (rank 0's pid:
every rank writes into one folder), every file is fsynced, the ranks agree that all files are
written, then rank 0 renames the directory into place (a previous folder of the same tag is first
moved aside to ``.<tag>.old-<pid>``) and only then replaces ``latest`` (through
``.latest.tmp-<pid>`` and ``os.replace``): ``commit_folder``. DeepSpeed's recovery scripts are
copied beside it. A process killed at any moment leaves the previous checkpoint and ``latest``
intact; what it leaves behind is cleaned by the next save (``clean_stale``) or put back when the
kill landed between the two renames (``_restore_moved_aside``). The one exception is a tag saved
again on a disk that holds one copy of it but not two: the previous one is removed before the new
one is written (``_drop_previous``, with a warning), as DeepSpeed overwrites a tag in place.

Reading. ``checkpoint_path_of``: the folder a tag, or ``latest``, names (putting back a moved-aside
one).
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import os
import re
import shutil
import stat
import warnings

import torch.distributed as dist

from ..host import DiskSpaceError, available_bytes, byte_count, reserve_file
from .checkpoint_files import CheckpointMismatchError

# what DeepSpeed's _copy_recovery_script copies
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
# what an interrupted save leaves
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<pid>\d+)$")
# beside the rank files a save writes its manifests, DeepSpeed's recovery scripts and latest (a few
# KiB), and each file rounds up to the file system's blocks: the free space a save needs beyond its
# rank files
SMALL_FILES_BYTES = 1 << 20
# rank 0's scratch file in the temporary folder (reserve_files)
SMALL_FILES_RESERVED = ".small-files.reserved"
_BLOCK = 4096  # what a small file takes on disk at least


class CheckpointWorld:
    """The ranks a checkpoint is written or read by: the engine's data-parallel group (dp.py), or
    one process.

    Every collective here runs on the main thread over ``dp.cpu_group`` (gloo), in the same order on
    every rank."""

    def __init__(self, dp) -> None:
        """``dp``: the engine's ``DataParallel`` (dp.py); None or inactive: one process."""
        self.dp = dp if dp is not None and getattr(dp, "active", False) else None
        self.rank, self.size = (dp.rank, dp.world) if self.dp is not None else (0, 1)
        self.group = dp.cpu_group if self.dp is not None else None

    def owner(self, i: int) -> int:
        """The rank holding streamed layer i's host state."""
        return self.dp.owner(i) if self.dp is not None else 0

    def peer(self, rank: int) -> int:
        """``rank`` of the group as torch.distributed names it in ``src``/``dst`` (its global
        rank)."""
        return dist.get_global_rank(self.group, rank)

    def gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (on every rank)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.peer(src), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank when any rank failed (``error``): the rank's own error where it
        failed, else one that names the rank that failed. Collectives after this point are reached
        by all ranks or by none."""
        failed = [
            (r, e)
            for r, e in enumerate(
                self.gather(None if error is None else (type(error).__name__, str(error)))
            )
            if e is not None
        ]
        if error is not None:
            raise error
        if failed:
            r, (kind, message) = failed[0]
            cls = {
                "CheckpointMismatchError": CheckpointMismatchError,
                "FileNotFoundError": FileNotFoundError,
            }.get(kind, RuntimeError)
            raise cls(f"rank {r} failed to {what} ({kind}): {message}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (another user's counts as live)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _restore_moved_aside(save_dir: str, tag: str) -> str | None:
    """A save of an existing tag moves the old folder to ``.<tag>.old-<pid>`` before renaming the
    new one in. A kill between the two renames leaves no ``<tag>`` folder: put the old one
    (complete) back. Returns it."""
    final = os.path.join(save_dir, tag)
    for name in sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []:
        m = _LEFTOVER.match(name)
        if m and m["kind"] == "old" and m["name"] == tag and not _pid_alive(int(m["pid"])):
            try:
                # fails if another process restored it first
                os.rename(os.path.join(save_dir, name), final)
            except OSError:
                continue
            fsync_dir(save_dir)
            warnings.warn(
                f"{final} was missing (a save of tag {tag!r} was killed between its renames): put "
                "back "
                f"the previous checkpoint from {name}",
                stacklevel=3,
            )
            return final
    return None


def clean_stale(save_dir: str) -> list[str]:
    """Remove what saves killed part-way left in ``save_dir`` (``.<tag>.tmp-<pid>`` folders,
    ``.latest.tmp-<pid>`` and ``.<script>.tmp-<pid>`` files, ``.<tag>.old-<pid>`` folders whose tag
    folder exists again -- one whose tag folder is missing is put back instead -- and
    ``.<tag>.del-<pid>`` folders, being removed to make room). Only entries of processes that are no
    longer alive: a running save's files are never touched. Pids are host-local: one host saves into
    a save_dir (as DeepSpeed's rank 0 does). Returns the paths handled."""
    handled = []
    for name in sorted(os.listdir(save_dir)):
        m = _LEFTOVER.match(name)
        if m is None or _pid_alive(int(m["pid"])):
            continue
        path = os.path.join(save_dir, name)
        if m["kind"] == "old" and not os.path.lexists(os.path.join(save_dir, m["name"])):
            if _restore_moved_aside(save_dir, m["name"]):
                handled.append(path)
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:  # another process cleaned it first
                continue
        handled.append(path)
    return handled


def _deepspeed_file(relative: str) -> str | None:
    """A file of the installed deepspeed package, found without importing it (that takes seconds):
    the distribution's files first (whatever ``sys.modules["deepspeed"]`` is), else the package on
    sys.path (an editable install)."""
    try:
        path = str(
            importlib.metadata.distribution("deepspeed").locate_file(f"deepspeed/{relative}")
        )
        if os.path.isfile(path):
            return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("deepspeed")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.isfile(os.path.join(root, relative)):
            return os.path.join(root, relative)
    return None


def _copy_recovery_scripts(save_dir: str) -> None:
    """DeepSpeed puts its ``zero_to_fp32.py`` (and ``zero_to_torch.py``) in every save_dir so that
    the fp32 weights can be recovered without the training code; users and tools expect them there.
    Copied from the installed deepspeed (never vendored), with DeepSpeed's mode (``copyfile`` + the
    owner's exec bit), through a temporary name so that a kill never leaves half a script."""
    for script in RECOVERY_SCRIPTS:
        src = _deepspeed_file(f"utils/{script}")
        if src is None:
            continue
        tmp = os.path.join(save_dir, f".{script}.tmp-{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IEXEC)
        os.replace(tmp, os.path.join(save_dir, script))


def _folder_bytes(path: str) -> int:
    """The disk space the files under ``path`` take (what removing them frees)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def prepare_folder(save_dir: str, tag: str, sizes: list[int]) -> str:
    """Rank 0, before any checkpoint file is written: the leftovers of killed saves removed, the
    free space checked against what the new checkpoint needs (``sizes``: each rank's files, exact),
    the temporary folder made. Returns it. A disk that cannot hold the checkpoint is an OSError
    naming the bytes needed and free, with nothing written. A previous checkpoint of the same tag is
    kept until the new one is complete (``commit_folder``) where the disk holds both; where it holds
    only one, the previous one is removed first (``_drop_previous``)."""
    needed = sum(sizes) + SMALL_FILES_BYTES
    if os.path.isdir(save_dir):
        clean_stale(save_dir)  # (a killed save's folder frees its space)
    free = free_bytes(save_dir)
    if free < needed:
        final = os.path.join(save_dir, tag)
        previous = _folder_bytes(final) if os.path.isdir(final) and not os.path.islink(final) else 0
        if not previous or free + previous < needed:
            also = (
                f"; removing the previous checkpoint of this tag ({previous:,} bytes) would not "
                "make room "
                "either"
                if previous
                else ""
            )
            raise OSError(
                errno.ENOSPC,
                f"save_checkpoint: not enough disk space for checkpoint {tag!r} in "
                f"{os.path.abspath(save_dir)}: it needs {needed:,} bytes ({needed / 2**30:.2f} "
                "GiB: "
                f"{sum(sizes):,} in the files of {len(sizes)} rank(s), {SMALL_FILES_BYTES:,} for "
                "the small "
                f"files beside them), {free:,} bytes ({free / 2**30:.2f} GiB) are free there{also}"
                ". Nothing "
                "was written: the previous checkpoint and 'latest' are as they were. Free space "
                "(older "
                "checkpoints?) or save to another disk",
            )
        _drop_previous(save_dir, tag, needed, free, previous)
    os.makedirs(save_dir, exist_ok=True)
    tmp = os.path.join(save_dir, f".{tag}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _drop_previous(save_dir: str, tag: str, needed: int, free: int, previous: int) -> None:
    """The disk holds the new checkpoint only without the previous one of its tag: remove that one
    first (renamed to ``.<tag>.del-<pid>``, then deleted: a kill part-way leaves a folder
    ``clean_stale`` removes, never half a checkpoint under the tag's name). DeepSpeed overwrites a
    tag in place; this save then has its crash safety: a crash before the commit leaves no
    checkpoint of this tag (the folder is missing, not half written)."""
    latest = os.path.join(save_dir, "latest")
    try:
        with open(latest) as f:
            named = f.read().strip() == tag
    except (OSError, UnicodeDecodeError):
        named = False
    warnings.warn(
        f"save_checkpoint: {os.path.abspath(save_dir)} cannot hold the previous checkpoint of tag "
        f"{tag!r} "
        f"({previous:,} bytes) and the new one ({needed:,} bytes) at once ({free:,} bytes free): "
        "the "
        "previous one is removed before the new one is written, as DeepSpeed overwrites a tag in "
        "place. Until this "
        f"save completes there is no checkpoint {tag!r}"
        + (" (and 'latest' names it)" if named else "")
        + ": a crash now loses it. Saving under a new tag keeps the previous checkpoint while a "
        "save runs",
        stacklevel=5,
    )  # the caller of engine.save_checkpoint
    dropped = os.path.join(save_dir, f".{tag}.del-{os.getpid()}")
    os.replace(os.path.join(save_dir, tag), dropped)
    fsync_dir(save_dir)
    shutil.rmtree(dropped)
    fsync_dir(save_dir)


def small_files_bytes() -> int:
    """The disk ``commit_folder`` writes beside the folder: DeepSpeed's recovery scripts (their new
    copies, made before the old ones go) and ``latest``, each rounded up to a block."""
    scripts = [_deepspeed_file(f"utils/{script}") for script in RECOVERY_SCRIPTS]
    sizes = [os.path.getsize(s) for s in scripts if s is not None] + [_BLOCK]  # + latest
    return sum(-(-n // _BLOCK) * _BLOCK for n in sizes)


def reserve_files(tmp: str, sizes: dict[str, int], tag: str, rank: int) -> None:
    """Every rank, before it writes a byte: each of its files (``sizes``: name in ``tmp`` -> exact
    bytes) created at its final size, its blocks given by the file system (posix_fallocate;
    host/disk_space.py); rank 0 also holds the room for the small files ``commit_folder`` writes
    (``SMALL_FILES_RESERVED``, deleted there). A file system that does not give them is a
    ``DiskSpaceError`` naming the file, the bytes it needs, the rank's total and what the file
    system has; the caller removes the folder (nothing was written)."""
    wanted = dict(sizes)
    if rank == 0:
        wanted[SMALL_FILES_RESERVED] = small_files_bytes()
    for name, nbytes in wanted.items():
        try:
            reserve_file(os.path.join(tmp, name), nbytes)
        except DiskSpaceError as exc:
            save_dir = os.path.dirname(os.path.abspath(tmp))
            raise DiskSpaceError(
                exc.reason,
                path=exc.path,
                needed=exc.needed,
                available=exc.available,
                message=(
                    f"save_checkpoint: not enough disk space for checkpoint {tag!r} in {save_dir}: "
                    f"{exc.reason}; rank "
                    f"{rank}'s files need {byte_count(sum(wanted.values()))} in all. Nothing was "
                    "written: the previous "
                    "checkpoint and 'latest' are as they were. Free space (older checkpoints?) or "
                    "save to another "
                    "disk"
                ),
            ) from None


def commit_folder(save_dir: str, tmp: str, tag: str, save_latest: bool) -> None:
    """Rank 0, once every file is written: the folder into place, the recovery scripts, then
    ``latest``."""
    try:  # the room reserve_files held for the files written below
        os.remove(os.path.join(tmp, SMALL_FILES_RESERVED))
    except FileNotFoundError:
        pass
    fsync_dir(tmp)
    final = os.path.join(save_dir, tag)
    old = None
    # replacing a checkpoint of the same tag: keep it until the new one is in place
    if os.path.exists(final):
        old = os.path.join(save_dir, f".{tag}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    try:
        _copy_recovery_scripts(save_dir)
        if save_latest:
            latest_tmp = os.path.join(save_dir, f".latest.tmp-{os.getpid()}")
            with open(latest_tmp, "w") as f:
                f.write(tag)
                f.flush()
                os.fsync(f.fileno())
            os.replace(latest_tmp, os.path.join(save_dir, "latest"))
    # the folder is in place; what failed is a small file beside it: name it and say so
    except OSError as exc:
        name = getattr(exc, "filename", None) or save_dir
        raise OSError(
            exc.errno,
            f"save_checkpoint: writing {name} failed ({exc.strerror or exc}); the checkpoint "
            f"folder {final} is complete, but {os.path.join(save_dir, 'latest')} may still name "
            "the "
            "previous checkpoint (load it with tag=)",
        ) from exc
    fsync_dir(save_dir)


def checkpoint_path_of(load_dir: str, tag) -> str | None:
    """The folder to load, or None where DeepSpeed loads nothing (no tag and no ``latest``: it
    warns)."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            warnings.warn(
                f"Unable to find latest file at {latest}, if trying to load latest checkpoint "
                "please ensure "
                "this file exists or pass an explicit checkpoint tag when loading a checkpoint.",
                stacklevel=4,
            )  # the caller of engine.load_checkpoint
            return None
        try:
            with open(latest) as f:
                tag = f.read().strip()
        # a corrupted or foreign file: say which, not a codec's message
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{latest} does not hold a tag name (unreadable bytes at offset {exc.start}); it "
                "should "
                f"name a checkpoint folder of {load_dir}: pass tag= to load one explicitly"
            ) from None
        if not tag:
            raise FileNotFoundError(
                f"{latest} is empty: it should name a checkpoint folder of {load_dir}; "
                "pass tag= to load one explicitly"
            )
        origin = f"{latest} names tag {tag!r}"
    else:
        origin = f"tag {tag!r} was asked for"
    path = os.path.join(load_dir, str(tag))
    if not os.path.isdir(path):
        _restore_moved_aside(load_dir, str(tag))
    if not os.path.isdir(path):
        others = (
            sorted(
                n
                for n in os.listdir(load_dir)
                if os.path.isdir(os.path.join(load_dir, n)) and not n.startswith(".")
            )
            if os.path.isdir(load_dir)
            else []
        )
        raise FileNotFoundError(
            f"{origin}, but {path} does not exist (moved or deleted?); checkpoints in "
            f"{load_dir}: {others or 'none'}. Pass tag= to load one of them."
        )
    return path


def free_bytes(path: str) -> int:
    """Bytes a write by this process can still take on the file system of ``path`` (or of its
    nearest existing parent), as statvfs says: ``f_bavail``, for root too (a file system may keep
    its reserved blocks from root: the disk of issue 47 did). The reservation (``reserve_files``) is
    the file system's own answer."""
    return available_bytes(path)
