"""A save needs the disk of the checkpoint it writes, no more (issue 38: a 3B save needed a 33 GB
scratch file beside its 33 GB optimizer file, and failed on a disk where DeepSpeed's save fitted).

The files are streamed from the host state (checkpoint_stream.py); the free space is checked against
their exact size before anything is written; crash safety and checksums are as before. Fast CPU
tests: a 4-layer Llama with frozen norms and DeepSpeed sub-groups that span layers (the case that
used to need the scratch copy).
"""

import concurrent.futures
import errno
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import transformers

import megatrain_ds
from megatrain_ds.checkpoints import checkpoint_folder, checkpoint_stream
from megatrain_ds.checkpoints.checkpoint import MODEL_FILE, OPTIM_FILE
from tests.fault_driver import FullDisk
from tests.fork_launch import warm_run

HERE = Path(__file__).resolve().parents[1]  # tests/
CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "sub_group_size": 30000,
    },
}


def _model(seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            tie_word_embeddings=False,
        )
    )
    for layer in model.model.layers:
        layer.input_layernorm.requires_grad_(False)  # frozen: streamed as ZeRO-3 frozen fragments
    return model


def _engine(seed=0):
    model = _model(seed)
    engine, *_ = megatrain_ds.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=CFG
    )
    return engine


def _train(engine, first, steps):
    losses = []
    for step in range(first, first + steps):
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(engine):
    """Masters, moments and counters, copied."""
    engine.sync_masters_to_host()
    return {
        "masters": {k: v.clone() for k, v in engine.master_state_dict().items()},
        "exp_avg": engine.store.exp_avg.clone(),
        "exp_avg_sq": engine.store.exp_avg_sq.clone(),
        "resident": [
            None if m is None else (m.clone(), v.clone())
            for m, v in zip(engine.resident.exp_avg, engine.resident.exp_avg_sq)
        ],
        "counters": (engine.global_steps, engine.micro_steps, engine.optimizer.step_count),
    }


def _assert_same(a, b):
    assert a["masters"].keys() == b["masters"].keys()
    assert all(torch.equal(a["masters"][k], b["masters"][k]) for k in a["masters"])
    assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    for x, y in zip(a["resident"], b["resident"]):
        assert (x is None) == (y is None) and (
            x is None or all(torch.equal(p, q) for p, q in zip(x, y))
        )
    assert a["counters"] == b["counters"]


def _disk(folder, skip=()) -> int:
    """Disk space taken by the files under ``folder`` (allocated blocks), leaving out the folders in
    ``skip``."""
    total = 0
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# -------------------------------------------------------------------------------- the disk it takes
class _Measured:
    """A file opened for writing whose every write is followed by a measure of the disk the save
    folder takes."""

    def __init__(self, f, measure) -> None:
        self._f, self._measure = f, measure

    def write(self, data):
        n = self._f.write(data)
        # the bytes reach the file system (its blocks are allocated as they are written)
        self._f.flush()
        self._measure()
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_a_save_takes_no_disk_beyond_the_checkpoint_it_writes(tmp_path, monkeypatch):
    """Measured at every write of every file the save writes (``open`` wrapped; whatever writes
    them): the disk the save folder takes beyond the previous checkpoint never exceeds the new
    checkpoint's final size by more than 10%. (It was twice that: the optimizer state's scratch
    copy, mapped, beside the file torch.save wrote from it.)"""
    import builtins

    engine = _engine()
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path))  # global_step1, the previous checkpoint
    _train(engine, 1, 1)
    previous = str(tmp_path / "global_step1")
    peak, real_open = {"bytes": 0, "writes": 0}, builtins.open

    def measure():
        peak["bytes"] = max(peak["bytes"], _disk(tmp_path, skip={previous}))
        peak["writes"] += 1

    def measured_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return (
            _Measured(f, measure)
            if any(c in mode for c in "wax+") and not isinstance(file, int)
            else f
        )

    before = _disk(tmp_path, skip={previous})
    monkeypatch.setattr(builtins, "open", measured_open)
    engine.save_checkpoint(str(tmp_path))
    monkeypatch.undo()
    written = _disk(tmp_path / "global_step2")
    assert peak["writes"] > 20 and written > 500_000
    assert peak["bytes"] - before <= 1.10 * written, (peak, before, written)
    engine.destroy()


