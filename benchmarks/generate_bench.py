"""generate() tokens/s on the GPU (``python -m benchmarks.generate_bench``, CUDA): megatrain_ds with
the inference cache, megatrain_ds streaming every layer per token, and the whole model on the GPU
(plain PyTorch). Qwen2.5-3B shape, bf16, random init (layer 0 values repeated), greedy, batch 4,
prompt 128, 32 new tokens; the engine's placement is pinned (no kept layers, no GPU-held optimizer
state), as for a model that does not fit."""

import time

import torch

import megatrain_ds
from benchmarks.build import build_model
from benchmarks.shapes import make_config

NEW, BATCH, PROMPT = 32, 4, 128
cfg = make_config("qwen2.5-3b")
cfg.use_cache = True
ids = torch.randint(
    0, cfg.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0)
).cuda()
rows = []


def timed(model):
    with torch.no_grad():
        # warm-up: kernels compiled/tuned for every shape the timed run meets, cache filled
        for _ in range(2):
            model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        torch.cuda.synchronize()
    return BATCH * NEW / (time.perf_counter() - t), out


plain = build_model(cfg, torch.bfloat16, "fast", 0, device="cpu").cuda()
tps, want = timed(plain)
tps, want = timed(plain)
rows.append(("whole model on the GPU (plain PyTorch)", tps, "-"))
state = {k: v.clone() for k, v in plain.state_dict().items()}
del plain
torch.cuda.empty_cache()
for cache in (True, False):
    model = build_model(cfg, torch.bfloat16, "fast", 0, device="cpu")
    model.load_state_dict(state)
    engine, *_ = megatrain_ds.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": BATCH,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
            # placement pinned: "auto" would keep every layer of this 3B model on the GPU after the
            # first step
            "megatrain": {
                "inference_cache": cache,
                "keep_activations": 0,
                "gpu_optimizer_layers": 0,
            },
        },
    )
    ex = engine.executor
    before = sum(ex.h2d_loads["forward"]) + sum(ex.h2d_loads["cache"])
    tps, got = timed(engine.module)
    loads = sum(ex.h2d_loads["forward"]) + sum(ex.h2d_loads["cache"]) - before
    same = torch.equal(got, want)
    # training after generate: the cache is freed first
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    tps2, _ = timed(engine.module)  # new weights: the cache is refilled once
    rows.append(
        (
            f"megatrain_ds, inference_cache {cache}",
            tps,
            f"{loads} layer loads in 3 generates, tokens == plain: {same}; "
            f"after a step {tps2:.0f} tokens/s",
        )
    )
    engine.destroy()
    del engine, model
    torch.cuda.empty_cache()
print(
    f"\n| generate (Qwen2.5-3B shape, bf16, batch {BATCH}, prompt {PROMPT}, {NEW} new tokens) | "
    "tokens/s | notes |"
)
print("|---|---|---|")
for name, tps, note in rows:
    print(f"| {name} | {tps:.0f} | {note} |")
