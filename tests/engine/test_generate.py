"""generate() inside a training loop with the inference cache (inference.py, docs/generate.md).

- greedy tokens (and every step's logits) with the cache == without it == a plain PyTorch copy,
  under no_grad and inference_mode; a generate of K tokens loads each layer once with the cache, K
  times without (the executor's per-direction H2D counters); tokens/s of both modes on this CPU are
  printed;
- after engine.step() the next generate uses the new weights (== plain model with
  ``master_state_dict()``); a write to one layer outside the optimizer re-uploads that layer only;
- a grad-enabled forward frees the cache, and a no-grad pass while its backward is pending streams;
  rollouts before every training step leave losses, every gradient and the trained weights equal to
  plain PyTorch (tests/engine/test_paths.py's harness);
- bf16 (fp32 master staged and cast) with a kept layer (not copied into the cache): logits equal
  streaming's;
- the policy: "auto" is off on CPU, knobs are validated; on CUDA (``gpu`` marker) "auto" caches when
  the layers fit and streams when they do not;
- data parallel (2 ranks, gloo): every rank's cache comes from the owners' broadcast, once per
  version.
"""

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import megatrain_ds
from megatrain_ds.planning.config import ConfigError, MegatrainSettings
from tests.launch import run_again_after_exit_abort
from tests.models import tiny_hf
from tests.engine.test_paths import _batches, _compare, _logits_loss

LAYERS, K = 3, 8  # 3 layers > 2 slots: streaming reloads every layer at every forward
PROMPT = torch.tensor([[5, 17, 42, 9], [3, 1, 200, 77]])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(cache, model=None, bf16=False, **megatrain):
    model = model if model is not None else tiny_hf("llama", layers=LAYERS)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": bf16},
        "megatrain": {
            "inference_cache": cache,
            "keep_activations": 0,
            "gpu_optimizer_layers": 0,
            **megatrain,
        },
    }
    engine, *_ = megatrain_ds.initialize(model=model, config=cfg)
    return engine


