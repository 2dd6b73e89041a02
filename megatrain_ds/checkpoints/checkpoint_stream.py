"""torch.save's archive written as a stream: a checkpoint file straight from the host state, with no
copy of it first.

``torch.save`` writes an object's tensors from memory, so every tensor must exist whole before the
file is written. A ZeRO-3 checkpoint's big tensors do not: DeepSpeed's fp32 sub-groups span layers,
so a flat group (and each Adam moment) is a concatenation of many layers' host tensors (with N
ranks, of partitions that another rank holds). The save used to collect them in a scratch file of
the checkpoint's folder and ``torch.save`` that: a save needed twice the optimizer file's size on
disk (a 3B model: 33 GB of scratch beside the 33 GB file; issue 38).

Here a tensor of the saved object may be a ``StreamedTensor``: a view of a ``StreamedStorage`` whose
bytes a generator yields, in order, while its record is written (views of the host state, or one
layer's partitions received from its owner rank; checkpoint_partition.py). The file is the archive
torch.save writes:

- ``data.pkl``: the object pickled as torch.save pickles it (protocol 2; a storage is the persistent
  id ``("storage", <dtype>Storage, key, location, numel)``, a tensor
  ``torch._utils._rebuild_tensor_v2`` of it); ``.format_version`` (1), ``.storage_alignment`` (64),
  ``byteorder``, ``data/<key>`` per storage in key order, ``version`` (3), in one folder named after
  the file;
- zip records as PyTorchStreamWriter (miniz) lays them out: stored, each local header padded with an
  ``FB`` extra field so that the data starts on 64 bytes, the CRC-32 and sizes in a data descriptor
  after the data, zip64 fields where a size or an offset reaches 4 GiB, zip64 end records. The same
  header and descriptor sizes as torch's, so torch.load finds every record where it computes it
  (``calculate_storage_offsets``), and reads the file memory-mapped as well; so do DeepSpeed's
  ``load_checkpoint`` and ``zero_to_fp32``.

Every size is known before the first byte is written (``StreamedFile.nbytes``: the save reserves
each file at it, checkpoint_folder.py's ``reserve_files``, and writes into the reserved file). The
bytes go to the file once, front to back, never seeking: SHA-256 (the manifest's, checksums.py) and
CRC-32 (the zip's) run on two threads while the main thread writes the same piece (hashlib, zlib and
write(2) release the GIL on large buffers), so a piece costs the slowest of the three instead of
their sum. The disk writes start while the file is still being written (``Writeback``: a thread
fdatasyncs every ``WRITEBACK_BYTES``), so the closing fsync waits for the tail only, not for the
tens of GB the kernel would otherwise hold dirty. ``SaveTimes`` adds up where a save's seconds went
(producing the chunks, write(2), waiting for the hashes, the closing fsync).
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import hashlib
import io
import os
import pickle
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from collections.abc import Callable, Iterator

import torch

from ..host import available_bytes

# the data of every record starts on a multiple of this (torch's kFieldAlignment,
# .storage_alignment)
ALIGNMENT = 64
PIECE_BYTES = 32 << 20  # bytes handed at once to the hashing threads and to write(2)
# smaller pieces are hashed and written inline (a thread hand-off costs ~50 us)
_THREADED_BYTES = 1 << 20
# the write-back thread asks the disk for the bytes written so far after each this many
WRITEBACK_BYTES = 512 << 20
_U32 = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header (30 bytes)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry (46 bytes)
_FLAGS = 0x0808  # data descriptor follows the data; UTF-8 names (miniz's, as torch writes)
_FORMAT_RECORDS = (
    (".format_version", b"1"),
    (".storage_alignment", str(ALIGNMENT).encode()),
    ("byteorder", sys.byteorder.encode()),
)
_VERSION_RECORD = ("version", b"3\n")  # PyTorchStreamWriter's produced file format version


class StreamedStorage:
    """``numel`` elements of ``dtype`` whose bytes ``chunks()`` yields when the record is written:
    1-D contiguous CPU tensors of ``dtype``, ``numel`` elements in all, in order. A chunk is written
    before the next one is asked for (a producer may reuse its memory then). ``chunks`` is called
    once per write."""

    __slots__ = ("dtype", "numel", "chunks")

    def __init__(
        self, dtype: torch.dtype, numel: int, chunks: Callable[[], Iterator[torch.Tensor]]
    ) -> None:
        self.dtype, self.numel, self.chunks = dtype, int(numel), chunks

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def tensor(self, offset: int = 0, numel: int | None = None) -> StreamedTensor:
        """A 1-D tensor of ``numel`` elements (default: to the end) from element ``offset``."""
        numel = self.numel - offset if numel is None else numel
        if offset < 0 or numel < 0 or offset + numel > self.numel:
            raise ValueError(f"elements [{offset}, {offset + numel}) of a storage of {self.numel}")
        return StreamedTensor(self, offset, numel)


class StreamedTensor:
    """A 1-D tensor of a ``StreamedStorage``: pickled as torch pickles a tensor, so torch.load gives
    a tensor."""

    __slots__ = ("storage", "offset", "_numel")

    def __init__(self, storage: StreamedStorage, offset: int, numel: int) -> None:
        self.storage, self.offset, self._numel = storage, offset, numel

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self._numel])

    def numel(self) -> int:
        return self._numel

    def __reduce_ex__(self, protocol):
        return torch._utils._rebuild_tensor_v2, (
            self.storage,
            self.offset,
            self.shape,
            (1,),
            False,
            collections.OrderedDict(),
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


_STORAGE_TYPES: dict[torch.dtype, type] = {}


def _storage_type(dtype: torch.dtype):
    """``torch.FloatStorage`` for float32 etc.: the class torch.save names in a storage's persistent
    id."""
    if dtype not in _STORAGE_TYPES:
        _STORAGE_TYPES[dtype] = getattr(
            torch, torch.empty(0, dtype=dtype)._typed_storage()._pickle_storage_type()
        )
    return _STORAGE_TYPES[dtype]


class _Pickler(pickle.Pickler):
    """torch.save's pickler (``serialization._save``'s ``persistent_id``), which also knows
    ``StreamedStorage``. ``storages``: every storage met, in key order (key = position)."""

    def __init__(self, buf) -> None:
        super().__init__(buf, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.storages: list = []
        self._keys: dict = {}

    def _key(self, ident, storage) -> str:
        if ident not in self._keys:
            self._keys[ident] = str(len(self.storages))
            self.storages.append(storage)
        return self._keys[ident]

    def persistent_id(self, obj):
        if isinstance(obj, StreamedStorage):
            return (
                "storage",
                _storage_type(obj.dtype),
                self._key(("streamed", id(obj)), obj),
                "cpu",
                obj.numel,
            )
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            key = self._key(storage._cdata, storage)
            return (
                "storage",
                getattr(torch, obj._pickle_storage_type()),
                key,
                torch.serialization.location_tag(storage),
                obj._size(),
            )
        if torch.is_storage(obj):  # an untyped storage pickled on its own
            key = self._key(obj._cdata, obj)
            return (
                "storage",
                torch.serialization.normalize_storage_type(type(obj)),
                key,
                torch.serialization.location_tag(obj),
                obj.nbytes(),
            )
        return None


# ----------------------------------------------------------------------------------- the zip layout
def _zip64(size: int, offset: int) -> list[int]:
    """The zip64 extra field's values: the sizes where the size reaches 4 GiB, the header offset
    where it does."""
    return ([size, size] if size >= _U32 else []) + ([offset] if offset >= _U32 else [])


def _extra(values: list[int]) -> bytes:
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values) if values else b""


def _local_header(name: bytes, size: int, offset: int) -> bytes:
    """The local header of a record of ``size`` bytes whose header starts at ``offset``, padded so
    that the data starts on ``ALIGNMENT`` (PyTorchStreamWriter's ``getPadding``; miniz puts the
    sizes in the zip64 field, with a compressed size of 0 until the descriptor)."""
    z64 = _extra(([size, 0] if size >= _U32 else []) + ([offset] if offset >= _U32 else []))
    start = offset + _LOCAL.size + len(name) + len(z64) + 4
    pad = -start % ALIGNMENT
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return (
        _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra
    )


def _descriptor(crc: int, size: int, offset: int) -> bytes:
    if size >= _U32 or offset >= _U32:
        return struct.pack("<IIQQ", 0x08074B50, crc, size, size)
    return struct.pack("<IIII", 0x08074B50, crc, size, size)


def _central(name: bytes, crc: int, size: int, offset: int) -> bytes:
    extra = _extra(_zip64(size, offset))
    small = _U32 if size >= _U32 else size
    return (
        _CENTRAL.pack(
            0x02014B50,
            0,
            0,
            _FLAGS,
            0,
            0,
            0,
            crc,
            small,
            small,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            _U32 if offset >= _U32 else offset,
        )
        + name
        + extra
    )


def _end(count: int, cd_size: int, cd_offset: int) -> bytes:
    """zip64 end of central directory, its locator, the end of central directory (miniz writes all
    three)."""
    eocd64_offset = cd_offset + cd_size
    return (
        struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count, cd_size, cd_offset
        )
        + struct.pack("<IIQI", 0x07064B50, 0, eocd64_offset, 1)
        + struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(count, 0xFFFF),
            min(count, 0xFFFF),
            min(cd_size, _U32),
            min(cd_offset, _U32),
            0,
        )
    )


# ----------------------------------------------------------------------------------------- one file
class StreamedFile:
    """``obj`` planned as the file ``name`` (its archive folder is the name's stem, as torch.save
    names it): pickled, every record laid out, so ``nbytes`` is the file's exact size before
    anything is written. ``write(path, pool)`` writes it there (once: a ``StreamedStorage``'s chunks
    are produced then)."""

    def __init__(self, obj, name: str) -> None:
        buf = io.BytesIO()
        pickler = _Pickler(buf)
        pickler.dump(obj)
        self.name = name
        prefix = os.path.splitext(name)[0] + "/"
        records = [("data.pkl", buf.getvalue()), *_FORMAT_RECORDS]
        records += [(f"data/{key}", storage) for key, storage in enumerate(pickler.storages)]
        records.append(_VERSION_RECORD)
        self.records = []  # (name in the archive, size, header offset, source)
        offset = 0
        for record, source in records:
            encoded, size = (prefix + record).encode(), _source_bytes(source)
            self.records.append((encoded, size, offset, source))
            offset += (
                len(_local_header(encoded, size, offset)) + size + len(_descriptor(0, size, offset))
            )
        self.cd_offset = offset
        self.cd_size = sum(len(_central(n, 0, s, o)) for n, s, o, _ in self.records)
        self.nbytes = offset + self.cd_size + len(_end(len(self.records), self.cd_size, offset))

    def write(
        self,
        path: str,
        pool: concurrent.futures.Executor,
        drain: bool = False,
        times: SaveTimes | None = None,
    ) -> str:
        """Write the file at ``path``, fsynced; returns the SHA-256 of its bytes. A file already at
        ``path`` (reserved at ``nbytes``: checkpoint_folder.py's ``reserve_files``) is written into,
        not truncated first: its blocks stay allocated. A write that fails is an OSError naming the
        file (and, for a full disk, the bytes needed and free); a KeyboardInterrupt is itself.
        ``drain``: after a failed write, every streamed chunk is still produced (and dropped) before
        the error is raised. ``times``: where the seconds went are added to it."""
        out, times = None, times if times is not None else SaveTimes()
        try:
            with open(path, "r+b" if os.path.exists(path) else "wb") as f:
                writeback = Writeback(f.fileno())
                try:
                    out = StreamWriter(f, pool, drain, times, writeback)
                    self._records(out, times)
                except BaseException:
                    writeback.close(raise_error=False)  # the error in flight is the one to report
                    raise
                # raises the write-back's OSError, if it had one (the fsync below would not)
                writeback.close()
                if out.error is not None:  # (drain: every chunk was produced)
                    raise out.error
                # the layout written is the one the sizes were planned with
                if out.written != self.nbytes:
                    raise AssertionError(
                        f"{path}: wrote {out.written} bytes, planned {self.nbytes}"
                    )
                f.truncate(out.written)  # (a file that was longer before)
                start = time.perf_counter()
                os.fsync(f.fileno())
                times.fsync += time.perf_counter() - start
        except OSError as exc:
            if drain and out is None:  # open failed: the chunks are still produced
                self.drain()
            raise _named(exc, path, self.nbytes) from exc
        times.bytes += out.written
        return out.sha.hexdigest()

    def _records(self, out: StreamWriter, times: SaveTimes) -> None:
        central = []
        for name, size, offset, source in self.records:
            out.write(_local_header(name, size, offset))
            crc = 0
            pieces = _pieces(source)
            while True:
                start = time.perf_counter()
                piece = next(pieces, None)
                times.produce += time.perf_counter() - start
                if piece is None:
                    break
                crc = out.write(piece, crc)
            out.write(_descriptor(crc, size, offset))
            central.append(_central(name, crc, size, offset))
        out.write(b"".join(central) + _end(len(self.records), self.cd_size, self.cd_offset))

    def drain(self) -> None:
        """Produce every streamed chunk without writing it: with N ranks a chunk may be a collective
        (one layer's partitions scattered by its owner), which every rank must reach even when its
        own write failed."""
        for *_, source in self.records:
            if isinstance(source, StreamedStorage):
                for _ in source.chunks():
                    pass


def _source_bytes(source) -> int:
    if isinstance(source, bytes):
        return len(source)
    return source.nbytes if isinstance(source, StreamedStorage) else source.nbytes()


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes (no copy; a tensor on the GPU is copied to the host)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _pieces(source) -> Iterator[memoryview]:
    """A record's bytes in pieces of at most ``PIECE_BYTES``."""
    if isinstance(source, bytes):
        yield memoryview(source)
        return
    if isinstance(source, StreamedStorage):
        chunks, produced = source.chunks(), 0
        for chunk in chunks:
            if chunk.dtype != source.dtype:
                raise TypeError(f"a {source.dtype} storage's producer yielded {chunk.dtype}")
            data = _as_bytes(chunk)
            produced += data.nbytes
            for start in range(0, data.nbytes, PIECE_BYTES):
                yield data[start : start + PIECE_BYTES]
        if produced != source.nbytes:
            raise AssertionError(f"a storage of {source.nbytes} bytes was produced with {produced}")
        return
    storage = source if source.device.type == "cpu" else source.cpu()  # a torch UntypedStorage
    data = _as_bytes(torch.empty(0, dtype=torch.uint8).set_(storage))
    for start in range(0, data.nbytes, PIECE_BYTES):
        yield data[start : start + PIECE_BYTES]


@dataclass(slots=True)
class SaveTimes:
    """Where a save's seconds went, added up over its files: producing the streamed chunks (views,
    conversions, the exchanges between ranks), ``write(2)`` into the page cache, waiting for SHA-256
    / CRC-32 after the write was done (the hashes are the bound when this is large), the closing
    fsync (the disk writes the write-back had not yet finished)."""

    bytes: int = 0
    produce: float = 0.0
    write: float = 0.0
    hash_wait: float = 0.0
    fsync: float = 0.0

    def summary(self, seconds: float, device_to_host: float = 0.0, planning: float = 0.0) -> str:
        """One line: the bytes, the seconds and where they went (``seconds`` the whole save's; the
        rest is the manifest, the ranks agreeing and the folder put in place)."""
        gb, files = self.bytes / 1e9, self.produce + self.write + self.hash_wait + self.fsync
        rest = seconds - device_to_host - planning - files
        size = f"{gb:.2f} GB" if gb >= 1 else f"{self.bytes / 1e6:.1f} MB"
        return (
            f"{size} in {seconds:.1f} s ({gb / max(seconds, 1e-9):.2f} GB/s): device→host "
            f"{device_to_host:.1f} s, planning {planning:.1f} s, producing {self.produce:.1f} s, "
            "write "
            f"{self.write:.1f} s, waiting for the hashes {self.hash_wait:.1f} s, closing fsync "
            f"{self.fsync:.1f} s, "
            f"the rest {rest:.1f} s"
        )


class Writeback:
    """Starts the disk writes of a file while it is still being written: after every
    ``WRITEBACK_BYTES`` written (``wrote``) a thread fdatasyncs the file, so the pages go to the
    disk beside the writing, and the closing fsync waits for the last of them only. (Left to itself
    the kernel holds up to ``vm.dirty_ratio`` of the RAM dirty, tens of GB on a training box, and
    the fsync writes them all at the end.) An fdatasync error is raised by ``close``: the kernel
    reports a write-back error to one fsync of the file only, which may be this thread's. A sync
    asked for is always made, even when ``close`` comes before the thread woke for it (asks that
    come while a sync runs are served by the next one)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending, self.error, self.closed = fd, 0, None, False
        self.asked = False
        self.wake = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name="megatrain-ckpt-writeback", daemon=True
        )
        self.thread.start()

    def wrote(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= WRITEBACK_BYTES:
            self.pending, self.asked = 0, True
            self.wake.set()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if self.asked:
                self.asked = False
                try:
                    os.fdatasync(self.fd)
                except OSError as exc:
                    self.error = exc
                    return
            if self.closed and not self.asked:
                return

    def close(self, raise_error: bool = True) -> None:
        """Stop the thread (after the fdatasync in progress, if any); raise its error unless
        ``raise_error`` is false."""
        self.closed = True
        self.wake.set()
        self.thread.join()
        if raise_error and self.error is not None:
            raise self.error


class StreamWriter:
    """The file being written: every byte goes through ``write`` (SHA-256 of the whole file, the
    CRC-32 of the record it is in, the count). A large piece is hashed on the pool's two threads
    while this thread writes it. ``drain``: an OSError of a write is kept in ``error`` and later
    writes are dropped (the caller raises it once every chunk was produced). ``times`` and
    ``writeback`` (optional): the seconds are added there; the bytes written are told to the
    write-back thread."""

    def __init__(
        self,
        f,
        pool: concurrent.futures.Executor,
        drain: bool = False,
        times: SaveTimes | None = None,
        writeback: Writeback | None = None,
    ) -> None:
        self.f, self.pool, self.drain = f, pool, drain
        self.times, self.writeback = times if times is not None else SaveTimes(), writeback
        self.sha, self.written, self.error = hashlib.sha256(), 0, None

    def write(self, data, crc: int = 0) -> int:
        """Write ``data`` (bytes-like); returns the CRC-32 continued from ``crc``."""
        if self.error is not None:
            return crc
        try:
            return self._write(data, crc)
        except OSError as exc:
            if not self.drain:
                raise
            self.error = exc
            return crc

    def _write(self, data, crc: int) -> int:
        n = memoryview(data).nbytes
        if n < _THREADED_BYTES:
            self.sha.update(data)
            crc = zlib.crc32(data, crc)
            start = time.perf_counter()
            self.f.write(data)
            self.times.write += time.perf_counter() - start
        else:
            sha = self.pool.submit(self.sha.update, data)
            crc_done = self.pool.submit(zlib.crc32, data, crc)
            start = time.perf_counter()
            try:
                self.f.write(data)
                written = time.perf_counter()
                self.times.write += written - start
            finally:  # the threads read ``data``: it must outlive them, whatever the write raised
                sha.result()
                crc = crc_done.result()
            self.times.hash_wait += time.perf_counter() - written
        self.written += n
        if self.writeback is not None:
            self.writeback.wrote(n)
        return crc


def _named(exc: OSError, path: str, nbytes: int) -> OSError:
    """An OSError of a checkpoint file's write, naming the file (write(2)'s errors name none)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = available_bytes(os.path.dirname(path) or ".")
        return OSError(
            exc.errno,
            f"save_checkpoint: the disk is full writing {path}: it needs about "
            f"{nbytes / 2**30:.2f} GiB ({nbytes:,} bytes), {free / 2**30:.2f} GiB are free there. "
            "This "
            "save is abandoned (its folder removed); the previous checkpoint and 'latest' are "
            "intact. Free "
            "space or save to another disk",
        )
    return OSError(
        exc.errno,
        f"save_checkpoint: writing {path} failed: {exc.strerror or exc}. This save is "
        "abandoned (its folder removed); the previous checkpoint and 'latest' are intact",
    )


def write_files(
    files: list[StreamedFile], folder: str, drain: bool = False, times: SaveTimes | None = None
) -> dict[str, str]:
    """Write ``files`` into ``folder``; returns {file name: SHA-256}. ``drain``: after a failed
    write, produce the remaining chunks anyway (with N ranks they are collectives every rank must
    reach), then raise. ``times``: where the seconds went are added to it."""
    digests, error = {}, None
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="megatrain-ckpt-hash") as pool:
        for f in files:
            if error is not None:
                f.drain()
                continue
            try:
                digests[f.name] = f.write(os.path.join(folder, f.name), pool, drain, times)
            except OSError as exc:
                if not drain:
                    raise
                error = exc
    if error is not None:
        raise error
    return digests