# ----------------------------------------------------------------------------------- the free space
def _needed(engine, tmp_path, monkeypatch) -> int:
    """The bytes a save of ``engine`` asks the disk for (its planned files and the small ones beside
    them)."""
    asked = {}

    def free(path):
        asked["path"] = path
        return 0

    monkeypatch.setattr(checkpoint_folder, "free_bytes", free)
    with pytest.raises(OSError) as err:
        engine.save_checkpoint(str(tmp_path / "probe"))
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC and asked["path"] == str(tmp_path / "probe")
    return int(str(err.value).split("it needs ")[1].split(" bytes")[0].replace(",", ""))


def test_a_disk_too_small_for_the_checkpoint_is_refused_before_anything_is_written(
    tmp_path, monkeypatch
):
    """Free space below what the checkpoint needs: an OSError naming both byte counts, raised before
    any file is opened; the previous checkpoint and ``latest`` as they were. Free space equal to the
    checkpoint (not twice it): the save succeeds."""
    engine = _engine()
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path))
    want = _state(engine)
    _train(engine, 1, 1)
    needed = _needed(engine, tmp_path, monkeypatch)
    opened = []
    monkeypatch.setattr(
        checkpoint_stream.StreamedFile, "write", lambda self, path, *a, **k: opened.append(path)
    )
    monkeypatch.setattr(checkpoint_folder, "free_bytes", lambda path: needed - 1)
    listing = sorted(os.listdir(tmp_path))
    where = re.escape(str(tmp_path))
    with pytest.raises(
        OSError,
        match=rf"not enough disk space for checkpoint 'global_step2' in {where}: it needs "
        rf"{needed:,} bytes \(.* GiB: .* rank\(s\), .*\), {needed - 1:,} bytes .* are "
        r"free there\. Nothing was written: the previous checkpoint and 'latest' are as "
        "they were",
    ):
        engine.save_checkpoint(str(tmp_path))
    assert opened == [] and sorted(os.listdir(tmp_path)) == listing
    assert (tmp_path / "latest").read_text() == "global_step1"
    other = _engine(seed=1)
    other.load_checkpoint(str(tmp_path))
    _assert_same(_state(other), want)
    monkeypatch.undo()
    # exactly the checkpoint's bytes free: it fits (the new files stream in place of a scratch copy)
    monkeypatch.setattr(checkpoint_folder, "free_bytes", lambda path: needed)
    engine.save_checkpoint(str(tmp_path))
    files = _disk(tmp_path / "global_step2")
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert needed - checkpoint_folder.SMALL_FILES_BYTES <= files <= needed
    engine.destroy(), other.destroy()


def test_a_tag_the_disk_holds_only_once_replaces_the_previous_one(tmp_path, monkeypatch):
    """Saving a tag again where the disk holds one copy of it but not two: the previous one is
    removed first, with a warning (DeepSpeed overwrites a tag in place; crash safety for that tag is
    then lost during this save), and the save succeeds. Where even that would not make room:
    refused, the previous one intact."""
    engine = _engine()
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="last")
    old = _disk(tmp_path / "last")
    _train(engine, 1, 1)
    needed = _needed(engine, tmp_path, monkeypatch)
    monkeypatch.setattr(checkpoint_folder, "free_bytes", lambda path: needed - old - 1)
    with pytest.raises(
        OSError,
        match=rf"removing the previous checkpoint of this tag \({old:,} bytes\) would not "
        "make room either",
    ):
        engine.save_checkpoint(str(tmp_path), tag="last")
    assert _disk(tmp_path / "last") == old
    monkeypatch.setattr(checkpoint_folder, "free_bytes", lambda path: needed - old // 2)
    with pytest.warns(
        UserWarning,
        match=r"cannot hold the previous checkpoint of tag 'last' .* the previous one is "
        r"removed before the new one is written.*\(and 'latest' names it\)",
    ):
        engine.save_checkpoint(str(tmp_path), tag="last")
    want = _state(engine)
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".py")) == ["last", "latest"]
    other = _engine(seed=1)
    other.load_checkpoint(str(tmp_path))
    _assert_same(_state(other), want)
    engine.destroy(), other.destroy()


