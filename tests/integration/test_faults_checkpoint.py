"""Checkpoint faults: nothing is lost or half-loaded.

A load checks the whole checkpoint before it writes anything; persistent buffers come back; a tag
that is not there raises instead of starting over; leftovers of killed saves are cleaned (never a
live save's); DeepSpeed's zero_to_fp32.py sits in save_dir and reads our layout;
``exclude_frozen_parameters`` leaves frozen weights out.
"""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import megatrain_ds
from megatrain_ds.checkpoints.checkpoint import MODEL_FILE, OPTIM_FILE, CheckpointMismatchError
from tests.models import tiny_hf

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3, "warmup_num_steps": 3}},
}


def _llama(seed=0, vocab=256, attention_bias=False):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab,
            tie_word_embeddings=False,
            attention_bias=attention_bias,
        )
    )


def _engine(model, params=None):
    engine, *_ = megatrain_ds.initialize(model=model, model_parameters=params, config=CFG)
    return engine


def _train(engine, steps, vocab=256):
    for step in range(steps):
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def _snapshot(engine):
    """Everything a load may write, copied."""
    engine.sync_masters_to_host()
    res = engine.resident
    return {
        "masters": {k: v.clone() for k, v in engine.master_state_dict().items()},
        "exp_avg": engine.store.exp_avg.clone(),
        "exp_avg_sq": engine.store.exp_avg_sq.clone(),
        "resident_moments": [
            None if t is None else t.clone() for t in res.exp_avg + res.exp_avg_sq
        ],
        "counters": (
            engine.global_steps,
            engine.global_samples,
            engine.micro_steps,
            engine.optimizer.step_count,
        ),
        "lr": engine.get_lr(),
        "scheduler": engine.lr_scheduler.state_dict(),
    }


def _assert_same(a, b):
    assert a["masters"].keys() == b["masters"].keys()
    for name in a["masters"]:
        assert torch.equal(a["masters"][name], b["masters"][name]), name
    assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert all(
        (x is None and y is None) or torch.equal(x, y)
        for x, y in zip(a["resident_moments"], b["resident_moments"])
    )
    assert (
        a["counters"] == b["counters"] and a["lr"] == b["lr"] and a["scheduler"] == b["scheduler"]
    )


# ----------------------------------------------------------------------------- 1. check, then write
@pytest.mark.parametrize("kind", ["shape", "key", "optimizer"])
def test_a_load_that_does_not_fit_changes_nothing(tmp_path, kind):
    """The checkpoint differs from the engine in the last thing a writer would reach (the resident
    embedding's shape, an extra bias per layer, which parameters the optimizer trained): the load
    raises naming it, and masters, moments, counters and schedule are exactly as before."""
    saved = {
        "shape": lambda: _llama(vocab=320),
        "key": lambda: _llama(attention_bias=True),
        "optimizer": lambda: _llama(),
    }[kind]()
    params = (
        [p for n, p in saved.named_parameters() if "mlp" not in n] if kind == "optimizer" else None
    )
    source = _engine(saved, params)
    _train(source, 2, vocab=320 if kind == "shape" else 256)
    source.save_checkpoint(str(tmp_path))
    source.destroy()

    engine = _engine(_llama(seed=1))
    _train(engine, 1)
    before = _snapshot(engine)
    with pytest.raises(CheckpointMismatchError) as err:
        engine.load_checkpoint(str(tmp_path))
    _assert_same(_snapshot(engine), before)
    message = str(err.value)
    assert "nothing was loaded" in message
    if kind == "shape":
        assert (
            "model.embed_tokens.weight: shape (320, 64) in the checkpoint, (256, 64) in the model"
            in message
        )
    elif kind == "key":
        assert "model.layers.0.self_attn.q_proj.bias" in message and "model lacks" in message
    else:
        assert (
            "model.layers.0.mlp.down_proj.weight" in message
            and "load_optimizer_states=False" in message
        )
    engine.destroy()


def test_load_master_state_dict_checks_before_writing():
    engine = _engine(_llama())
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    state = {k: torch.full_like(v, 7.0) for k, v in before.items()}
    state["lm_head.weight"] = torch.zeros(3, 64)  # the last parameter written
    with pytest.raises(
        RuntimeError, match=r"lm_head.weight: \(3, 64\) given, \(256, 64\) in the model"
    ):
        engine.load_master_state_dict(state, strict=False)
    after = engine.master_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    engine.destroy()