def _generate(model, k=K, ids=PROMPT):
    """Greedy tokens and the logits of every generated position ([k, batch, vocab])."""
    model.eval()
    with torch.no_grad():
        out = model.generate(
            ids.to(DEVICE),
            attention_mask=torch.ones_like(ids).to(DEVICE),
            pad_token_id=0,
            max_new_tokens=k,
            min_new_tokens=k,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences.cpu(), torch.stack(out.logits).float().cpu()


def _loads(engine) -> dict[str, list[int]]:
    return {d: list(v) for d, v in engine.executor.h2d_loads.items()}


def _plain_with(engine, template):
    """A plain copy of ``template`` holding the engine's current fp32 masters."""
    plain = copy.deepcopy(template)
    # rotary inv_freq: a buffer, not a master
    plain.load_state_dict(engine.master_state_dict(), strict=False)
    return plain.to(DEVICE)


def _tokens_per_s(models: dict, k=16, rounds=3) -> dict[str, float]:
    """Generated tokens per second of each model, best of ``rounds`` interleaved rounds (a shared
    CPU is noisy)."""
    best = {name: float("inf") for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            t0 = time.perf_counter()
            _generate(model, k=k)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: k * PROMPT.shape[0] / t for name, t in best.items()}


def test_cache_equals_streaming_and_plain_and_loads_each_layer_once(capsys, monkeypatch):
    model = tiny_hf("llama", layers=LAYERS)
    plain = copy.deepcopy(model).to(DEVICE).eval()
    cached, streamed = (
        _engine(True, copy.deepcopy(model), trace=True),
        _engine(False, copy.deepcopy(model)),
    )
    want_tokens, want_logits = _generate(plain)
    from megatrain_ds.streaming import executor as executor_module

    real_call, bound_calls = executor_module.functional_call, []
    monkeypatch.setattr(
        executor_module,
        "functional_call",
        lambda *a, **k: (bound_calls.append(1), real_call(*a, **k))[1],
    )
    fired = []  # a hook on a layer's submodule runs on the cached layer's own module too
    cached.module.model.layers[1].mlp.register_forward_hook(lambda *_: fired.append(1))

    tokens, logits = _generate(cached.module)
    # every cached layer call was its own module's plain forward
    assert not bound_calls and len(fired) == K
    # ... of its template as the executor runs it: tiled too
    from megatrain_ds.model.tiling import TiledForward

    ex = cached.executor
    for module, _, _ in ex.inference.modules.values():
        tiled = [
            n
            for n, m in module.named_modules()
            if isinstance(m.__dict__.get("forward"), TiledForward)
        ]
        assert (
            tiled
            == [
                n
                for n, m in ex.templates[0].named_modules()
                if isinstance(m.__dict__.get("forward"), TiledForward)
            ]
            and "mlp" in tiled
        )
    assert [m.self_attn.layer_idx for m, _, _ in ex.inference.modules.values()] == list(
        range(LAYERS)
    )
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert _loads(cached) == {
        "forward": [0] * LAYERS,
        "backward": [0] * LAYERS,
        "cache": [1] * LAYERS,
    }
    assert cached.executor.inference.state == "on" and cached.executor.inference.builds == 1
    assert [op for op in cached.executor.trace if op[0] == "h2d"] == [
        ("h2d", i, "cache") for i in range(LAYERS)
    ]

    s_tokens, s_logits = _generate(streamed.module)
    assert len(bound_calls) == K * LAYERS  # streaming binds the shared template per call
    assert s_tokens.tolist() == want_tokens.tolist()
    assert torch.equal(s_logits, logits)  # the same kernels on the same bytes
    assert _loads(streamed) == {
        "forward": [K] * LAYERS,
        "backward": [0] * LAYERS,
        "cache": [0] * LAYERS,
    }
    assert streamed.executor.inference.state == "off"

    with torch.inference_mode():  # buffers made outside it are reused inside it (and vice versa)
        out = cached.module.generate(
            PROMPT.to(DEVICE),
            attention_mask=torch.ones_like(PROMPT).to(DEVICE),
            pad_token_id=0,
            max_new_tokens=K,
            min_new_tokens=K,
            do_sample=False,
        )
    assert out.cpu().tolist() == want_tokens.tolist()
    assert _loads(cached)["cache"] == [1] * LAYERS and _loads(cached)["forward"] == [0] * LAYERS

    rates = _tokens_per_s(
        {"cache": cached.module, "streaming": streamed.module, "plain PyTorch": plain}
    )
    with capsys.disabled():
        print(
            f"\n[generate tokens/s, tiny Llama ({LAYERS} layers, batch {PROMPT.shape[0]}, 16 new "
            "tokens, best of 3) "
            f"on {DEVICE}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + "]"
        )
    cached.destroy()
    streamed.destroy()


def test_generate_after_step_uses_new_weights_and_training_frees_the_cache():
    model = tiny_hf("llama", layers=LAYERS)
    template = copy.deepcopy(model)
    engine = _engine(True, model)
    ex = engine.executor
    before_tokens, before_logits = _generate(engine.module)
    assert ex.inference.state == "on"

    engine.module.train()
    ids = _batches()[0]
    loss = engine(input_ids=ids, labels=ids).loss  # the grad-enabled forward frees the cache
    assert ex.inference.state == "idle" and ex.inference.slots == {} and ex.inference.releases == 1
    # the layers' own modules hold no buffer
    own = [module for module, _, _ in ex.inference.modules.values()]
    assert len(own) == LAYERS and all(
        p is None for m in own for sub in m.modules() for p in sub._parameters.values()
    )
    # a no-grad pass while the backward is pending (a DPO reference pass): streamed
    with torch.no_grad():
        engine(input_ids=ids)
    assert ex.inference.state == "off" and "backward is pending" in ex.inference.reason
    engine.backward(loss)
    engine.step()

    streamed = _loads(engine)["forward"]
    tokens, logits = _generate(engine.module)
    want_tokens, want_logits = _generate(_plain_with(engine, template))
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert (logits - before_logits).abs().max() > 1e-3  # the step changed what the model says
    # once before the step, once after: not once per token
    assert _loads(engine)["cache"] == [2] * LAYERS
    assert _loads(engine)["forward"] == streamed  # nothing of the generate streamed
    engine.destroy()