# -------------------------------------------------------------------------------- faults and resume
def test_a_full_disk_mid_save_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path):
    """The fault driver's full disk (tests/fault_driver.py: every file opened for writing, and every
    fallocate, spends one byte budget) with room for half the optimizer file: its reservation is
    refused before a byte is written, an OSError naming it; the previous checkpoint loads equal to
    what was saved; a save once the disk has room resumes exactly: the loaded state, and two more
    steps, as the engine that saved. (A disk that fills up while a file is written: the two-rank
    test below.)"""
    engine = _engine()
    _train(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path))
    want = _state(engine)
    _train(engine, 2, 1)
    with FullDisk(
        os.path.getsize(tmp_path / "global_step2" / MODEL_FILE)
        + os.path.getsize(tmp_path / "global_step2" / OPTIM_FILE) // 2
    ) as disk:
        with pytest.raises(
            OSError,
            match=rf"not enough disk space for checkpoint 'global_step3' in .*: the file "
            rf"system refused to reserve [\d,]+ bytes .* for {re.escape(str(tmp_path))}/"
            rf"\.global_step3\.tmp-\d+/{OPTIM_FILE} \(No space left on device\)",
        ):
            engine.save_checkpoint(str(tmp_path))
    assert disk.failed_path.endswith(OPTIM_FILE)
    assert (tmp_path / "latest").read_text() == "global_step2"
    # the unfinished folder is removed
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []
    other = _engine(seed=1)
    other.load_checkpoint(str(tmp_path))
    _assert_same(_state(other), want)
    engine.save_checkpoint(str(tmp_path))  # global_step3, the disk has room again
    saved = _state(engine)
    resumed = _engine(seed=2)
    resumed.load_checkpoint(str(tmp_path))
    _assert_same(_state(resumed), saved)
    assert _train(resumed, 3, 2) == _train(engine, 3, 2)
    _assert_same(_state(resumed), _state(engine))
    engine.destroy(), other.destroy(), resumed.destroy()


def test_the_disk_writes_start_during_the_save_and_their_error_fails_it(tmp_path, monkeypatch):
    """The write-back thread fdatasyncs the file while it is still being written (so the closing
    fsync does not write the whole checkpoint at the end), and the save's times add up to the bytes
    it wrote. An I/O error seen by the write-back (the kernel tells only one fsync of a file) fails
    the save, naming the file, with the previous checkpoint intact."""
    monkeypatch.setattr(checkpoint_stream, "WRITEBACK_BYTES", 256 << 10)
    real, synced = os.fdatasync, []

    def counted(fd):
        # bytes written when the write-back asked for the disk (the
        synced.append(os.lseek(fd, 0, os.SEEK_CUR))
        return real(fd)  # file is reserved at its final size: its size says nothing)

    monkeypatch.setattr(os, "fdatasync", counted)
    engine = _engine()
    _train(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path))
    optim = os.path.getsize(tmp_path / "global_step1" / OPTIM_FILE)
    # at least once during the write (asks that come while a sync runs are served by the next one:
    # how many syncs there are depends on the scheduling, that one came before the file was whole
    # does not)
    assert optim > 1 << 20 and synced, (optim, synced)
    assert 0 < min(synced) < optim
    times = engine.last_save_times
    assert times.bytes == optim + os.path.getsize(tmp_path / "global_step1" / MODEL_FILE)
    assert times.write > 0 and times.fsync >= 0 and times.produce >= 0 and times.hash_wait >= 0

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    _train(engine, 1, 1)
    with pytest.raises(
        OSError,
        match=rf"writing {re.escape(str(tmp_path))}/\.global_step2\.tmp-\d+/{OPTIM_FILE} "
        "failed: Input/output error",
    ):
        engine.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []
    engine.destroy()