# ------------------------------------------------------------------------------------- 2. buffers
class BufferedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.bn = nn.BatchNorm1d(width)  # running stats and num_batches_tracked: persistent buffers
        self.register_buffer("gain", torch.rand(width) + 0.5)  # a user buffer
        # not in state_dict: not saved
        self.register_buffer("scratch", torch.zeros(width), persistent=False)

    def forward(self, x):  # (B, T, C)
        h = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return x + self.bn(h.transpose(1, 2)).transpose(1, 2) * self.gain


class BufferedLM(nn.Module):
    def __init__(self, seed: int, vocab: int = 64, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(BufferedBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)
        self.register_buffer("inv_temperature", torch.rand(1) + 0.5)  # outside the streamed layers

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.inv_temperature


def _buffered_engine(seed):
    engine, *_ = megatrain_ds.initialize(model=BufferedLM(seed), config=CFG)
    return engine


def _logits(engine, ids):
    engine.eval()  # BatchNorm normalizes with its running statistics: the buffers decide the output
    with torch.no_grad():
        out = engine(ids).detach().cpu()
    engine.train()
    return out


def test_persistent_buffers_round_trip(tmp_path):
    """Buffers outside and inside streamed layers (a user buffer, BatchNorm statistics) come back
    exactly, in the module and in what the executor computes with; a non-persistent buffer is not
    saved."""
    engine = _buffered_engine(seed=0)
    for step in range(2):
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
        logits = engine(ids)
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1)))
        engine.step()
    engine.synchronize()
    want = {
        n: b.detach().cpu().clone() for n, b in engine.module.named_buffers() if "scratch" not in n
    }
    assert (
        want["blocks.1.bn.num_batches_tracked"].item() > 0
        and want["blocks.1.bn.running_var"].ne(1).any()
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(9))
    want_logits = _logits(engine, ids)
    engine.save_checkpoint(str(tmp_path))
    saved = torch.load(tmp_path / "global_step2" / MODEL_FILE, weights_only=False)
    assert sorted(saved["buffer_names"]) == sorted(want)  # scratch is not persistent

    other = _buffered_engine(seed=1)  # different gains; fresh BatchNorm statistics
    assert not torch.equal(other.module.inv_temperature.cpu(), want["inv_temperature"])
    other.load_checkpoint(str(tmp_path))
    got = {n: b.detach().cpu() for n, b in other.module.named_buffers() if "scratch" not in n}
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for i in range(3):  # what the streamed layers compute with
        for name, buf in other.executor.buffers[i].items():
            if name != "scratch":
                assert torch.equal(buf.cpu(), want[f"blocks.{i}.{name}"]), (i, name)
    assert torch.equal(_logits(other, ids), want_logits)
    engine.destroy(), other.destroy()


def test_a_buffer_of_another_shape_is_refused(tmp_path):
    engine = _buffered_engine(seed=0)
    engine.save_checkpoint(str(tmp_path))
    other = _buffered_engine(seed=1)
    other.module.blocks[2].gain = torch.ones(5)  # a buffer the checkpoint has with 32 elements
    before = {k: v.clone() for k, v in other.master_state_dict().items()}
    with pytest.raises(
        CheckpointMismatchError,
        match=r"buffer blocks.2.gain: shape \(32,\) in the checkpoint, "
        r"\(5,\) in the model",
    ):
        other.load_checkpoint(str(tmp_path))
    assert all(torch.equal(other.master_state_dict()[k], v) for k, v in before.items())
    engine.destroy(), other.destroy()


# --------------------------------------------------------------------------- 3. missing checkpoints
def test_a_missing_checkpoint_raises_naming_the_path(tmp_path):
    engine = _engine(_llama())
    # DeepSpeed: nothing to load
    with pytest.warns(UserWarning, match="Unable to find latest file at .*latest"):
        assert engine.load_checkpoint(str(tmp_path / "never_saved")) == (None, None)
    engine.save_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("global_step9")  # latest names a folder that is not there
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(f"names tag 'global_step9', but {tmp_path / 'global_step9'} does not exist")
        + r".*\['global_step0'\]",
    ):
        engine.load_checkpoint(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "elsewhere"))):
        engine.load_checkpoint(str(tmp_path), tag="elsewhere")
    os.remove(tmp_path / "global_step0" / MODEL_FILE)  # a folder without its files
    with pytest.raises(
        FileNotFoundError, match=re.escape(str(tmp_path / "global_step0" / MODEL_FILE))
    ):
        engine.load_checkpoint(str(tmp_path), tag="global_step0")
    engine.destroy()


