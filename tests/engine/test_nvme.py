"""The NVMe tier (megatrain_ds/host/nvme.py): DeepSpeed's ``offload_optimizer: {device: nvme,
nvme_path, ...}`` puts the Adam moments of the trailing streamed layers in a swap file under
``nvme_path``. Training with it equals training with every moment in RAM, bit for bit (the moments
are copied, never recomputed); the files appear where the config says; checkpoints read and write
the moments wherever they live; a bad ``nvme_path`` fails at ``initialize`` with the numbers, and a
save that fails on a full disk leaves the previous checkpoint whole.
"""

import errno
import os

import pytest
import torch

import megatrain_ds
from megatrain_ds.host import nvme as nvme_mod
from megatrain_ds.planning.plan import CapacityError
from tests.models import tiny_hf

STEPS = 6
GA = 2
LAYERS = 5


def _config(
    path=None,
    *,
    layers=4,
    buffers=2,
    pipeline=True,
    clip=0.05,
    ga=GA,
    backend="threads",
    bf16=False,
):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "megatrain": {"gpu_optimizer_layers": 0, "keep_activations": 0},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if path is not None:
        cfg["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(path),
                "buffer_count": buffers,
                "pipeline_read": pipeline,
                "pipeline_write": pipeline,
            },
        }
        cfg["aio"] = {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 1}
        cfg["megatrain"].update(nvme_layers=layers, nvme_backend=backend)
    return cfg


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 12), generator=g) for _ in range(n)]


def _run(cfg, steps=STEPS, seed=0, engine_out=None):
    engine, *_ = megatrain_ds.initialize(
        model=tiny_hf("llama", layers=LAYERS, seed=seed), config=cfg
    )
    losses = []
    for ids in _batches(steps * cfg.get("gradient_accumulation_steps", 1)):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    masters = {k: v.clone() for k, v in engine.master_state_dict().items()}
    if engine_out is not None:
        engine_out.append(engine)
    else:
        engine.destroy()
    return losses, masters


@pytest.fixture(scope="module")
def reference():
    return _run(_config())


def _same(a, b):
    la, ma = a
    lb, mb = b
    assert la == lb
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


@pytest.mark.parametrize("pipeline,buffers,layers", [(True, 3, 4), (False, 2, 5)])
def test_nvme_equals_host_only(tmp_path, reference, pipeline, buffers, layers):
    """GA 2 and clipping that fires (so speculative updates are undone and redone through the tier):
    every loss and every master bit-identical to host-only training, with the file under nvme_path
    and traffic through it."""
    engines = []
    result = _run(
        _config(tmp_path, layers=layers, buffers=buffers, pipeline=pipeline), engine_out=engines
    )
    engine = engines[0]
    tier = engine.store.tier
    assert engine.store.disk_from == LAYERS - layers
    assert os.path.dirname(os.path.dirname(tier.path)) == os.path.join(
        str(tmp_path), nvme_mod.SWAP_DIR
    )
    assert os.path.getsize(tier.path) == tier.file_bytes > 0
    # fewer staging buffers than disk layers: every step writes every disk layer (more with
    # rollbacks) and reads all but the ones still in a staging buffer
    assert tier.writes >= STEPS * layers and tier.reads >= STEPS * (layers - buffers)
    assert engine.host_memory()["disk_bytes"] == tier.file_bytes
    _same(result, reference)
    # the moments themselves: equal to a host-only engine's after the same steps
    folder = tier.folder
    engine.destroy()
    assert not os.path.exists(folder)  # the swap file goes with the engine


@pytest.mark.parametrize("speculate", [True, False])
def test_each_disk_layer_is_read_and_written_once_per_step(tmp_path, speculate):
    """No clipping, so nothing is undone: each disk layer's moments are written once per step and
    read at most once (not at all when still in a staging buffer), with fewer staging buffers than
    disk layers: a layer read ahead is not evicted before its update uses it, whether the updates
    run during the backward (speculative) or after the norm in forward order."""
    cfg = _config(tmp_path, layers=4, buffers=2, clip=0.0, ga=1)
    cfg["megatrain"]["speculative_step"] = speculate
    engines = []
    _run(cfg, steps=4, engine_out=engines)
    tier = engines[0].store.tier
    assert tier.writes == 4 * 4
    assert 4 * (4 - 2) <= tier.reads <= 4 * 4
    engines[0].destroy()


