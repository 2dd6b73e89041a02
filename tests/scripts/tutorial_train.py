"""A training script written the way DeepSpeed's tutorials write one.

    deepspeed tutorial_train.py --deepspeed --deepspeed_config ds_config.json --out losses.json

The test suite runs it twice: as is (real DeepSpeed) and with the import line changed to
``import megatrain_ds as deepspeed``. Nothing else differs.
"""

import argparse
import json

import torch
import transformers

import deepspeed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(config)

    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    gen = torch.Generator().manual_seed(1)
    record = {"loss": [], "lr": [], "grad_norm": []}
    micro_steps = args.steps * engine.gradient_accumulation_steps()
    for _ in range(micro_steps):
        ids = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 16), generator=gen)
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        record["loss"].append(loss.item())
        if boundary:
            record["lr"].append(engine.get_lr()[0])
            record["grad_norm"].append(float(engine.get_global_grad_norm()))
    with open(args.out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