# ------------------------------------------------------------------------------- 4. stale leftovers
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_save_cleans_what_killed_saves_left(tmp_path):
    """Leftovers of dead processes go (a moved-aside folder whose tag folder is missing is put back
    instead); those of a live process (a save in progress) stay."""
    engine = _engine(_llama())
    engine.save_checkpoint(str(tmp_path), tag="kept")
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (dead, live.pid):
            (tmp_path / f".global_step7.tmp-{pid}").mkdir()
            (tmp_path / f".global_step7.tmp-{pid}" / MODEL_FILE).write_bytes(b"half a file")
            (tmp_path / f".latest.tmp-{pid}").write_text("global_st")
            # "kept" exists: an old copy that was never removed
            (tmp_path / f".kept.old-{pid}").mkdir()
        (tmp_path / f".lost.old-{dead}").mkdir()  # killed between the renames: "lost" is missing
        (tmp_path / f".lost.old-{dead}" / MODEL_FILE).write_bytes(b"the previous checkpoint")
        with pytest.warns(UserWarning, match="put back"):
            engine.save_checkpoint(str(tmp_path), tag="new")
        left = sorted(n for n in os.listdir(tmp_path) if n.startswith("."))
        assert left == sorted(
            [f".global_step7.tmp-{live.pid}", f".latest.tmp-{live.pid}", f".kept.old-{live.pid}"]
        )
        assert (tmp_path / "lost" / MODEL_FILE).read_bytes() == b"the previous checkpoint"
        assert (tmp_path / "latest").read_text() == "new"
    finally:
        live.kill()
        live.wait()
    engine.destroy()


# ------------------------------------------------------------------------------- 5. zero_to_fp32.py
def test_deepspeeds_recovery_script_is_in_save_dir_and_reads_it(tmp_path):
    """As DeepSpeed does: save_dir/zero_to_fp32.py (its own file, executable by the owner), and
    running it gives exactly the engine's fp32 masters (tied and frozen parameters included) and
    buffers."""
    import deepspeed.utils.zero_to_fp32 as reference

    model = tiny_hf("qwen2", tied=True)
    for name, p in model.named_parameters():
        if "mlp.up_proj" in name:
            p.requires_grad_(False)
    engine = _engine(model, [p for p in model.parameters() if p.requires_grad])
    _train(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    assert script.read_bytes() == Path(reference.__file__).read_bytes()
    assert os.stat(script).st_mode & stat.S_IXUSR
    assert (tmp_path / "ckpt" / "zero_to_torch.py").exists()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "fp32")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    ours = engine.master_state_dict()
    assert set(got) == set(ours) | {"lm_head.weight"}  # Qwen2 has no persistent buffers
    for name, tensor in ours.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    assert torch.equal(got["lm_head.weight"], ours["model.embed_tokens.weight"])
    engine.destroy()


# --------------------------------------------------------------------- 6. exclude_frozen_parameters
OUTSIDE = "model.norm.weight"  # requires grad, but not handed to the optimizer


def _partly_frozen_engine():
    model = _llama()
    for name, p in model.named_parameters():
        if "mlp" in name:
            p.requires_grad_(False)
    return _engine(
        model, [p for n, p in model.named_parameters() if p.requires_grad and n != OUTSIDE]
    )


def test_exclude_frozen_parameters(tmp_path):
    """Frozen = requires_grad False (DeepSpeed's rule) or in no optimizer group: left out of the
    16-bit exports when asked; a checkpoint saved without them loads strictly into the same model
    (frozen weights stay)."""
    engine = _partly_frozen_engine()
    _train(engine, 1)
    everything = set(engine.module.state_dict())
    frozen = {n for n in everything if "mlp" in n} | {OUTSIDE}
    assert len(frozen) == 10
    assert set(engine._zero3_consolidated_16bit_state_dict()) == everything
    assert (
        set(engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True))
        == everything - frozen
    )
    engine.save_16bit_model(str(tmp_path), "trained.bin", exclude_frozen_parameters=True)
    assert set(torch.load(tmp_path / "trained.bin", weights_only=True)) == everything - frozen
    engine.save_16bit_model(str(tmp_path), "all.bin")
    assert set(torch.load(tmp_path / "all.bin", weights_only=True)) == everything

    engine.save_checkpoint(str(tmp_path / "ckpt"), exclude_frozen_parameters=True)
    states = torch.load(tmp_path / "ckpt" / "global_step1" / MODEL_FILE, weights_only=False)
    assert states["frozen_param_fragments"] is None
    optim = torch.load(tmp_path / "ckpt" / "global_step1" / OPTIM_FILE, weights_only=False)
    saved_numel = sum(t.numel() for t in optim["optimizer_state_dict"]["fp32_flat_groups"])
    want = {k: v.clone() for k, v in engine.master_state_dict().items()}
    assert saved_numel == sum(t.numel() for n, t in want.items() if n not in frozen)
    other = _partly_frozen_engine()  # the same init: its frozen weights are the ones trained beside
    other.load_checkpoint(str(tmp_path / "ckpt"))  # strict: only the frozen weights may be absent
    got = other.master_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    engine.destroy(), other.destroy()


