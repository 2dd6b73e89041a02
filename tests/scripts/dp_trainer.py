"""An HF Trainer script for data-parallel launches (tests/integration/test_dp_launchers.py).

    MEGATRAIN_DS=1 torchrun --nproc_per_node 2 dp_trainer.py --out DIR

The script knows nothing about megatrain_ds:
``TrainingArguments(deepspeed=examples/trainer_ds_config.json)`` (ZeRO-3 offload, every batch size
"auto"), a tiny Qwen2 built with ``from_config`` after the arguments (so under
``deepspeed.zero.Init``), a dataset of indexed samples; the Trainer's sampler and accelerate's
sharding decide which rank trains on which sample (the collator records them). Each rank writes
``DIR/rank{R}.json``: the Trainer's view of the world, ``train_batch_size`` (the filled DeepSpeed
config's and the engine's), the sample indices of each micro-batch, the logged losses, a digest of
the final fp32 parameters.
"""

import argparse
import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

SEQ, VOCAB, SAMPLES = 16, 256, 32
REPO = Path(__file__).resolve().parents[2]


class Indexed(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(
            0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1)
        )

    def __len__(self):
        return SAMPLES

    def __getitem__(self, k):
        return {"index": k, "input_ids": self.ids[k], "labels": self.ids[k]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--deepspeed", default=str(REPO / "examples" / "trainer_ds_config.json"))
    args = parser.parse_args()

    training_args = transformers.TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"),
        deepspeed=args.deepspeed,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        weight_decay=0.01,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
        ),
        dtype=torch.float32,
    )

    batches = []

    def collate(samples):
        batches.append([s["index"] for s in samples])
        return {
            "input_ids": torch.stack([s["input_ids"] for s in samples]),
            "labels": torch.stack([s["labels"] for s in samples]),
        }

    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=Indexed(), data_collator=collate
    )
    trainer.train()
    engine = trainer.model_wrapped
    report = {
        "engine": f"{type(engine).__module__}.{type(engine).__name__}",
        "world_size": training_args.world_size,
        "process_index": training_args.process_index,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "num_processes": trainer.accelerator.num_processes,
        "config_train_batch_size": trainer.accelerator.deepspeed_config["train_batch_size"],
        "train_batch_size": engine.train_batch_size(),
        "ga": engine.gradient_accumulation_steps(),
        "dp_world_size": engine.dp_world_size,
        "global_rank": engine.global_rank,
        "global_step": trainer.state.global_step,
        "batches": batches,
        "logged": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
    }
    from deepspeed.utils import safe_get_full_fp32_param

    digest = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        digest.update(
            name.encode()
            + safe_get_full_fp32_param(p).detach().float().cpu().contiguous().numpy().tobytes()
        )
    report["digest"] = digest.hexdigest()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{report['dist_rank']}.json").write_text(json.dumps(report))
    print("DP_REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