def test_a_sync_asked_for_just_before_the_close_is_still_made(tmp_path, monkeypatch):
    """The write-back serves every ask, even one the close overtakes before its thread woke (CI
    saw a save on a busy 2-core box whose thread never ran: its fdatasync error was not seen). Run
    many times, the ask and the close back to back: each makes its one sync, and a failing one is
    raised by the close every time."""
    calls = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append(fd))
    with open(tmp_path / "f", "wb") as f:
        for _ in range(200):
            writeback = checkpoint_stream.Writeback(f.fileno())
            writeback.wrote(checkpoint_stream.WRITEBACK_BYTES)
            writeback.close()
        assert calls == [f.fileno()] * 200

        def failing(fd):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", failing)
        for _ in range(200):
            writeback = checkpoint_stream.Writeback(f.fileno())
            writeback.wrote(checkpoint_stream.WRITEBACK_BYTES)
            with pytest.raises(OSError, match="Input/output error"):
                writeback.close()
        # nothing asked: no sync, no error
        writeback = checkpoint_stream.Writeback(f.fileno())
        writeback.wrote(checkpoint_stream.WRITEBACK_BYTES - 1)
        writeback.close()


# ---------------------------------------------------------------------------------- the file format
def test_a_streamed_file_is_the_archive_torch_save_writes(tmp_path):
    """torch.load reads it (in memory, memory-mapped, weights_only, and with torch's computed
    storage offsets, checked by its debug asserts); zip tools check its CRC-32s; records start on 64
    bytes; the size was known before writing; the digest is the file's SHA-256. A producer that
    yields the wrong count is an error."""
    from torch.utils.serialization import config

    big = torch.randn(3_000_001)
    half = torch.randn(7, 5).to(torch.bfloat16)

    def chunks(t, step):
        return lambda: (t[i : i + step] for i in range(0, t.numel(), step))

    streamed = checkpoint_stream.StreamedStorage(torch.float32, big.numel(), chunks(big, 1_000_003))
    halves = checkpoint_stream.StreamedStorage(
        torch.bfloat16, half.numel(), chunks(half.reshape(-1), 4)
    )
    plain = torch.arange(10.0)
    obj = {
        "plain": plain,
        "view": plain[2:5],
        "big": streamed.tensor(),
        "part": streamed.tensor(5, 7),
        "half": halves.tensor(3, 9),
        "empty": torch.empty(0),
        "meta": [1, "x", None],
        "rng": torch.get_rng_state(),
    }
    f = checkpoint_stream.StreamedFile(obj, "states.pt")
    path = tmp_path / "states.pt"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        digest = f.write(str(path), pool)
    assert (
        f.nbytes == path.stat().st_size and digest == hashlib.sha256(path.read_bytes()).hexdigest()
    )
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        assert [i.filename for i in z.infolist()][:4] == [
            "states/data.pkl",
            "states/.format_version",
            "states/.storage_alignment",
            "states/byteorder",
        ]
        raw = path.read_bytes()
        for info in z.infolist():
            name_len, extra_len = (
                int.from_bytes(raw[info.header_offset + 26 :][:2], "little"),
                int.from_bytes(raw[info.header_offset + 28 :][:2], "little"),
            )
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename

    def check(got):
        assert torch.equal(got["plain"], plain) and torch.equal(got["view"], plain[2:5])
        assert torch.equal(got["big"], big) and torch.equal(got["part"], big[5:12])
        assert (
            torch.equal(got["half"], half.reshape(-1)[3:12]) and got["half"].dtype == torch.bfloat16
        )
        assert (
            got["empty"].numel() == 0
            and got["meta"] == [1, "x", None]
            and torch.equal(got["rng"], obj["rng"])
        )

    for mmap in (False, True):
        check(torch.load(path, mmap=mmap, weights_only=False))
    check(torch.load(path, weights_only=True))
    os.environ["TORCH_SERIALIZATION_DEBUG"] = "1"
    config.load.calculate_storage_offsets = True
    try:
        check(torch.load(path, mmap=True, weights_only=False))
    finally:
        config.load.calculate_storage_offsets = False
        del os.environ["TORCH_SERIALIZATION_DEBUG"]
    short = checkpoint_stream.StreamedStorage(torch.float32, 10, lambda: iter([torch.zeros(9)]))
    with (
        concurrent.futures.ThreadPoolExecutor(2) as pool,
        pytest.raises(AssertionError, match="produced with 36"),
    ):
        checkpoint_stream.StreamedFile({"x": short.tensor()}, "bad.pt").write(
            str(tmp_path / "bad.pt"), pool
        )