def test_a_write_outside_the_optimizer_reuploads_only_that_layer():
    model = tiny_hf("llama", layers=LAYERS)
    template = copy.deepcopy(model)
    engine = _engine(True, model)
    _, first_logits = _generate(engine.module)
    weight = engine.module.model.layers[1].mlp.down_proj.weight
    with megatrain_ds.zero.GatheredParameters([weight], modifier_rank=0):
        weight.data.mul_(3.0)
    # no grad-enabled forward in between: the cache stays on
    tokens, logits = _generate(engine.module)
    assert engine.executor.inference.builds == 1 and engine.executor.inference.releases == 0
    assert _loads(engine)["cache"] == [1, 2, 1]  # layer 1's version changed, the others' did not
    want_tokens, want_logits = _generate(_plain_with(engine, template))
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(logits, first_logits)
    engine.destroy()


def test_rollouts_before_every_step_leave_training_equal_to_pytorch():
    """A rollout (cached generate) before each step's loss, on the engine and on the plain copy:
    losses, every gradient and the trained weights equal plain PyTorch's (test_paths._compare), and
    the cache is rebuilt at each rollout from the updated weights."""
    rollouts = []

    def prepare(engine):
        engine.executor.inference.setting = True  # _compare's config has no megatrain block
        # no "auto" placement (CUDA): kept layers have buffers of their own, the cache would hold
        # none of them
        engine.auto_placer.keep = engine.auto_placer.device_state = False

    def loss_fn(m, ids):
        with torch.no_grad():
            m.module.eval() if isinstance(m, megatrain_ds.MegaTrainEngine) else m.eval()
            target = m.module if isinstance(m, megatrain_ds.MegaTrainEngine) else m
            prompt = ids[:, :4].to(DEVICE)
            rollouts.append(
                target.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    pad_token_id=0,
                    max_new_tokens=3,
                    min_new_tokens=3,
                    do_sample=False,
                ).cpu()
            )
            target.train()
        return _logits_loss(m, ids)

    engine = _compare(tiny_hf("llama"), loss_fn, _batches(), prepare=prepare)
    # engine == plain
    assert [a.tolist() for a in rollouts[1::2]] == [a.tolist() for a in rollouts[0::2]]
    assert engine.executor.inference.builds == 3 and engine.executor.inference.releases == 3
    # one upload per layer per rollout (3 new tokens each)
    assert _loads(engine)["cache"] == [3] * 3


def test_bf16_with_a_kept_layer():
    """bf16 (the fp32 master streamed and cast on the device: the cache shares the slots' stage
    buffer) and a kept layer (it has a buffer of its own already: the cache does not copy it): the
    same logits as streaming."""
    model = tiny_hf("llama", layers=LAYERS)
    engines = [
        _engine(cache, copy.deepcopy(model), bf16=True, keep_activations=1)
        for cache in (True, False)
    ]
    assert engines[0].executor.slots[0].stage is not None  # fp32 over the wire, bf16 in the slots
    outs = [_generate(engine.module) for engine in engines]
    assert outs[0][0].tolist() == outs[1][0].tolist() and torch.equal(outs[0][1], outs[1][1])
    cache = engines[0].executor.inference
    assert (
        sorted(cache.slots) == [0, 1]
        and cache.nbytes() == 2 * engines[0].store.layouts[0].numel * 2
    )
    assert (
        _loads(engines[0])["cache"] == [1] * LAYERS
        and _loads(engines[0])["forward"] == [0] * LAYERS
    )
    # every layer ran as its own module, the kept one bound to its kept buffer
    ex = engines[0].executor
    assert sorted(cache.modules) == [0, 1, 2] and cache.modules[2][1] is ex.keep_slots[2]
    # a training step (the kept layer's graph, its weights rewritten in place), then again
    for engine in engines:
        engine.module.train()
        ids = _batches()[0]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    assert all(p is None for sub in cache.modules[2][0].modules() for p in sub._parameters.values())
    again = [_generate(engine.module) for engine in engines]
    assert again[0][0].tolist() == again[1][0].tolist() and torch.equal(again[0][1], again[1][1])
    assert not torch.equal(again[0][1], outs[0][1])  # the new weights
    for engine in engines:
        engine.destroy()


