"""The NVMe tier: the Adam moments of the trailing streamed layers live in a file under DeepSpeed's
``nvme_path``.

Which state goes to disk. A streamed layer's fp32 Adam moments (``exp_avg``, ``exp_avg_sq``: 8 of
the 16 host bytes per trained parameter) are touched once per optimizer step, by that layer's
update, and by nothing on the training path else: the forward streams the wire copy, the backward
lands gradients. So they are the state that can leave RAM at the cost of one read and one write per
step. The gradients stay in RAM (the landings write them during the backward). The masters stay in
RAM too, unless ``offload_param.device`` is nvme as well (``NvmeSettings.masters``): then each disk
layer's fp32 master joins its moments in the same region, read and written with them by the update,
which refreshes the layer's bf16 wire copy (in RAM: it is what streams) from it.

Which layers. A *suffix* of the layers this process holds (``HostLayerStore(disk_from=...)``): the
RAM moments buffer is then the same flat buffer as without the tier, cut short, so the GPU-held
leading layers (device_state.py) and every RAM layer keep their offsets. The trailing layers are
also the right ones: after the norm the updates run in forward order, so the disk layers' reads have
the RAM layers' updates to hide behind; with speculation (speculation.py) the trailing layers are
updated first, during the backward.

How. One file, ``<nvme_path>/megatrain_ds_swap/rank<r>-<pid>/moments.swp``, preallocated at start-up
by the file system itself (posix_fallocate, disk_space.py: a disk too small fails there, with the
numbers, not mid-step), one region per disk layer: ``[exp_avg | exp_avg_sq]`` (``[exp_avg |
exp_avg_sq | master]`` with masters), each part padded to 4 KiB (O_DIRECT). ``buffer_count`` staging
buffers (DeepSpeed's ``offload_optimizer.buffer_count``) in RAM form a write-back cache of layer
regions:

- ``acquire(i)`` hands the optimizer layer i's moments in a staging buffer (reading them if they are
  not there yet; a read already in flight is waited for), ``release(i, dirty)`` writes them back
  behind it (``pipeline_write``; synchronously otherwise);
- ``expect(order)`` names the layers the optimizer will acquire next: their reads are issued as
  buffers free up (``pipeline_read``; otherwise each read happens at its ``acquire``).

The reads and writes go through DeepSpeed's async I/O op (``AsyncIOBuilder``, libaio) where it
builds and the ``aio`` block's settings, or a thread pool over an ``O_DIRECT`` file otherwise
(``megatrain.nvme_backend``: "auto" tries the op first). Values are copied bit for bit, so training
with the tier equals training without it.
"""

from __future__ import annotations

import errno
import os
import shutil
import itertools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .disk_space import DiskSpaceError, available_bytes, reserve_file
from .host_memory import HostRegion

# O_DIRECT wants buffer addresses, sizes and file offsets aligned to the device's block size
ALIGN = 4096
SWAP_DIR = "megatrain_ds_swap"


class NvmeError(RuntimeError):
    """The NVMe tier cannot be set up (bad ``nvme_path``) or an I/O failed."""