# ---------------------------------------------------------------------------------------- two ranks
TWO_RANKS = """
import errno, json, os, sys, torch
sys.path.insert(0, {repo!r})
import megatrain_ds
from megatrain_ds.checkpoints import checkpoint_stream
from tests.integration.test_checkpoint_disk import CFG, _model, _train

save_dir, out = sys.argv[1:3]
rank = int(os.environ["RANK"])
cfg = dict(CFG, train_batch_size=4, megatrain={{"collective_timeout": 60}})
megatrain_ds.init_distributed()
engine, *_ = megatrain_ds.initialize(model=_model(), config=cfg)
_train(engine, rank * 10, 1)
engine.save_checkpoint(save_dir)
want = {{k: v.clone() for k, v in engine.master_state_dict().items()}}
_train(engine, rank * 10 + 1, 1)
real_write = checkpoint_stream.StreamWriter._write


# rank 1's disk fills up half-way through its optimizer file (its first big record)
def full(self, data, crc):
    if rank == 1 and "optim_states" in self.f.name and self.written > 1000:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_write(self, data, crc)


checkpoint_stream.StreamWriter._write = full
try:
    engine.save_checkpoint(save_dir)
    raised = None
except Exception as exc:
    raised = f"{{type(exc).__name__}}: {{exc}}"
checkpoint_stream.StreamWriter._write = real_write
other, *_ = megatrain_ds.initialize(model=_model(seed=1), config=cfg)
other.load_checkpoint(save_dir)
got = other.master_state_dict()
same = all(torch.equal(got[k], want[k]) for k in want)
with open(f"{{out}}.{{rank}}", "w") as f:
    latest = open(os.path.join(save_dir, "latest")).read()
    json.dump({{"raised": raised, "same": same, "latest": latest}}, f)
"""


def test_two_ranks_a_full_disk_on_one_fails_the_save_on_both_without_a_hang(tmp_path):
    """2 gloo ranks: rank 1's disk fills up part-way through its optimizer file, while its records
    are exchanged layer by layer with rank 0. Rank 1 keeps producing its chunks (the exchanges)
    without writing them, so neither rank waits for the other: both raise (rank 0 naming rank 1 and
    the file), ``latest`` and the previous checkpoint are intact, and both load it."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(repo=str(HERE.parent)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p
        ),
    )
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # the two ranks forked with torchrun's environment (tests/fork_launch.py)
    env["MASTER_PORT"] = str(port)
    proc = warm_run(
        2, str(script), [str(tmp_path / "ckpt"), str(tmp_path / "out")], env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert (
        "the disk is full writing" in results[1]["raised"]
        and "optim_states.pt" in results[1]["raised"]
    )
    assert results[0]["raised"].startswith(
        "RuntimeError: rank 1 failed to write its checkpoint files (OSError): "
        "[Errno 28] save_checkpoint: the disk is full writing"
    )
    assert all(r["same"] and r["latest"] == "global_step1" for r in results)
    assert sorted(n for n in os.listdir(tmp_path / "ckpt") if n.startswith(".")) == []


def test_leftovers_of_a_removal_are_cleaned(tmp_path):
    """A kill while the previous checkpoint of a tag was being removed (to make room) leaves
    ``.<tag>.del-<pid>``: the next save removes it; it is never put back as the tag's checkpoint."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (tmp_path / f".last.del-{dead}").mkdir()
    (tmp_path / f".last.del-{dead}" / MODEL_FILE).write_bytes(b"half removed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoint_folder.clean_stale(str(tmp_path)) == [str(tmp_path / f".last.del-{dead}")]
    assert os.listdir(tmp_path) == []
