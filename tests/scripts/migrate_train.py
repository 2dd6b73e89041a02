"""Train a tiny Llama with real DeepSpeed or with megatrain_ds, optionally resuming from and saving
a checkpoint.

    python migrate_train.py --engine deepspeed --config ds.json --steps 3 --save ckpt --then 3
        --out a.json
    python migrate_train.py --engine megatrain --config ds.json --load ckpt --steps 3 --out b.json

Run under a one-process world (MASTER_ADDR/PORT, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1,
CUDA_VISIBLE_DEVICES=""). The batch of micro step k is seeded by k (4 batches in turn), so a resumed
run sees the data the uninterrupted run would have seen. ``--save`` saves after ``--steps``
optimizer steps (with a client state) and ``--then`` keeps training in the same process: the
uninterrupted reference. tests/integration/test_migration.py drives it.
"""

import argparse
import json

import torch

from tests.models import tiny_hf

CLIENT_STATE = {"epoch": 3, "note": "saved by the first run", "sampler": torch.arange(4)}


def _train(engine, first_micro: int, steps: int, record: dict) -> int:
    micro = first_micro
    for _ in range(steps * engine.gradient_accumulation_steps()):
        # 4 batches, revisited: the loss falls
        gen = torch.Generator().manual_seed(1000 + micro % 4)
        ids = torch.randint(
            0, 256, (engine.train_micro_batch_size_per_gpu(), 16), generator=gen
        ).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        record["loss"].append(loss.item())
        if boundary:
            record["lr"].append(engine.get_lr()[0])
        micro += 1
    return micro


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["deepspeed", "megatrain"], required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "--seed", type=int, default=0, help="model init (a resumed run must not depend on it)"
    )
    parser.add_argument(
        "--load", default=None, help="checkpoint folder to resume from (its 'latest')"
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps before --save")
    parser.add_argument("--save", default=None)
    parser.add_argument("--then", type=int, default=0, help="optimizer steps after --save")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if args.engine == "deepspeed":
        import deepspeed
    else:
        import megatrain_ds as deepspeed
    with open(args.config) as f:
        config = json.load(f)
    model = tiny_hf("llama", tied=False, seed=args.seed)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    record = {"loss": [], "lr": [], "resumed_at": None, "client": None}
    micro = 0
    if args.load:
        path, client = engine.load_checkpoint(args.load)
        record["resumed_at"] = [path, engine.global_steps, engine.global_samples]
        record["client"] = {
            k: v.tolist() if torch.is_tensor(v) else v
            for k, v in client.items()
            if k in CLIENT_STATE
        }
        record["client_keys"] = sorted(client)
        micro = engine.global_steps * engine.gradient_accumulation_steps()
    micro = _train(engine, micro, args.steps, record)
    if args.save:
        engine.save_checkpoint(args.save, client_state=CLIENT_STATE)
        micro = _train(engine, micro, args.then, record)
    with open(args.out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