def align(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def layer_disk_bytes(n_train: int, masters: bool = False) -> int:
    """Bytes a disk layer's region takes in the swap file (and in one staging buffer): two padded
    fp32 moments, and with ``masters`` its padded fp32 master (trainable elements) after them."""
    return (3 if masters else 2) * align(4 * n_train)


@dataclass(kw_only=True)
class NvmeSettings:
    """``zero_optimization.offload_optimizer`` with ``device: nvme``, and the ``aio`` block
    (DeepSpeed's parse)."""

    nvme_path: str
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    # deepspeed.runtime.swap_tensor.aio_config.get_aio_config
    aio: dict = field(default_factory=dict)
    # offload_param.device nvme as well: the disk layers' fp32 masters join their moments
    masters: bool = False


def free_bytes(path: str) -> int:
    """Bytes this process may still put on ``path``'s filesystem as statvfs says (``f_bavail``:
    root's reserved blocks are not counted; a hook for tests). The swap file's reservation is the
    file system's own answer."""
    return available_bytes(path)


def check_path(path: str, needed: int) -> None:
    """``nvme_path`` exists, is a writable directory and has room for ``needed`` bytes: else
    ``NvmeError`` with the numbers, before anything is built."""
    where = "zero_optimization.offload_optimizer.nvme_path"
    if not path:
        raise NvmeError(
            f"{where} is not set: offload_optimizer.device=nvme needs a folder on a fast local disk"
        )
    if not os.path.exists(path):
        raise NvmeError(f"{where}={path!r} does not exist (create it on the NVMe drive first)")
    if not os.path.isdir(path):
        raise NvmeError(f"{where}={path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeError(f"{where}={path!r} is not writable by this process (uid {os.getuid()})")
    free = free_bytes(path)
    if needed > free:
        raise NvmeError(
            f"{where}={path!r} has {free / 2**30:.2f} GiB free; the layers placed on disk (their "
            "Adam "
            f"moments, and masters with offload_param nvme) need {needed / 2**30:.2f} GiB "
            f"({needed:,} "
            f"bytes, {free:,} free: statvfs f_bavail). Free space there, point nvme_path at a "
            "larger disk, "
            "or keep more layers in RAM (megatrain.nvme_layers / megatrain.host_memory_budget)"
        )


def _byte_view(t: torch.Tensor):
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class _ThreadIO:
    """Positional reads and writes of one file from a thread pool (``os.preadv``/``os.pwritev`` drop
    the GIL), in ``chunk``-byte pieces so several requests are in flight at once; ``O_DIRECT`` where
    the filesystem takes it (no page-cache copy: the RAM the tier saves stays saved)."""

    name = "threads"

    def __init__(self, path: str, threads: int, chunk: int) -> None:
        self.chunk = max(align(chunk), ALIGN)
        self.direct = hasattr(os, "O_DIRECT")
        self.fd = self._open(path)
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="megatrain-nvme")
        if self.direct and not self._probe():
            os.close(self.fd)
            self.direct = False  # e.g. tmpfs, or a filesystem that rejects O_DIRECT at I/O time
            self.fd = self._open(path)

    def _open(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        try:
            return os.open(path, flags, 0o600)
        except OSError as exc:
            if self.direct and exc.errno == errno.EINVAL:
                self.direct = False
                return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            raise

    def _probe(self) -> bool:
        """One aligned 4 KiB write and read-back at offset 0 (the file is preallocated and not in
        use yet)."""
        region = HostRegion(ALIGN, torch.uint8, pin=False)
        try:
            os.pwritev(self.fd, [_byte_view(region.tensor)], 0)
            os.preadv(self.fd, [_byte_view(region.tensor)], 0)
            return True
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise

    def _piece(self, write: bool, buf: torch.Tensor, offset: int) -> None:
        view, done = _byte_view(buf), 0
        while done < len(view):
            fn = os.pwritev if write else os.preadv
            n = fn(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(
                    errno.EIO, f"short {'write' if write else 'read'} at offset {offset + done}"
                )
            done += n

    def submit(self, write: bool, buf: torch.Tensor, offset: int) -> list[Future]:
        return [
            self.pool.submit(self._piece, write, buf[a : a + self.chunk], offset + a)
            for a in range(0, buf.numel(), self.chunk)
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)


class _AioIO:
    """DeepSpeed's async I/O op (libaio): one handle and one submitting thread for reads, one for
    writes; each request is one ``sync_pread``/``sync_pwrite`` that the op splits into
    ``block_size`` pieces, ``queue_depth`` deep, over ``intra_op_parallelism`` threads of its
    own."""

    name = "deepspeed-aio"

    def __init__(self, path: str, aio: dict) -> None:
        # raises / fails to build without libaio
        from deepspeed.ops.op_builder import AsyncIOBuilder

        op = AsyncIOBuilder().load(verbose=False)
        make = lambda: op.aio_handle(  # noqa: E731
            block_size=aio["block_size"],
            queue_depth=aio["queue_depth"],
            single_submit=aio["single_submit"],
            overlap_events=aio["overlap_events"],
            intra_op_parallelism=aio["intra_op_parallelism"],
        )
        self.read_handle, self.write_handle = make(), make()
        self.path = path
        self.readers = ThreadPoolExecutor(1, thread_name_prefix="megatrain-aio-read")
        self.writers = ThreadPoolExecutor(1, thread_name_prefix="megatrain-aio-write")

    def _run(self, write: bool, buf: torch.Tensor, offset: int) -> None:
        handle = self.write_handle if write else self.read_handle
        fn = handle.sync_pwrite if write else handle.sync_pread
        if fn(buf, self.path, offset) < 0:
            raise OSError(
                errno.EIO,
                f"DeepSpeed aio {'write' if write else 'read'} of {buf.numel()} bytes at "
                f"offset {offset} in {self.path} failed",
            )

    def submit(self, write: bool, buf: torch.Tensor, offset: int) -> list[Future]:
        return [(self.writers if write else self.readers).submit(self._run, write, buf, offset)]

    def close(self) -> None:
        self.readers.shutdown(wait=True)
        self.writers.shutdown(wait=True)


def open_backend(path: str, settings: NvmeSettings, choice: str):
    """``choice``: "aio" (DeepSpeed's op, required), "threads", or "auto" (the op when it builds and
    loads)."""
    aio = settings.aio
    if choice in ("aio", "auto"):
        try:
            return _AioIO(path, aio)
        # no libaio, no compiler, CPU-only build: any failure
        except Exception as exc:  # noqa: BLE001
            if choice == "aio":
                raise NvmeError(
                    f"megatrain.nvme_backend=aio: DeepSpeed's async I/O op did not load ({exc}); "
                    "use "
                    "\"threads\" or \"auto\""
                ) from exc
    threads = max(1, int(aio.get("intra_op_parallelism", 1)) * int(aio.get("queue_depth", 8)))
    return _ThreadIO(path, threads, int(aio.get("block_size", 1 << 20)))


class _Buffer:
    __slots__ = ("tensor", "layer", "state", "pending", "used", "error", "prefetched", "wanted")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # uint8, capacity of the largest disk layer's region
        self.layer: int | None = None
        self.state = "free"  # free | reading | ready | busy | writing
        self.pending: list[Future] = []
        self.used = 0  # LRU clock
        self.error: BaseException | None = None
        # read ahead for a layer ``expect`` named, not acquired yet: evicted last
        self.prefetched = False
        self.wanted = False  # an ``acquire`` waits for this buffer's layer: never evicted


class NvmeMoments:
    """Adam moments of the disk layers: the swap file and its staging buffers (module docstring).

    Thread safety: ``acquire``/``release`` from one thread at a time per layer (the AdamW thread
    during training; the main thread for checkpoints, after ``engine.synchronize()``); ``expect``
    from any thread."""

    def __init__(
        self, n_train: dict[int, int], settings: NvmeSettings, rank: int = 0, backend: str = "auto"
    ) -> None:
        self.n_train = dict(n_train)
        self.settings = settings
        self.offset: dict[int, int] = {}
        total = 0
        for i in sorted(self.n_train):
            self.offset[i] = total
            total += layer_disk_bytes(self.n_train[i], settings.masters)
        self.file_bytes = total
        self.region_bytes = max(
            (layer_disk_bytes(n, settings.masters) for n in self.n_train.values()), default=0
        )
        check_path(settings.nvme_path, total)
        _clean_stale(os.path.join(settings.nvme_path, SWAP_DIR))
        # one folder per tier (engine), not per process: a policy and a reference engine in one
        # process on the same nvme_path each get their own file (the pid stays last: _clean_stale
        # reads it)
        self.folder = os.path.join(
            settings.nvme_path, SWAP_DIR, f"rank{rank}-{next(_TIER_IDS)}-{os.getpid()}"
        )
        os.makedirs(self.folder, exist_ok=True)
        self.path = os.path.join(self.folder, "moments.swp")
        self._finalizer = weakref.finalize(self, _remove_folder, self.folder)
        # every block up front, given by the file system: a disk that cannot hold them fails here,
        # not mid-step
        try:
            reserve_file(self.path, max(total, ALIGN), mode=0o600)
        except OSError as exc:
            _remove_folder(self.folder)
            if not isinstance(exc, DiskSpaceError):
                raise NvmeError(
                    f"NVMe tier: cannot create {self.path}: {exc.strerror or exc}"
                ) from exc
            raise NvmeError(
                f"NVMe tier: cannot allocate the state of the layers placed on disk (their Adam "
                "moments, "
                f"and masters with offload_param nvme): {exc.reason}. Free space there, "
                "point zero_optimization.offload_optimizer.nvme_path at a larger disk, or keep "
                "more layers "
                "in RAM (megatrain.nvme_layers / megatrain.host_memory_budget)"
            ) from exc
        self.io = open_backend(self.path, settings, backend)
        count = max(2, int(settings.buffer_count))  # one being updated, one being written or read
        self.staging = [HostRegion(self.region_bytes, torch.uint8, pin=False) for _ in range(count)]
        self.buffers = [_Buffer(r.tensor) for r in self.staging]
        self.lock = threading.Condition()
        self.queue: list[int] = []  # layers the optimizer will acquire next (expect)
        self.clock = 0
        self.broken: NvmeError | None = None
        # acquire() calls waiting for a buffer to free up (they come before the read-ahead)
        self.starved = 0
        self.reads = self.writes = 0  # requests, for tests and the breakdown
        self.read_bytes = self.written_bytes = 0

    # --- views ------------------------------------------------------------------------------------
    def _parts(self, buf: _Buffer, i: int) -> tuple[torch.Tensor, ...]:
        """(exp_avg, exp_avg_sq), and the master with ``settings.masters``: fp32 views of the
        layer's region."""
        n, part = self.n_train[i], align(4 * self.n_train[i])
        flat = buf.tensor
        return tuple(
            flat[k * part : k * part + 4 * n].view(torch.float32)
            for k in range(3 if self.settings.masters else 2)
        )

    def _region(self, buf: _Buffer, i: int) -> torch.Tensor:
        return buf.tensor[: layer_disk_bytes(self.n_train[i], self.settings.masters)]

    def staging_bytes(self) -> int:
        return len(self.buffers) * self.region_bytes

    @property
    def backend(self) -> str:
        name = self.io.name
        return name + (
            " (O_DIRECT)"
            if getattr(self.io, "direct", False)
            else " (buffered: the filesystem refused O_DIRECT)"
            if name == "threads"
            else ""
        )

    # --- the cache (all under self.lock) ----------------------------------------------------------
    def _find(self, i: int) -> _Buffer | None:
        return next((b for b in self.buffers if b.layer == i), None)

    def _start(self, buf: _Buffer, i: int, write: bool) -> None:
        buf.state, buf.error = ("writing" if write else "reading"), None
        futures = self.io.submit(write, self._region(buf, i), self.offset[i])
        buf.pending = futures
        nbytes = layer_disk_bytes(self.n_train[i], self.settings.masters)
        if write:
            self.writes, self.written_bytes = self.writes + 1, self.written_bytes + nbytes
        else:
            self.reads, self.read_bytes = self.reads + 1, self.read_bytes + nbytes
        remaining = [len(futures)]

        def finished(fut: Future) -> None:
            with self.lock:
                if fut.exception() is not None and buf.error is None:
                    buf.error = fut.exception()
                remaining[0] -= 1
                if remaining[0] == 0:
                    buf.pending = []
                    buf.state = "ready"
                    if buf.error is not None and self.broken is None:  # every later call raises it
                        self.broken = NvmeError(
                            f"NVMe tier: {'writing' if write else 'reading'} layer {i}'s "
                            f"moments in {self.path} failed: {buf.error}"
                        )
                    self.lock.notify_all()
                    if self.broken is None:
                        self._pump()

        for fut in futures:
            fut.add_done_callback(finished)

    def _check(self) -> None:
        """An I/O failed: the moments on disk or in a buffer cannot be trusted, so nothing goes
        on."""
        if self.broken is not None:
            raise self.broken

    def _victim(self, keep: set[int], take_prefetched: bool = False) -> _Buffer | None:
        """A buffer that may be reused now: free, or holding a clean layer not named in ``keep``
        that no one is waiting to use (least recently used first); ``take_prefetched`` (an acquire
        that found nothing else): a read-ahead layer too, as a last resort. None when every buffer
        is busy, in flight or kept."""
        free = [b for b in self.buffers if b.state == "free"]
        if free:
            return free[0]
        clean = [
            b
            for b in self.buffers
            if b.state == "ready" and b.layer not in keep and not b.prefetched and not b.wanted
        ]
        if not clean and take_prefetched:
            clean = [b for b in self.buffers if b.state == "ready" and not b.wanted]
        return min(clean, key=lambda b: b.used) if clean else None

    def _pump(self) -> None:
        """Issue reads for the expected layers while buffers can be had without evicting one still
        expected."""
        if not self.settings.pipeline_read:
            return
        while self.queue and not self.starved:
            i = self.queue[0]
            cached = self._find(i)
            # already here (or on its way): keep it for the update that expects it
            if cached is not None:
                cached.prefetched = cached.state != "busy"
                self.queue.pop(0)
                continue
            buf = self._victim(keep=set(self.queue))
            if buf is None:
                return
            self.queue.pop(0)
            buf.layer, buf.prefetched = i, True
            self._start(buf, i, write=False)

    def expect(self, order) -> None:
        """The optimizer will acquire these disk layers next, in this order (layers not on disk are
        ignored)."""
        with self.lock:
            self.queue = [i for i in order if i in self.n_train]
            expected = set(self.queue)
            # read ahead for a plan that changed (a speculation closed): free to evict
            for buf in self.buffers:
                if buf.prefetched and buf.layer not in expected:
                    buf.prefetched = False
            self._pump()

    def acquire(self, i: int, read: bool = True) -> tuple[torch.Tensor, ...]:
        """Layer i's moments (exp_avg, exp_avg_sq) and, with ``settings.masters``, its master: fp32,
        in a staging buffer held for the caller until ``release``. ``read=False``: the caller
        overwrites every part (a checkpoint load, the first write of a layer), nothing is read."""
        with self.lock:
            if i in self.queue:
                self.queue.remove(i)
            while True:
                buf = self._find(i)
                if buf is not None and buf.state in ("reading", "writing"):
                    # not evicted between its completion and this thread's wake-up
                    buf.wanted = True
                    # its read lands, or its last write must finish before it changes again
                    self.lock.wait()
                    continue
                self._check()
                if buf is not None:
                    break
                in_flight = any(b.state in ("reading", "writing") for b in self.buffers)
                # a buffer read ahead for a later update is taken only when waiting would not free
                # another one
                victim = self._victim(keep=set(), take_prefetched=not in_flight)
                if victim is None:
                    self.starved += 1  # the pump leaves the next freed buffer to this thread
                    try:
                        self.lock.wait()
                    finally:
                        self.starved -= 1
                    continue
                # not evicted before it is taken
                victim.layer, victim.prefetched, victim.wanted = i, False, True
                if read:
                    self._start(victim, i, write=False)
                    continue
                victim.state = "ready"
                buf = victim
                break
            if buf.state == "busy":
                raise RuntimeError(f"NVMe tier: layer {i}'s moments are acquired twice")
            buf.state, buf.prefetched, buf.wanted = "busy", False, False
            self.clock += 1
            buf.used = self.clock
            return self._parts(buf, i)

    def release(self, i: int, dirty: bool) -> None:
        """The caller is done with layer i's moments; ``dirty``: they changed, write them back
        (behind the caller with ``pipeline_write``, before returning otherwise)."""
        with self.lock:
            buf = self._find(i)
            if buf is None or buf.state != "busy":
                raise RuntimeError(
                    f"NVMe tier: layer {i}'s moments released without being acquired"
                )
            if not dirty:
                buf.state = "ready"
                self.lock.notify_all()
                self._pump()
                return
            self._start(buf, i, write=True)
            if self.settings.pipeline_write:
                return
            while buf.state == "writing":
                self.lock.wait()
            self._check()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every write in flight (and read), raising the first I/O error; with ``timeout``
        (s), an ``NvmeError`` naming what is still in flight once it has passed (at exit: the I/O
        threads may be gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while any(b.state in ("reading", "writing") for b in self.buffers):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    busy = [
                        f"layer {b.layer} {b.state}"
                        for b in self.buffers
                        if b.state in ("reading", "writing")
                    ]
                    raise NvmeError(
                        f"NVMe tier: {', '.join(busy)} still in flight after {timeout:.0f} s "
                        f"({self.path})"
                    )
                self.lock.wait(left)
            self._check()

    def read(self, i: int) -> tuple[torch.Tensor, ...]:
        """Copies of layer i's parts (``acquire``'s order; checkpoints,
        ``safe_get_full_optimizer_state``)."""
        parts = self.acquire(i)
        try:
            return tuple(t.clone() for t in parts)
        finally:
            self.release(i, dirty=False)

    def write(
        self,
        i: int,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
        master: torch.Tensor | None = None,
        flush: bool = True,
    ) -> None:
        """Overwrite layer i's parts (None: kept as they are) and, with ``flush``, wait until they
        are on disk."""
        given = (exp_avg, exp_avg_sq, master)[: 3 if self.settings.masters else 2]
        if master is not None and not self.settings.masters:
            raise RuntimeError(
                "NVMe tier: the masters are not on disk (offload_param.device is not nvme)"
            )
        parts = self.acquire(i, read=any(t is None for t in given))
        try:
            for dst, src in zip(parts, given):
                if src is not None:
                    dst.copy_(src.reshape(-1))
        finally:
            self.release(i, dirty=True)
        if flush:
            self.flush()

    def close(self, timeout: float | None = None) -> None:
        """Wait for the writes in flight (at most ``timeout`` s), close the file and delete the swap
        folder (idempotent; the folder goes even when the wait fails)."""
        if self.io is None:
            return
        try:
            self.flush(timeout)
        finally:
            io, self.io = self.io, None
            io.close()
            self._finalizer()


_TIER_IDS = itertools.count()


def _remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    try:  # the swap root too, once no tier (of any process) uses it
        os.rmdir(os.path.dirname(folder))
    except OSError:
        pass


def _clean_stale(root: str) -> None:
    """Remove swap folders left by processes that no longer run (a crash skips the cleanup at
    exit)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        pid = name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove_folder(os.path.join(root, name))
        except PermissionError:  # another user's live process
            pass