def test_a_flipped_byte_is_refused_naming_the_file_and_the_engine_is_untouched(tmp_path):
    """Issue 27: one flipped byte in the optimizer file loaded without a word (masters off by up to
    0.25). The save records each file's SHA-256 (in sha256sum's format); the load verifies them
    first and refuses by name."""
    import hashlib

    from megatrain_ds.checkpoints.checksums import ChecksumError

    saved = _engine(_llama())
    _train(saved, 2)
    saved.save_checkpoint(str(tmp_path))
    folder = tmp_path / "global_step2"
    manifest = (folder / "zero_pp_rank_0_checksums.sha256").read_text().splitlines()
    assert sorted(line.split("  ")[1] for line in manifest) == sorted([MODEL_FILE, OPTIM_FILE])
    for line in manifest:  # what sha256sum -c checks
        digest, name = line.split("  ")
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
    loaded = _engine(_llama(seed=1))
    loaded.load_checkpoint(str(tmp_path))  # intact: loads
    assert loaded.global_steps == 2
    target = _engine(_llama(seed=2))
    _train(target, 1)
    before = _snapshot(target)
    data = bytearray((folder / OPTIM_FILE).read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the fp32 masters
    (folder / OPTIM_FILE).write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=rf"{OPTIM_FILE} is corrupted: .*Nothing was loaded"):
        target.load_checkpoint(str(tmp_path))
    _assert_same(before, _snapshot(target))


def test_a_save_inside_an_accumulation_window_resumes_with_the_whole_window(tmp_path):
    """Issue 27: micro_steps came back but the window's partial gradient did not, so the first step
    after the resume used half a window. Now the save says so, and the resume restarts the window
    (as DeepSpeed's does): it steps exactly as a resume from the boundary before it."""
    cfg = dict(CFG, gradient_accumulation_steps=2)

    def micro(engine, seed):
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    inside, boundary = (megatrain_ds.initialize(model=_llama(), config=cfg)[0] for _ in range(2))
    for engine in (inside, boundary):
        micro(engine, 0), micro(engine, 1)  # one whole window: step 1
    micro(inside, 2)  # and half of the next
    with pytest.warns(UserWarning, match=r"after 1 micro-step\(s\) of an accumulation window of 2"):
        inside.save_checkpoint(str(tmp_path / "inside"))
    boundary.save_checkpoint(str(tmp_path / "boundary"))
    resumed = []
    for name in ("inside", "boundary"):
        engine = megatrain_ds.initialize(model=_llama(seed=1), config=cfg)[0]
        if name == "inside":
            with pytest.warns(UserWarning, match="the window restarts at its first micro-step"):
                engine.load_checkpoint(str(tmp_path / name))
        else:
            engine.load_checkpoint(str(tmp_path / name))
        assert engine.global_steps == 1 and not engine.is_gradient_accumulation_boundary()
        micro(engine, 3), micro(engine, 4)
        assert engine.global_steps == 2
        resumed.append(engine.master_state_dict())
    assert all(torch.equal(resumed[0][k], resumed[1][k]) for k in resumed[0])


def test_a_full_disk_during_a_save_names_the_file_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    """Issue 27: a full disk surfaced as torch's `inline_container.cc:672 unexpected pos`. Now: the
    file, the bytes needed and free, and the previous checkpoint intact and loadable (the unfinished
    folder removed)."""
    import errno

    from megatrain_ds.checkpoints import checkpoint_stream

    engine = _engine(_llama())
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path))  # global_step1: the previous checkpoint
    _train(engine, 1)
    real_write, budget = checkpoint_stream.StreamWriter._write, {"left": 4096}

    def write(self, data, crc):  # the disk fills up after a few KiB of the next save
        budget["left"] -= memoryview(data).nbytes
        if budget["left"] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data, crc)

    monkeypatch.setattr(checkpoint_stream.StreamWriter, "_write", write)
    with pytest.raises(
        OSError,
        match=r"disk is full writing .*global_step2\.tmp-\d+/zero_pp_rank_0_mp_rank_00_"
        r"model_states\.pt: it needs about .* GiB are free there.*previous checkpoint "
        r"and 'latest' are intact",
    ):
        engine.save_checkpoint(str(tmp_path))
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "global_step1"
    # no unfinished folder
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step1"]
    resumed = _engine(_llama(seed=1))
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 1
