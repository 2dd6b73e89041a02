"""The LM head of a training step, three ways, on one GPU through megatrain_ds (random-init Qwen2.5
shape, bf16):

- ``fused``: a plain model, ``engine(input_ids=, labels=)``: megatrain_ds's fused head +
  cross-entropy (liger's kernel when installed, else loss.py's chunks), no whole logits;
- ``trl``: the model after TRL's ``add_fused_lm_head`` (as its SFT/DPO/GRPO trainers patch it),
  ``engine(..., labels=, fused_lm_head=True)``: TRL's forward runs as TRL wrote it on the streamed
  decoder ([Note: fused loss only where exact] in megatrain_ds/training/engine_forward.py), its
  chunked log-prob head (Triton on CUDA), no whole logits;
- ``own``: ``"fused_loss": false``: the model's own forward, whole [tokens, vocab] logits.

    python -m benchmarks.trl_head_bench --model qwen2.5-1.5b --seq 4096 --micro 2 --steps 8

Prints one line per way: median step time of the steps after the third (the "auto" placements are
made after the second), tokens/s, the GPU's peak memory, and the first step's loss (the three
compute the same loss). Not yet run on a GPU (the device runs from the main checkout); ``--model
tiny`` smoke-runs it on CPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import megatrain_ds
from megatrain_ds.planning.shapes import make_config


def build(name: str, layers: int | None, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config(name, layers), dtype=torch.bfloat16)


def run(way: str, args) -> dict:
    model = build(args.model, args.layers)
    if way == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "megatrain": {"fused_loss": way != "own"},
    }
    engine, *_ = megatrain_ds.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    times, first_loss = [], None
    cuda = torch.cuda.is_available()  # (CPU: a smoke run, --model tiny)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        ids = torch.randint(0, vocab, (args.micro, args.seq), generator=g)
        sync()
        start = time.perf_counter()
        kwargs = {"fused_lm_head": True} if way == "trl" else {}
        loss = engine(input_ids=ids, labels=ids, **kwargs).loss
        engine.backward(loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
        if first_loss is None:
            first_loss = loss.item()
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    engine.destroy()
    del engine, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    step_s = statistics.median(times[3:])
    return {
        "way": way,
        "step_s": step_s,
        "tokens_s": args.micro * args.seq / step_s,
        "peak_gib": peak / 2**30,
        "loss0": first_loss,
        "times": [round(t, 4) for t in times],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ways", default="fused,trl,own")
    args = p.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"{device} torch {torch.__version__} {args.model} layers={args.layers} "
        f"seq={args.seq} micro={args.micro}",
        flush=True,
    )
    for way in args.ways.split(","):
        r = run(way, args)
        print(
            f"{r['way']:>6}: {r['step_s'] * 1e3:8.1f} ms/step  {r['tokens_s']:9.0f} tokens/s  peak "
            f"{r['peak_gib']:6.2f} GiB  loss0 {r['loss0']:.5f}  steps {r['times']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
