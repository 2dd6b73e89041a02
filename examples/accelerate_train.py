"""Fine-tune a causal LM with accelerate, the way accelerate's own examples do; DeepSpeed comes from
the yaml.

Launch (CPU or one GPU; nothing is downloaded):
    accelerate launch --config_file examples/accelerate_ds.yaml examples/accelerate_train.py
    MEGATRAIN_DS=1 accelerate launch --config_file examples/accelerate_ds.yaml
        examples/accelerate_train.py

The script knows nothing about megatrain_ds: with MEGATRAIN_DS=1 the same script, config and yaml
train on megatrain_ds (one line on stderr says so), without it on DeepSpeed ZeRO-3. The model is
loaded with ``from_pretrained`` after the Accelerator exists, so with ``zero3_init_flag`` it is
built under ``deepspeed.zero.Init``. When ``--model_dir`` does not exist yet, a small random
byte-level Qwen2 is written there first. The data are random windows of ``examples/data/sample.txt``
as bytes (vocabulary 256).

The optimizer and scheduler are the script's own (torch AdamW, a linear warmup/decay), unless the
DeepSpeed config has ``optimizer`` / ``scheduler`` blocks (a ``deepspeed_config_file`` in the yaml):
then they are accelerate's ``DummyOptim`` / ``DummyScheduler`` and DeepSpeed's config builds them.
At the end the full weights are saved with ``accelerator.get_state_dict`` (needs
``zero3_save_16bit_model: true``), in ``--out_dir``, loadable with ``from_pretrained``; ``--report``
writes the per-micro-step losses as JSON.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler, set_seed

HERE = Path(__file__).resolve().parent

# ---- defaults -----------------------------------------------------------------------------------
STEPS = 30  # optimizer steps (each = the yaml's gradient_accumulation_steps micro-batches)
BATCH = 4  # sequences per micro-batch
SEQ_LEN = 64  # bytes (= tokens) per sequence
LR = 1e-3  # peak learning rate (linear warmup over 10% of the steps, then linear decay)


def write_tiny_model(model_dir: str, seed: int, layers: int = 2, hidden: int = 64) -> None:
    """A random byte-level Qwen2, saved as a Hugging Face folder (stands in for a downloaded
    checkpoint)."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(model_dir)


class ByteWindows(torch.utils.data.Dataset):
    """Fixed random windows of a text file's bytes."""

    def __init__(self, path: Path, seq_len: int, count: int, seed: int) -> None:
        data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(data) - seq_len, (count,), generator=gen)
        self.windows = torch.stack([data[s : s + seq_len] for s in starts.tolist()])

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", default="runs/accelerate_example/init")
    parser.add_argument("--out_dir", default="runs/accelerate_example/final")
    parser.add_argument(
        "--report", default=None, help="write {engine, loss, lr, grad_norm} as JSON here"
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--batch_size", type=int, default=BATCH)
    parser.add_argument("--seq_len", type=int, default=SEQ_LEN)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator()
    if accelerator.is_main_process and not os.path.isdir(args.model_dir):
        write_tiny_model(args.model_dir, args.seed)
    accelerator.wait_for_everyone()
    set_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    ds_config = (
        accelerator.state.deepspeed_plugin.deepspeed_config
        if accelerator.state.deepspeed_plugin
        else {}
    )
    # a DeepSpeed config file's value wins at prepare()
    ga = ds_config.get("gradient_accumulation_steps")
    ga = ga if isinstance(ga, int) else accelerator.gradient_accumulation_steps
    dataset = ByteWindows(
        HERE / "data" / "sample.txt", args.seq_len, args.steps * ga * args.batch_size, args.seed
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )

    if "optimizer" in ds_config:
        optimizer = DummyOptim(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    if "scheduler" in ds_config:
        scheduler = DummyScheduler(optimizer, total_num_steps=args.steps, warmup_num_steps=warmup)
    else:
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, args.steps)

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.print(f"engine: {type(model).__module__}.{type(model).__name__}")

    report = {
        "engine": f"{type(model).__module__}.{type(model).__name__}",
        "loss": [],
        "lr": [],
        "grad_norm": [],
    }
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                report["grad_norm"].append(
                    float(accelerator.clip_grad_norm_(model.parameters(), 1.0))
                )
                report["lr"].append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        report["loss"].append(loss.item())
    first, last = report["loss"][: ga * 5], report["loss"][-ga * 5 :]
    accelerator.print(
        f"loss: first {sum(first) / len(first):.4f} -> last {sum(last) / len(last):.4f} "
        f"over {len(report['loss'])} micro-steps"
    )

    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # ZeRO-3: gathered 16-bit (here fp32) weights
    accelerator.unwrap_model(model).save_pretrained(
        args.out_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
    )
    if args.report and accelerator.is_main_process:
        with open(args.report, "w") as f:
            json.dump(report, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