def test_policy_knobs():
    assert (
        MegatrainSettings().inference_cache == "auto"
        and MegatrainSettings().inference_cache_memory == 0.5
    )
    for bad in (
        {"inference_cache": "yes"},
        {"inference_cache": 1},
        {"inference_cache_memory": 1.5},
        {"inference_cache_memory": True},
    ):
        with pytest.raises(ConfigError, match="megatrain.inference_cache"):
            MegatrainSettings(**bad)
    # "auto" on the CPU: the host holds the layers already; no-grad forwards stream
    if DEVICE == "cpu":
        engine = _engine("auto")
        _generate(engine.module, k=2)
        assert (
            engine.executor.inference.state == "off"
            and "CUDA only" in engine.executor.inference.reason
        )
        assert _loads(engine)["forward"] == [2] * LAYERS and _loads(engine)["cache"] == [0] * LAYERS
        engine.destroy()


@pytest.mark.gpu
def test_auto_on_cuda_caches_when_the_layers_fit():
    engine = _engine("auto")
    _generate(engine.module, k=4)
    assert engine.executor.inference.state == "on", engine.executor.inference.reason
    assert _loads(engine)["cache"] == [1] * LAYERS and _loads(engine)["forward"] == [0] * LAYERS
    engine.destroy()
    # no layer fits in that share: stream as before
    tight = _engine("auto", inference_cache_memory=1e-9)
    _generate(tight.module, k=4)
    assert tight.executor.inference.state == "off", tight.executor.inference.reason
    assert _loads(tight)["forward"] == [4] * LAYERS and _loads(tight)["cache"] == [0] * LAYERS
    tight.destroy()


def test_data_parallel_two_ranks(tmp_path):
    """2 ranks (gloo, the two processes started directly: torchrun's own start-up would add
    seconds)."""
    from tests.integration.test_dp import _env, _port

    script = Path(__file__).resolve().parents[1] / "scripts" / "dp_generate.py"

    def launch():  # both ranks; the first failure (or success) of the two, with both logs
        port = str(_port())
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), "--out", str(tmp_path)],
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(
                    _env(),
                    RANK=str(r),
                    LOCAL_RANK=str(r),
                    WORLD_SIZE="2",
                    LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                ),
            )
            for r in range(2)
        ]
        done = [(proc, *proc.communicate(timeout=300)) for proc in procs]
        proc = next((d[0] for d in done if d[0].returncode != 0), procs[0])
        return subprocess.CompletedProcess(
            proc.args, proc.returncode, "".join(d[1] for d in done), "".join(d[2] for d in done)
        )

    proc = run_again_after_exit_abort(launch)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for phase, cache_loads in (("first", 1), ("after_step", 2)):
            got = report[phase]
            assert got["same_tokens"] and got["max_logit_diff"] <= 1e-5, (rank, phase, got)
            assert got["loads"]["cache"] == [cache_loads] * 3, (rank, phase, got)
        assert report["after_step"]["loads"]["forward"] == [1] * 3  # the training forward only


def test_a_lora_model_generates_from_the_cache_as_plain_peft():
    """A peft LoRA model (adapters inside the layers, the base frozen): its cached layers run as
    their own modules and generate what streaming and the plain peft model generate."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        tiny_hf("llama", layers=LAYERS),
        peft.LoraConfig(
            # non-zero adapters: they count
            r=4,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,
        ),
    )
    plain = copy.deepcopy(lora).to(DEVICE)
    cached, streamed = _engine(True, copy.deepcopy(lora)), _engine(False, copy.deepcopy(lora))
    want_tokens, want_logits = _generate(plain)
    for engine in (cached, streamed):
        tokens, logits = _generate(engine.module)
        assert tokens.tolist() == want_tokens.tolist()
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert sorted(cached.executor.inference.modules) == list(range(LAYERS))
    cached.destroy()
    streamed.destroy()