def test_bf16_nvme_equals_host_only(tmp_path):
    ref = _run(_config(bf16=True, ga=1, clip=1.0), steps=4)
    _same(_run(_config(tmp_path, bf16=True, ga=1, clip=1.0, layers=3), steps=4), ref)


def test_bf16_masters_with_ga_and_the_tier_equal_host_only(tmp_path):
    """bf16-master mode (the master is the bf16 wire) with GA 2 and clipping: the tier changes no
    number there either."""

    def cfg(path=None):
        c = _config(path, bf16=True, clip=0.05) if path else _config(bf16=True, clip=0.05)
        c["bf16"]["bf16_master_weights_and_grads"] = True
        return c

    _same(_run(cfg(tmp_path), steps=3), _run(cfg(), steps=3))


def test_checkpoint_resume_through_the_tier(tmp_path):
    """Save after 3 steps with moments on disk, resume into a host-only engine and into a tier
    engine: both continue exactly as the uninterrupted run; a checkpoint saved host-only loads into
    a tier engine too."""
    nv = tmp_path / "nvme"
    nv.mkdir()
    full = _run(_config(nv), steps=5)
    engines = []
    _run(_config(nv), steps=3, engine_out=engines)
    engines[0].save_checkpoint(str(tmp_path / "ckpt"), tag="t3")
    engines[0].destroy()

    def resume(cfg):
        engine, *_ = megatrain_ds.initialize(
            model=tiny_hf("llama", layers=LAYERS, seed=0), config=cfg
        )
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t3")
        losses = []
        for ids in _batches(5 * GA)[3 * GA :]:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        masters = {k: v.clone() for k, v in engine.master_state_dict().items()}
        engine.destroy()
        return losses, masters

    for cfg in (_config(nv, layers=3), _config()):
        losses, masters = resume(cfg)
        assert losses == full[0][3 * GA :]
        for k in masters:
            assert torch.equal(masters[k], full[1][k]), k


def test_full_optimizer_state_reads_and_writes_disk_layers(tmp_path):
    from megatrain_ds.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state

    engines = []
    _run(_config(tmp_path, layers=3), steps=2, engine_out=engines)
    engine = engines[0]
    p = dict(engine.module.named_parameters())["model.layers.4.mlp.up_proj.weight"]
    m = safe_get_full_optimizer_state(p, "exp_avg")
    assert m.abs().sum() > 0
    safe_set_full_optimizer_state(p, torch.full_like(m, 0.25), "exp_avg")
    assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg"), torch.full_like(m, 0.25))
    engine.store.tier.expect([])  # nothing cached survives: read back from the file itself
    for b in engine.store.tier.buffers:
        b.layer, b.state = None, "free"
    engine.store._read_copy = None
    assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg"), torch.full_like(m, 0.25))
    engine.destroy()


def test_bad_nvme_path_fails_at_initialize(tmp_path, monkeypatch):
    def init(path):
        return megatrain_ds.initialize(
            model=tiny_hf("llama", layers=LAYERS), config=_config(path, layers=3)
        )

    with pytest.raises(nvme_mod.NvmeError, match="does not exist"):
        init(tmp_path / "missing")
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(nvme_mod.NvmeError, match="not a directory"):
        init(afile)
    cfg = _config(tmp_path, layers=3)
    cfg["zero_optimization"]["offload_optimizer"].pop("nvme_path")
    with pytest.raises(
        (nvme_mod.NvmeError, CapacityError), match="no nvme_path|nvme_path is not set"
    ):
        megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=cfg)
    # too small: the numbers are in the message
    monkeypatch.setattr(nvme_mod, "free_bytes", lambda path: 8192)
    with pytest.raises(nvme_mod.NvmeError, match=r"has 0\.00 GiB free; .* need 0\.\d\d GiB"):
        init(tmp_path)
    monkeypatch.undo()

    # the filesystem refuses the allocation (ENOSPC at posix_fallocate): clear error, no swap folder
    # left
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(nvme_mod.NvmeError, match="cannot allocate"):
        init(tmp_path)
    monkeypatch.undo()
    assert not (tmp_path / nvme_mod.SWAP_DIR).exists()  # its folder and the (then empty) swap root
    # every layer fits in RAM (nvme_layers 0): a bad path is still an error at initialize
    cfg = _config(tmp_path / "missing", layers=0)
    with pytest.raises(nvme_mod.NvmeError, match="does not exist"):
        megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=cfg)
    if os.getuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(nvme_mod.NvmeError, match="not writable"):
            init(ro)


