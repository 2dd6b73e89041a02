"""Fine-tune a causal LM with the Hugging Face Trainer and a DeepSpeed config full of "auto" values.

Launch it as any Trainer + DeepSpeed script (one process or several; CPU or GPUs; nothing is
downloaded):
    # DeepSpeed ZeRO-3, CPU offload
    torchrun --nproc_per_node 1 examples/trainer_train.py
    # the same, trained by megatrain_ds
    MEGATRAIN_DS=1 torchrun --nproc_per_node 1 examples/trainer_train.py
    # continue from the last checkpoint
    MEGATRAIN_DS=1 torchrun --nproc_per_node 1 examples/trainer_train.py --resume

The script knows nothing about megatrain_ds.
``TrainingArguments(deepspeed="examples/trainer_ds_config.json")`` fills the config's "auto" values
(batch sizes, learning rate, warmup, clipping); the model is loaded with ``from_pretrained`` after
the arguments exist, so under ZeRO-3 it is built inside ``deepspeed.zero.Init``. When
``--model_dir`` does not exist yet, a small random byte-level Qwen2 is written there first. The data
are fixed random windows of ``examples/data/sample.txt`` as bytes (vocabulary 256).

Checkpoints go to ``--output_dir/checkpoint-N`` every ``--save_steps`` (DeepSpeed's ``global_stepN``
folder inside); ``--resume`` passes ``resume_from_checkpoint=True``. At the end the loss on held-out
windows is measured and ``trainer.save_model(--output_dir/final)`` writes weights
``from_pretrained`` loads (the config sets ``stage3_gather_16bit_weights_on_model_save``).
``--report`` writes the run's numbers as JSON.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent

# ---- defaults -----------------------------------------------------------------------------------
MAX_STEPS = 40  # optimizer steps
SAVE_STEPS = 20  # a checkpoint every this many steps
BATCH = 4  # sequences per micro-batch
GA = 2  # gradient accumulation steps
SEQ_LEN = 64  # bytes (= tokens) per sequence
# peak learning rate (WarmupDecayLR in the DeepSpeed config; warmup 10% of the steps)
LR = 1e-3
EVAL_WINDOWS = 8  # held-out windows, one evaluation batch


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


def byte_windows(seq_len: int, count: int, seed: int, held_out: bool = False) -> torch.Tensor:
    """(count, seq_len) random windows of the sample text's bytes: the first 90% for training, the
    rest held out."""
    data = torch.tensor(list((HERE / "data" / "sample.txt").read_bytes()), dtype=torch.long)
    split = int(0.9 * len(data))
    data = data[split:] if held_out else data[:split]
    starts = torch.randint(
        0, len(data) - seq_len, (count,), generator=torch.Generator().manual_seed(seed)
    )
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


class Windows(torch.utils.data.Dataset):
    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", default="runs/trainer_example/init")
    parser.add_argument("--output_dir", default="runs/trainer_example")
    parser.add_argument("--deepspeed", default=str(HERE / "trainer_ds_config.json"))
    parser.add_argument("--max_steps", type=int, default=MAX_STEPS)
    parser.add_argument("--save_steps", type=int, default=SAVE_STEPS)
    parser.add_argument("--batch_size", type=int, default=BATCH)
    parser.add_argument("--grad_accum", type=int, default=GA)
    parser.add_argument("--seq_len", type=int, default=SEQ_LEN)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resume", action="store_true", help="resume_from_checkpoint=True (the latest checkpoint)"
    )
    parser.add_argument(
        "--report", default=None, help="write {engine, losses, eval_loss, ...} as JSON here"
    )
    args = parser.parse_args()

    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        per_device_eval_batch_size=EVAL_WINDOWS,
        learning_rate=args.lr,
        weight_decay=0.01,
        warmup_steps=max(1, args.max_steps // 10),
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        seed=args.seed,
        report_to="none",
        disable_tqdm=True,
    )
    if training_args.process_index == 0 and not os.path.isdir(args.model_dir):
        write_tiny_model(args.model_dir, args.seed)
    training_args.distributed_state.wait_for_everyone()
    # after TrainingArguments: with a ZeRO-3 config this builds the model inside deepspeed.zero.Init
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    built_on = sorted({p.device.type for p in model.parameters()})

    train = Windows(
        byte_windows(args.seq_len, args.max_steps * args.batch_size * args.grad_accum, args.seed)
    )
    held_out = Windows(byte_windows(args.seq_len, EVAL_WINDOWS, args.seed + 1, held_out=True))
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=train, eval_dataset=held_out
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(args.output_dir, "final"))

    engine = trainer.model_wrapped
    steps = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    if training_args.process_index == 0:
        print(
            f"engine {type(engine).__module__}.{type(engine).__name__}: loss {steps[0][1]:.4f} "
            "(step "
            f"{steps[0][0]}) -> {steps[-1][1]:.4f} (step {steps[-1][0]}); held-out loss "
            f"{eval_loss:.4f}"
        )
        if args.report:
            with open(args.report, "w") as f:
                json.dump(
                    {
                        "engine": f"{type(engine).__module__}.{type(engine).__name__}",
                        "built_on": built_on,
                        "steps": steps,
                        "eval_loss": eval_loss,
                        "global_step": trainer.state.global_step,
                    },
                    f,
                )


if __name__ == "__main__":
    main()
