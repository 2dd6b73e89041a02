"""Train a small byte-level Qwen2 language model on a text sample, the DeepSpeed way.

Launch:
    # the defaults below: about 2 minutes on a 2-core CPU
    make demo
    python examples/finetune.py --steps 300 --layers 6

What it does: builds a small Qwen2 model from ``transformers.Qwen2Config`` (random init, nothing is
downloaded), reads ``examples/data/sample.txt`` as raw bytes (every byte is a token, vocabulary
256), holds out the last 10% for validation and trains on random windows of the rest. The loop is an
ordinary DeepSpeed training script; the only difference is the import line ``import megatrain_ds as
deepspeed``. A progress bar shows the training loss and learning rate, a validation loss is measured
every ``--eval-every`` steps, and a summary is printed at the end: the loss should fall from about
5.5 (a uniform guess over 256 bytes) to about 2.5 or lower.

It runs on CPU without a GPU. When a CUDA GPU is present it runs on one GPU and turns on bf16 in the
loaded config dict.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

import megatrain_ds as deepspeed

HERE = Path(__file__).resolve().parent

# ---- defaults ---------------------------------------------------------------------------------
STEPS = 200  # optimizer steps (each = gradient_accumulation_steps micro-batches)
# bytes (= tokens) per training window; 128 takes ~1.9x as long on a 2-core CPU
SEQ_LEN = 64
HIDDEN = 256  # model width
LAYERS = 4  # transformer blocks
INTERMEDIATE = 688  # MLP width
HEADS = 4  # attention heads
KV_HEADS = 2  # key/value heads (grouped-query attention)
VOCAB = 256  # byte-level: tokens are the UTF-8 bytes of the text
EVAL_EVERY = 50  # optimizer steps between validation losses
EVAL_WINDOWS = 16  # fixed validation windows of SEQ_LEN bytes
VAL_FRACTION = 0.10  # last 10% of the text is held out
SEED = 0
DATA = HERE / "data" / "sample.txt"
CONFIG = HERE / "ds_config.json"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps")
    p.add_argument("--layers", type=int, default=LAYERS, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="model width")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="bytes per training window")
    p.add_argument("--config", type=Path, default=CONFIG, help="DeepSpeed JSON config")
    p.add_argument("--seed", type=int, default=SEED, help="random seed")
    p.add_argument(
        "--eval-every", type=int, default=EVAL_EVERY, help="steps between validation losses"
    )
    return p.parse_args()


def load_bytes(path: Path):
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    split = int(len(data) * (1 - VAL_FRACTION))
    return data[:split], data[split:]


def build_model(args) -> torch.nn.Module:
    # Keep the width's ratios when --hidden changes: MLP about 2.7x wide, 64-wide attention heads.
    scale = args.hidden / HIDDEN
    heads = max(1, round(HEADS * scale))
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        intermediate_size=int(INTERMEDIATE * scale) // 8 * 8,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads * KV_HEADS // HEADS),
        max_position_embeddings=max(args.seq_len, 512),
        tie_word_embeddings=True,
    )
    return transformers.Qwen2ForCausalLM(config)


def load_config(path: Path, steps: int) -> dict:
    cfg = json.loads(path.read_text())
    if torch.cuda.is_available():
        cfg["bf16"] = {"enabled": True}
    sched = cfg.get("scheduler", {}).get("params", {})
    if "total_num_steps" in sched:
        sched["total_num_steps"] = steps  # decay over the run actually asked for
    return cfg


def random_windows(data, batch: int, seq_len: int, gen, device):
    starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()]).to(device)


def validation_windows(data, seq_len: int, count: int):
    starts = torch.linspace(0, len(data) - seq_len, count).long()
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def evaluate(engine, windows, batch: int) -> float:
    engine.eval()
    losses = []
    with torch.no_grad():
        for chunk in windows.split(batch):
            x = chunk.to(engine.device)
            losses.append(engine(input_ids=x, labels=x).loss.float().item())
    engine.train()
    return sum(losses) / len(losses)


def train(engine, train_data, val_windows, args):
    ga = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    gen = torch.Generator().manual_seed(args.seed)
    history, val = [], {0: evaluate(engine, val_windows, mb)}
    ema, train_time, tokens = None, 0.0, 0
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", dynamic_ncols=True)
    for step in bar:
        start, step_loss = time.perf_counter(), 0.0
        for _ in range(ga):
            x = random_windows(train_data, mb, args.seq_len, gen, engine.device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            step_loss += loss.float().item() / ga
            tokens += x.numel()
        train_time += time.perf_counter() - start
        history.append(step_loss)
        ema = step_loss if ema is None else 0.9 * ema + 0.1 * step_loss
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{engine.get_lr()[0]:.2e}")
        if step % args.eval_every == 0 or step == args.steps:
            val[step] = evaluate(engine, val_windows, mb)
            bar.write(f"step {step:4d}  train loss {ema:.3f}  val loss {val[step]:.3f}")
    return history, val, tokens / max(train_time, 1e-9)


def summarize(history, val, tokens_per_s, n=10):
    n = min(n, len(history))
    first = sum(history[:n]) / len(history[:n])
    last = sum(history[-n:]) / len(history[-n:])
    steps = sorted(val)
    print("\nsummary")
    print(f"  train loss  first {n} steps {first:.3f} -> last {n} steps {last:.3f}")
    print(
        f"  val loss    step {steps[0]} {val[steps[0]]:.3f} -> step {steps[-1]} "
        f"{val[steps[-1]]:.3f}"
        f"  (uniform guess: {math.log(VOCAB):.3f})"
    )
    print(f"  throughput  {tokens_per_s:,.0f} tokens/s (training steps only)")


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    train_data, val_data = load_bytes(DATA)
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = load_config(args.config, args.steps)
    model_engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    print(
        f"model: Qwen2, {args.layers} layers, hidden {args.hidden}, {n_params / 1e6:.2f}M params | "
        f"data: {len(train_data):,} train / {len(val_data):,} val bytes | device: "
        f"{model_engine.device}"
    )
    val_windows = validation_windows(val_data, args.seq_len, EVAL_WINDOWS)
    history, val, tokens_per_s = train(model_engine, train_data, val_windows, args)
    summarize(history, val, tokens_per_s)
    if hasattr(model_engine, "destroy"):
        model_engine.destroy()


if __name__ == "__main__":
    main()
