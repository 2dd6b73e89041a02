"""The loss of a fine-tune by optimizer-state precision: exact fp32 masters and moments, bf16
masters (``bf16_master_weights_and_grads``), bf16 masters and bf16 moments
(``bf16_optimizer_states``: [Note: compact moments] in megatrain_ds/optim/host_update.py).

    python -m benchmarks.state_precision_curve --out DIR [--pretrain-steps 400 --steps 300
        --lr 1e-4]

What it does: trains examples/finetune.py's byte-level Qwen2 on the first half of
examples/data/sample.txt's training bytes (exact state, the example's config: lr 1e-3) to get a
pretrained model, then fine-tunes copies of it on the second half at a fine-tuning learning rate
(``--lr``, constant after a short warm-up), once per state precision, from the same weights, on the
same batches; the validation loss (the held-out last 10%) every ``--eval-every`` steps. Writes
DIR/curve.json and prints a table. bf16 compute in all three (the modes need it), on the CPU or one
GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import finetune as demo  # noqa: E402  (examples/finetune.py: model, data, evaluation)

import megatrain_ds  # noqa: E402

MODES = {
    "exact (fp32 masters and moments)": {"enabled": True},
    "bf16 masters": {"enabled": True, "bf16_master_weights_and_grads": True},
    "bf16 masters + bf16 moments": {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    },
}


def _config(bf16: dict, lr: float, steps: int, warmup: int) -> dict:
    cfg = json.loads(demo.CONFIG.read_text())
    cfg["bf16"] = bf16
    # GA 1: no fp32 accumulator
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 16, 1
    cfg["steps_per_print"] = None
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": lr,
            "warmup_num_steps": min(warmup, steps),
            "warmup_type": "linear",
        },
    }
    return cfg


def _run(
    model, cfg: dict, data, val_windows, steps: int, eval_every: int, seed: int
) -> tuple[dict, float]:
    engine, *_ = megatrain_ds.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    mb, ga = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(seed)
    val = {0: demo.evaluate(engine, val_windows, mb)}
    for step in range(1, steps + 1):
        for _ in range(ga):
            x = demo.random_windows(data, mb, demo.SEQ_LEN, gen, engine.device)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        if step % eval_every == 0 or step == steps:
            val[step] = demo.evaluate(engine, val_windows, mb)
            print(f"  step {step:4d}  val loss {val[step]:.4f}", flush=True)
    engine.synchronize()
    host = engine.store.nbytes() / max(1, engine.store.n_train)
    weights = {k: v.clone() for k, v in engine.master_state_dict().items()}
    engine.destroy()
    return val, host, weights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pretrain-steps", type=int, default=400)
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps per mode")
    p.add_argument(
        "--lr", type=float, default=1e-4, help="fine-tuning learning rate (after a 20-step warm-up)"
    )
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    train, val_data = demo.load_bytes(demo.DATA)
    first, second = train[: len(train) // 2], train[len(train) // 2 :]
    val_windows = demo.validation_windows(val_data, demo.SEQ_LEN, demo.EVAL_WINDOWS)
    shape = argparse.Namespace(hidden=demo.HIDDEN, layers=demo.LAYERS, seq_len=demo.SEQ_LEN)
    base = demo.build_model(shape)
    print(
        f"pretraining {args.pretrain_steps} steps (exact state, lr 1e-3) on the first half",
        flush=True,
    )
    pre_cfg = _config(MODES["exact (fp32 masters and moments)"], 1e-3, args.pretrain_steps, 20)
    _, _, weights = _run(
        base, pre_cfg, first, val_windows, args.pretrain_steps, args.pretrain_steps, args.seed
    )
    results = {}
    for name, bf16 in MODES.items():
        print(f"fine-tuning: {name}, lr {args.lr}", flush=True)
        model = demo.build_model(shape)
        missing, unexpected = model.load_state_dict(
            {k: v.to(torch.float32) for k, v in weights.items()}, strict=False
        )
        # (the head is tied to the embedding)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise SystemExit(
                f"the pretrained weights do not fit the model: missing {missing}, unexpected "
                f"{unexpected}"
            )
        val, host, _ = _run(
            model,
            _config(bf16, args.lr, args.steps, 20),
            second,
            val_windows,
            args.steps,
            args.eval_every,
            args.seed + 1,
        )
        results[name] = {"val_loss": val, "host_bytes_per_streamed_param": host}
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "argv": sys.argv,
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "pretrain_steps": args.pretrain_steps,
        "steps": args.steps,
        "lr": args.lr,
        "results": results,
    }
    (args.out / "curve.json").write_text(json.dumps(record, indent=1))
    steps = sorted(next(iter(results.values()))["val_loss"])
    print(
        f"\n{'validation loss at step':<36}"
        + "".join(f"{s:>8}" for s in steps)
        + f"{'host B/param':>14}"
    )
    for name, r in results.items():
        print(
            f"{name:<36}"
            + "".join(f"{r['val_loss'][s]:>8.4f}" for s in steps)
            + f"{r['host_bytes_per_streamed_param']:>14.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
