"""Checkpoints: exact resume, DeepSpeed's layout and return values, crash-safe writes."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import megatrain_ds
from tests.models import tiny_hf

HERE = Path(__file__).resolve().parent
CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
       "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 2e-3, "warmup_num_steps": 2,
                                                         "total_num_steps": 6}}}


def _engine(seed=0, cfg=CFG):
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("qwen2", tied=False, seed=seed), config=cfg)
    return engine


def _steps(engine, first, count):
    losses = []
    for step in range(first, first + count):
        for micro in range(2):
            ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(100 * step + micro))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


RESUMER = """
import json, sys, torch
sys.path.insert(0, {repo!r})
from tests.test_checkpoint import _engine, _steps
engine = _engine(seed=1)  # different init: everything must come from the checkpoint
path, client = engine.load_checkpoint(sys.argv[1])
losses = _steps(engine, 3, 3)
torch.save(dict(engine.master_state_dict()), sys.argv[2])
print(json.dumps({{"path": path, "client": client, "losses": losses, "lr": engine.get_lr(),
                  "counters": [engine.global_steps, engine.global_samples, engine.micro_steps]}}))
"""


def test_exact_resume_in_a_fresh_process(tmp_path):
    """3 steps, save, a fresh process loads and runs 3 more == 6 straight steps, bit for bit (fp32, CPU,
    GA 2, WarmupDecayLR, clipping)."""
    straight = _engine()
    want = _steps(straight, 0, 6)
    want_state = {k: v.clone() for k, v in straight.master_state_dict().items()}
    first = _engine()
    got = _steps(first, 0, 3)
    assert first.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 7})
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    assert sorted(os.listdir(tmp_path / "ckpt" / "global_step3")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    script = tmp_path / "resume.py"
    script.write_text(RESUMER.format(repo=str(HERE.parent)))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "final.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["path"] == str(tmp_path / "ckpt" / "global_step3") and out["client"] == {"epoch": 7}
    assert out["counters"] == [6, 24, 12]
    assert got + out["losses"] == want  # bit-identical losses
    state = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)
    straight.destroy(), first.destroy()


def test_nothing_to_load_and_module_only(tmp_path):
    engine = _engine()
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    _steps(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="mine")
    other = _engine(seed=1)
    path, _ = other.load_checkpoint(str(tmp_path), tag="mine", load_module_only=True)
    assert path.endswith("mine") and other.global_steps == 0
    a, b = engine.master_state_dict(), other.master_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert other.load_checkpoint(str(tmp_path), tag="missing") == (None, None)
    engine.destroy(), other.destroy()


SAVER = """
import sys, torch
sys.path.insert(0, {repo!r})
import megatrain_ds
from tests.models import tiny_hf
cfg = {{"train_micro_batch_size_per_gpu": 1, "optimizer": {{"type": "AdamW"}}}}
engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=24), config=cfg)
engine.global_steps = 5
for k in range(1000):
    engine.save_checkpoint(sys.argv[1], tag="global_step{{}}".format(6 + k))
    print("saved", 6 + k, flush=True)
"""


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.6])
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, delay):
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", layers=24),
                                         config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})
    engine.global_steps = 5
    engine.save_checkpoint(str(tmp_path))
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(repo=str(HERE.parent)))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    time.sleep(3.0 + delay)  # import + first saves, then kill at a varying point of a write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tag = (tmp_path / "latest").read_text()
    assert tag.startswith("global_step")
    path, _ = engine.load_checkpoint(str(tmp_path))  # whatever latest names is complete and loads
    assert path == str(tmp_path / tag)
    assert (tmp_path / "global_step5").is_dir()
    engine.destroy()


@pytest.mark.parametrize("filename", ["model.safetensors", "pytorch_model.bin"])
def test_hf_round_trip(tmp_path, filename):
    """Exported weights load with from_pretrained and give the engine's logits."""
    import transformers

    engine = _engine()
    _steps(engine, 0, 2)  # trained weights, not the init
    engine.save_16bit_model(str(tmp_path), filename)
    engine.module.config.save_pretrained(str(tmp_path))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    engine.eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = engine(input_ids=ids).logits.cpu()
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    state = engine._zero3_consolidated_16bit_state_dict()
    assert set(state) == set(loaded.state_dict()) and state["model.layers.0.mlp.up_proj.weight"].numel() > 0
    engine.destroy()


@pytest.mark.parametrize("max_shard", ["5GB", "200KB"])
def test_convert_command_writes_a_loadable_hf_folder(tmp_path, max_shard):
    import transformers

    engine = _engine()
    _steps(engine, 0, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "megatrain_ds.cli", "convert", str(tmp_path / "ckpt"), str(out),
                           "--max-shard-size", max_shard], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(HERE.parent)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (max_shard == "200KB")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    engine.eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, engine(input_ids=ids).logits.cpu(),
                                   rtol=1e-5, atol=1e-5)
    engine.destroy()


@pytest.mark.parametrize("tied,freeze", [(True, False), (False, True)])
def test_deepspeed_zero_to_fp32_reads_our_checkpoint(tmp_path, tied, freeze):
    """DeepSpeed's own zero_to_fp32 reconstructs the right fp32 weights (tied and frozen ones included)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = tiny_hf("qwen2", tied=tied)
    if freeze:
        for name, p in model.named_parameters():
            if "mlp" in name:
                p.requires_grad_(False)
    engine, *_ = megatrain_ds.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=CFG)
    _steps(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path))
    ours = engine.master_state_dict()
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    names = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    assert set(theirs) == names
    for name in names:
        source = name if name in ours else "model.embed_tokens.weight"  # tied lm_head
        assert torch.equal(torch.as_tensor(theirs[name].contiguous()), ours[source]), name
    engine.destroy()
