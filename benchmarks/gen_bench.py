"""Generation between training steps, as GRPO does it (issue 38): where a rollout's time goes on
megatrain_ds.

    python -m benchmarks.gen_bench --model qwen2.5-1.5b --batch 8 --prompt 64 --new 64

A random-init model of the shape (bf16), one engine as TRL's ZeRO-3 config builds it (AdamW, clip
1.0, bf16); each round is a training step then a greedy ``generate`` of ``--new`` tokens, three
ways: the engine's module as is, the same inside a whole-model ``GatheredParameters`` (TRL's
default), and a plain copy of the model on the device (what DeepSpeed's gathered generate computes
with: the bound). Prints per way the seconds, the microseconds per layer call, the inference cache's
state and the layers streamed H2D during the generate; then a profile of one engine generate (the
Python functions that took the most time). ``--tie-weights 0`` also times the layer calls bound
without functional_call's tie search (an A/B of that cost).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time

import torch

import megatrain_ds
from megatrain_ds.planning.shapes import make_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--repeat", type=int, default=5, help="generates per way and round; the median is printed"
    )
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        make_config(args.model, args.layers), dtype=torch.bfloat16
    )
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    plain = copy.deepcopy(model).to(dev).eval()
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    }
    eng, *_ = megatrain_ds.initialize(model=model, config=cfg)
    ex = eng.executor
    n_layers = len(ex.layouts)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def generate(m, prompt):
        with torch.no_grad():
            return m.generate(
                prompt,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=0,
            )

    def timed(way, fn):
        loads = {d: sum(v) for d, v in ex.h2d_loads.items()}
        times = []
        # one generate is too noisy to compare (2026-11-28: ±25% between rounds)
        for _ in range(args.repeat):
            sync()
            t = time.perf_counter()
            out = fn()
            sync()
            times.append(time.perf_counter() - t)
        dt = statistics.median(times)
        moved = {d: sum(v) - loads[d] for d, v in ex.h2d_loads.items()}
        print(
            f"  {way:<22} {dt:7.3f} s (median of {args.repeat}: {min(times):.3f}-{max(times):.3f}) "
            " "
            f"{dt / args.new / n_layers * 1e6:7.0f} us/layer call  H2D layer loads {moved}  "
            f"{ex.inference.describe()}",
            flush=True,
        )
        return out, dt

    prompt = torch.randint(0, vocab, (args.batch, args.prompt), generator=g)
    rows = []
    for r in range(args.rounds):
        ids = torch.randint(0, vocab, (args.batch, args.prompt + args.new), generator=g)
        sync()
        t = time.perf_counter()
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        sync()
        print(
            f"round {r}: train step {time.perf_counter() - t:.3f} s, loss {loss.item():.4f}",
            flush=True,
        )
        a, t_eng = timed("engine.module", lambda: generate(eng.module, prompt.to(dev)))
        with megatrain_ds.zero.GatheredParameters(list(eng.module.parameters())):
            b, t_gat = timed("gathered", lambda: generate(eng.module, prompt.to(dev)))
        c, t_pl = timed("plain copy (bound)", lambda: generate(plain, prompt.to(dev)))
        rows.append((t_eng, t_gat, t_pl))
    pr = cProfile.Profile()
    pr.enable()
    generate(eng.module, prompt.to(dev))
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-6000:])
    e, gth, pl = rows[-1]
    print(
        f"| model | batch x new | engine s | gathered s | plain s | engine / plain "
        "|\n|---|---|---|---|---|---|\n"
        f"| {args.model} | {args.batch} x {args.new} | {e:.3f} | {gth:.3f} | {pl:.3f} | "
        f"{e / pl:.2f}x |"
    )


if __name__ == "__main__":
    main()