def test_full_disk_at_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that hits ENOSPC while the moments stream from the tier raises, leaves the previous
    checkpoint and ``latest`` as they were, and training goes on unchanged (the tier's state is
    untouched)."""
    nv = tmp_path / "nvme"
    nv.mkdir()
    ref = _run(_config(nv), steps=3)
    engines = []
    _run(_config(nv), steps=2, engine_out=engines)
    engine = engines[0]
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt), tag="good")
    from megatrain_ds.checkpoints import checkpoint_stream

    real_write = checkpoint_stream.StreamWriter._write

    def full(self, data, crc):
        # (the moments stream from the tier as the file is written)
        if "optim_states" in self.f.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data, crc)

    monkeypatch.setattr(checkpoint_stream.StreamWriter, "_write", full)
    with pytest.raises(OSError):
        engine.save_checkpoint(str(ckpt), tag="bad")
    monkeypatch.undo()
    assert (ckpt / "latest").read_text().strip() == "good"
    assert sorted(
        p for p in os.listdir(ckpt) if not p.startswith(".") and not p.endswith(".py")
    ) == ["good", "latest"]
    for ids in _batches(3 * GA)[2 * GA :]:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    assert loss.item() == ref[0][-1]
    engine.destroy()


def test_nvme_config_errors_name_the_key(tmp_path):
    from megatrain_ds.planning.config import ConfigError

    for key, value in (("nvme_layers", -1), ("nvme_backend", "spdk"), ("host_memory_budget", 0)):
        cfg = _config(tmp_path)
        cfg["megatrain"][key] = value
        with pytest.raises(ConfigError, match=f"megatrain.{key}"):
            megatrain_ds.initialize(model=tiny_hf("llama", layers=LAYERS), config=cfg)


def test_two_engines_on_one_nvme_path_each_train_as_alone(tmp_path):
    """A policy and a reference engine (or two jobs) given the same nvme_path: each tier has its own
    swap file (the second used to truncate the first's, issue 27), so each engine's state equals its
    solo run's bit for bit."""
    for k in range(2):
        (tmp_path / f"solo{k}").mkdir()
    solo = [_run(_config(tmp_path / f"solo{k}", ga=1), steps=3, seed=k) for k in range(2)]
    shared = tmp_path / "shared"
    shared.mkdir()
    engines = [
        megatrain_ds.initialize(
            model=tiny_hf("llama", layers=LAYERS, seed=k), config=_config(shared, ga=1)
        )[0]
        for k in range(2)
    ]
    assert engines[0].store.tier.path != engines[1].store.tier.path
    for ids in _batches(3):  # interleaved: each step of one engine between two of the other's
        for engine in engines:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    for engine, (_, masters) in zip(engines, solo):
        got = engine.master_state_dict()
        assert all(torch.equal(got[k], v) for k, v in masters.items())
        engine.destroy()
    assert not (shared / nvme_mod.SWAP_DIR).exists()


def test_a_script_without_destroy_exits_and_leaves_no_swap_folder(tmp_path):
    """Most DeepSpeed scripts never call destroy(): at exit the queued updates and writes finish
    while the I/O threads still run, and the swap folder goes (it used to hang for ever in the
    finalizer's flush)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import megatrain_ds
        from tests.engine.test_nvme import _batches, _config
        from tests.models import tiny_hf
        config = _config({str(tmp_path)!r}, ga=1)
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=5), config=config)
        for ids in _batches(3):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        print("trained", flush=True)
    """)
    )
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(repo)},
    )
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-2000:]
    assert not (tmp_path / nvme_mod.SWAP_DIR).exists(), list(
        (tmp_path / nvme_mod.SWAP_DIR).iterdir()
    )
