"""The next forward starts on the embedding rows its batch looks up ([Note: embedding rows first] in resident.py): the
rows updated from copies of their state must be bit for bit the rows of the whole update, and training must be the
same as with the whole resident update before the forward."""
import threading

import pytest
import torch

import megatrain_ds
from models import tiny_hf


def _config(rows: bool, kernel: str, speculate: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "megatrain": {"embedding_rows_first": rows, "host_kernel": kernel, "speculative_step": speculate}}


def _batches(n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 8), generator=g) for _ in range(n)]  # 64 of 256 rows: never the whole table


def _held_run(kernel: str, extra: dict | None = None):
    """5 steps, the AdamW thread held from before each step until the embedding has run, so the rows path must serve
    the lookup (the resident update, queued after the layers', cannot have run). Returns the losses, whether each
    lookup (steps 2-5) equals the table after that whole update, and the reference run's losses (the whole update
    before every forward)."""
    cfg = _config(True, kernel, False)
    cfg["megatrain"].update(extra or {})
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("qwen2", seed=1), config=cfg)
    res = engine.resident
    emb = engine.module.get_input_embeddings()
    assert res.rows_first and res.rows_module is emb
    looked_up, gate = [], threading.Event()

    def after_lookup(_module, args, out):
        looked_up.append((args[0], out.detach().clone()))
        gate.set()  # the AdamW thread may go on: the layers wait for it
    emb.register_forward_hook(after_lookup)
    losses, seen = [], []
    try:
        for step, ids in enumerate(_batches(5)):
            loss = engine(input_ids=ids, labels=ids).loss
            losses.append(loss.item())
            engine.backward(loss)
            if step < 4:
                gate.clear()
                engine.optimizer.parts.opt_worker.submit(gate.wait, 60)  # holds the AdamW thread until the lookup
            engine.step()
            if step > 0:  # this step's forward looked up rows of the step before's update, now whole on the device
                ids_seen, out = looked_up[step]
                seen.append(torch.equal(out, torch.nn.functional.embedding(ids_seen, emb.weight.detach())))
    finally:
        gate.set()
        rows_uploads = res.rows_uploads
        engine.destroy()
    assert rows_uploads == 4
    cfg["megatrain"]["embedding_rows_first"] = False
    ref, *_ = megatrain_ds.initialize(model=tiny_hf("qwen2", seed=1), config=cfg)
    assert not ref.resident.rows_first
    ref_losses = []
    for ids in _batches(5):
        loss = ref(input_ids=ids, labels=ids).loss
        ref_losses.append(loss.item())
        ref.backward(loss)
        ref.step()
    ref.destroy()
    return losses, seen, ref_losses


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_rows_first_forward_sees_the_whole_updates_rows(kernel):
    """What each lookup returned equals the table after the whole update, and the run is the reference run."""
    losses, seen, ref_losses = _held_run(kernel)
    assert seen == [True] * 4
    assert losses == ref_losses and len(set(losses)) == 5


@pytest.mark.gpu
def test_gpu_rows_first_lookup_equals_the_whole_update():
    """The same on a GPU (the rows' copy on the H2D stream, the lookup ordered after it, the whole table's copy after
    the lookup only), host-held optimizer state: the lookups bit for bit; the losses to fp32 rounding of the
    embedding's backward (atomic adds on a GPU)."""
    losses, seen, ref_losses = _held_run("native", {"gpu_optimizer_layers": 0})
    assert seen == [True] * 4
    assert losses == pytest.approx(ref_losses, rel=1e-5) and len(set(losses)) == 5


def _train(rows: bool, speculate: bool, steps: int = 6):
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama", tied=False, seed=2),
                                         config=_config(rows, "native", speculate))
    losses = []
    for ids in _batches(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    engine.resident.upload()  # the last update in the device copies
    out = losses, [p.detach().clone() for p in engine.resident.params], engine.resident.rows_uploads
    masters = [m.clone() for m in engine.resident.master]
    engine.destroy()
    return out + (masters,)


@pytest.mark.parametrize("speculate", [True, False])
def test_rows_first_trains_bit_for_bit_as_the_whole_update(speculate):
    """Untied embedding and head, speculation on (clipping at 0.5 fires on some steps: rolled back, redone) or off:
    whichever path each forward takes (rows first, or the whole update when the AdamW thread got there first), the
    losses, the device copies and the fp32 masters equal a run with the whole update before every forward."""
    losses, params, _, masters = _train(True, speculate)
    ref_losses, ref_params, ref_rows, ref_masters = _train(False, speculate)
    assert ref_rows == 0
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert all(torch.equal(a, b) for a, b in zip(masters, ref_masters))


def test_rows_first_is_off_for_state_on_the_device_and_a_bad_value_is_refused():
    from megatrain_ds.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match="embedding_rows_first"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "megatrain": {"embedding_rows_first": "yes"}})
    engine, *_ = megatrain_ds.initialize(model=tiny_hf("qwen2"), config=_config(True, "native", True))
    assert engine.resident.rows_first
    engine.resident.on_device = True  # as move_state_to_device leaves it: the update is launched on the GPU
    assert not engine.resident.rows_first
    engine.resident.on_device = False
    engine.destroy()
